"""`relaytune eval RUN_DIR`: eval loss and perplexity of each committed adapter.

The loss is computed exactly as training's `record_eval` does (same rows, masks and
token weighting: the sum of target-token losses over all rows divided by the number
of target tokens), so a checkpoint's value matches the `eval_loss` training logged
at its step.

Cache: one file, `output_dir/eval_cache.json`, keyed by (adapter sha256 from the
manifest, eval-data fingerprint, device/dtype). Not a file inside each checkpoint:
committed folders stay exactly as their manifest describes them (the mirror and
retention treat them as immutable, and a mirrored copy may be read-only), a key by
content follows an adapter through renames and never goes stale when `--data`
changes, and identical adapters (final/ and its last checkpoint, best/ and its
step) are evaluated once. Entries of pruned checkpoints are harmless.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

from relaytune.errors import UserError
from relaytune.log import info
from relaytune.run_dir import load_adapter_slot, put_adapter, run_config, run_dir, select

CACHE = "eval_cache.json"


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
        if ref is not None and not (ref.path / "adapter_model.safetensors").is_file():
            from relaytune.log import warn

            warn(f"{ref.name} was removed while evaluating (retention of a running training); skipped")
            continue
        if ref is None:
            with model.disable_adapter():
                loss, tokens = eval_loss(model, rows, cfg.per_device_train_batch_size,
                                         tokenizer.pad_token_id, precision)
        else:
            put_adapter(model, ref)
            loss, tokens = eval_loss(model, rows, cfg.per_device_train_batch_size,
                                     tokenizer.pad_token_id, precision)
        cache[key] = {"eval_loss": loss, "tokens": tokens, "name": name, "time": time.time()}
        _write_cache(out, cache)  # after each one: an interrupted eval keeps what it finished
        results.append(EvalResult(name, step, loss, tokens))
    return results


def eval_rows(cfg, tokenizer, data: str | None):
    """The run's eval split, or a given file, through training's own pipeline (reading,
    chat template, masks, truncation, packing)."""
    import tempfile

    from relaytune.data.prepare import prepare_data

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


def eval_loss(model, rows, batch_size: int, pad_id: int, precision) -> tuple[float, int]:
    """Token-weighted mean loss over `rows`, as training's record_eval computes it."""
    import torch

    from relaytune.training.loss import causal_lm_loss, supports_chunked_loss
    from relaytune.data.batches import micro_batches

    autocast = (torch.autocast(precision.device.type, dtype=precision.autocast)
                if precision.autocast else contextlib.nullcontext())
    total, count = 0.0, 0
    model.eval()
    with torch.no_grad(), autocast:
        for batch in micro_batches(rows, batch_size, pad_id):
            batch = {k: v.to(precision.device) for k, v in batch.items()}
            count += int((batch["labels"][:, 1:] != -100).sum())
            # num_items=1 makes it the sum over target tokens
            total += causal_lm_loss(model, batch, 1, chunked=supports_chunked_loss(model)).float().item()
    return total / max(count, 1), count


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
        out.setdefault(key.split("|", 1)[0], entry["eval_loss"])
    return out


def _read_cache(run: Path) -> dict:
    try:
        data = json.loads((run / CACHE).read_text())
        return data.get("entries", {}) if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}  # absent or damaged: only costs a re-evaluation


def _write_cache(run: Path, entries: dict) -> None:
    tmp = run / f".relaytune-tmp-{CACHE}"
    try:
        tmp.write_text(json.dumps({"version": 1, "entries": entries}, indent=1, sort_keys=True))
        os.replace(tmp, run / CACHE)
    except OSError as e:  # a full or read-only disk costs only the cache, never the results
        from relaytune.log import warn

        warn(f"cannot write {run / CACHE} ({e.strerror or e}); results are not cached")


def main(args) -> None:
    """`relaytune eval` (see cli.py for the options)."""
    results = evaluate_run(args.run_dir, args.checkpoints, args.data, args.config,
                           include_base=not args.no_base)
    print(format_table(results))

