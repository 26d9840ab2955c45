"""`relaytune eval RUN_DIR`: eval loss and perplexity of each committed adapter.

The loss is training's own `relaytune.training.evaluation.eval_loss` (same rows, masks
and token weighting: the sum of target-token losses over all rows divided by the
number of target tokens), so a checkpoint's value matches the `eval_loss` training
logged at its step.

Cache: one file, `RunDir.eval_cache` (eval_cache.json), keyed by (adapter sha256 from the
manifest, eval-data fingerprint, device/dtype). Not a file inside each checkpoint:
committed folders stay exactly as their manifest describes them (the mirror and
retention treat them as immutable, and a mirrored copy may be read-only), a key by
content follows an adapter through renames and never goes stale when `--data`
changes, and identical adapters (final/ and its last checkpoint, best/ and its
step) are evaluated once. Entries of pruned checkpoints are harmless.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

from relaytune import atomic
from relaytune.errors import UserError
from relaytune.log import info, notice, warn
from relaytune.run_dir import ADAPTER, RunDir, load_adapter_slot, put_adapter, run_config, run_dir, select

DESCRIPTION = ("Eval loss and perplexity of each committed checkpoint and final/, on the run's eval split or "
               "a given file, with training's own data pipeline and masks. Cached in RUN_DIR/eval_cache.json "
               "by adapter content, so a re-run evaluates only new checkpoints.")


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("eval", help="eval loss and perplexity of each checkpoint (cached)",
                              description=DESCRIPTION)
    p.add_argument("run_dir", help="the run's output_dir")
    p.add_argument("--checkpoints", help="comma list of step-N, final, best, latest (default: all)")
    p.add_argument("--data", help="a data file to evaluate on instead of the run's eval split")
    p.add_argument("--config", help="the run's config file, if no checkpoint holds it")
    p.add_argument("--no-base", action="store_true", help="leave out the base model (no adapter) row")
    return p


def run(args: argparse.Namespace) -> None:
    results = evaluate_run(args.run_dir, args.checkpoints, args.data, args.config, include_base=not args.no_base)
    print(format_table(results))


@dataclass
class EvalResult:
    name: str  # "base", "step-8", "final"
    step: int | None
    eval_loss: float
    tokens: int
    cached: bool = False

    @property
    def perplexity(self) -> float:
        return math.exp(self.eval_loss) if self.eval_loss < 700 else float("inf")


def evaluate_run(run: str | Path, checkpoints: str | None = None, data: str | None = None,
                 config: str | None = None, include_base: bool = True) -> list[EvalResult]:
    """Evaluate the chosen adapters (default: all committed, and final), using the cache."""
    from relaytune.training.evaluation import eval_loss  # torch: imported only to evaluate
    from relaytune.training.speedups import batch_width

    out = run_dir(run)
    cfg = run_config(out, config)
    refs = select(out, checkpoints)
    cache = _read_cache(out)
    model = tokenizer = precision = None
    rows = data_key = None
    results = []
    for ref in ([None] if include_base else []) + refs:
        if rows is None:  # tokenizing needs the tokenizer, but not the model
            from relaytune.model import choose_precision, load_tokenizer

            tokenizer, precision = load_tokenizer(cfg), choose_precision(cfg)
            rows, label = eval_rows(cfg, tokenizer, data)
            data_key = f"{rows_fingerprint(rows)}|{precision.device.type}-{str(precision.dtype)[6:]}"
            info(f"evaluating on {label}: {len(rows)} rows")
        key = f"{'base' if ref is None else ref.sha256}|{data_key}"
        name = "base" if ref is None else ref.name
        step = None if ref is None else ref.step
        if key in cache:
            hit = cache[key]
            results.append(EvalResult(name, step, hit["eval_loss"], hit["tokens"], cached=True))
            continue
        if model is None:
            model, tokenizer, precision = load_adapter_slot(cfg)
        if ref is not None and not (ref.path / ADAPTER).is_file():
            warn(f"{ref.name} was removed while evaluating (retention of a running training); skipped")
            continue
        if ref is None:
            with model.disable_adapter():
                loss, tokens = eval_loss(model, rows, cfg.micro_batch_hint,
                                         tokenizer.pad_token_id, precision, batch_width(model, cfg))
        else:
            put_adapter(model, ref)
            loss, tokens = eval_loss(model, rows, cfg.micro_batch_hint,
                                     tokenizer.pad_token_id, precision, batch_width(model, cfg))
        cache[key] = {"eval_loss": loss, "tokens": tokens, "name": name, "time": time.time()}
        _write_cache(out, cache)  # after each one: an interrupted eval keeps what it finished
        results.append(EvalResult(name, step, loss, tokens))
    return results


def eval_rows(cfg, tokenizer, data: str | None):
    """The run's eval split, or a given file, through training's own pipeline (reading,
    chat template, masks, truncation, packing)."""
    import tempfile

    from relaytune.data import prepare_data

    if data is None:
        rows = prepare_data(cfg, tokenizer).eval
        if not rows:
            raise UserError("the run has no eval split (neither eval_dataset nor val_set_size is set); "
                            "pass --data FILE")
        return rows, "the run's eval split"
    if not Path(data).exists():
        raise UserError(f"--data: {data} not found")
    # The file as the run's eval_dataset. No cache and a scratch output_dir: evaluating
    # must not replace the run's tokenized-data cache or its quarantine lists.
    with tempfile.TemporaryDirectory(prefix="relaytune-eval-") as scratch:
        as_eval = cfg.model_copy(update={"eval_dataset": str(data), "dataset_cache": False,
                                         "output_dir": scratch})
        rows = prepare_data(as_eval, tokenizer).eval
    if not rows:
        raise UserError(f"--data: no usable rows in {data}")
    return rows, str(data)


def rows_fingerprint(rows) -> str:
    import numpy as np

    h = hashlib.sha256()
    for r in rows:
        h.update(np.asarray(r.input_ids, dtype=np.int64).tobytes())
        h.update(np.asarray(r.labels, dtype=np.int64).tobytes())
        h.update(repr(getattr(r, "segments", None)).encode())
    return h.hexdigest()[:16]


def format_table(results: list[EvalResult]) -> str:
    """The table `relaytune eval` prints; `*` marks the lowest eval loss among the adapters."""
    adapters = [r for r in results if r.name != "base"]
    best = min(adapters, key=lambda r: r.eval_loss) if adapters else None
    lines = [f"{'adapter':<12} {'step':>7} {'eval_loss':>10} {'perplexity':>11}  "]
    for r in results:
        mark = "*" if r is best else " "
        step = "-" if r.step is None else str(r.step)
        lines.append(f"{r.name:<12} {step:>7} {r.eval_loss:>10.4f} {r.perplexity:>11.3f} {mark}"
                     + ("  (cached)" if r.cached else ""))
    if best is not None:
        lines.append(f"* lowest eval loss: {best.name}")
    return "\n".join(lines)


def cached_losses(run: Path) -> dict[str, float]:
    """adapter sha256 -> eval loss on the run's eval data, for `status` (any device)."""
    out = {}
    for key, entry in _read_cache(run).items():
        if isinstance(entry, dict) and isinstance(entry.get("eval_loss"), (int, float)):
            out.setdefault(key.split("|", 1)[0], entry["eval_loss"])
    return out


def _read_cache(run: Path) -> dict:
    path = RunDir(run).eval_cache
    try:
        raw = path.read_bytes()
    except OSError:
        return {}
    try:
        data = json.loads(raw.rstrip(b"\0 \t\r\n") or b"{}")
    except (ValueError, RecursionError):
        notice(f"{path} is torn or damaged; ignored it (costs only a re-evaluation)")
        return {}
    entries = data.get("entries", {}) if isinstance(data, dict) else {}
    return entries if isinstance(entries, dict) else {}


def _write_cache(run: Path, entries: dict) -> None:
    path = RunDir(run).eval_cache
    try:
        atomic.replace_file(path, json.dumps({"version": 1, "entries": entries}, indent=1, sort_keys=True))
    except OSError as e:  # a full or read-only disk costs only the cache, never the results
        warn(f"cannot write {path} ({e.strerror or e}); results are not cached")

