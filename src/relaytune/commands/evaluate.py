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
from relaytune.commands.run_folder import inner_folder
from relaytune.config.urls import is_url
from relaytune.errors import UserError
from relaytune.log import info, notice, warn
from relaytune.redact import redact_url
from relaytune.run_dir import ADAPTER, RunDir, load_adapter_slot, put_adapter, run_config, run_dir, select

EVAL_DATA = "eval-data"  # RUN/eval-data/<file stem>-<hash>/: what reading a --data file lists (its bad rows)

DESCRIPTION = ("Eval loss and perplexity of each committed checkpoint and final/, on the run's eval split or "
               "a given file, with training's own data pipeline and masks. Cached in RUN_DIR/eval_cache.json "
               "by adapter content, so a re-run evaluates only new checkpoints.")


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("eval", help="eval loss and perplexity of each checkpoint (cached)",
                              description=DESCRIPTION)
    p.add_argument("run_dir", help="the run's output_dir, or one checkpoint's folder (RUN/checkpoints/step-N)")
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

    out, checkpoints = adapter_path_as_run(run, checkpoints, "--checkpoints")
    out = run_dir(out)
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
    from relaytune.data import prepare_data

    if data is None:
        rows = prepare_data(cfg, tokenizer).eval
        if not rows:
            raise UserError("the run has no eval split (neither eval_dataset nor val_set_size is set); "
                            "pass --data FILE")
        return rows, "the run's eval split"
    if not Path(data).exists():  # shown without a URL's credentials, should one be typed here
        raise UserError(f"--data: {redact_url(data)} not found" + ("; give a local file" if is_url(data) else ""))
    # The file as the run's eval_dataset. No cache and an output_dir of its own: evaluating must not
    # replace the run's tokenized-data cache or its quarantine lists, but the list of the file's bad
    # rows that the messages point to must outlive this process (a temporary folder did not).
    scratch = _data_folder(Path(cfg.output_dir), Path(data))  # the run folder (run_config sets it)
    try:
        as_eval = cfg.model_copy(update={"eval_dataset": str(data), "dataset_cache": False,
                                         "output_dir": str(scratch)})
        rows = prepare_data(as_eval, tokenizer).eval
    finally:
        _keep_only_the_list(scratch)
    if not rows:
        raise UserError(f"--data: no usable rows in {data}")
    return rows, str(data)


def _data_folder(run: Path, data: Path) -> Path:
    """RUN/eval-data/<file stem>-<hash of its path>/ (one per file: two evals never share a list), else, in a
    run folder that cannot be written (a read-only mirror copy), a kept folder in the system's temp."""
    import tempfile

    tag = hashlib.sha256(str(data.expanduser().resolve()).encode()).hexdigest()[:8]
    folder = run / EVAL_DATA / f"{data.stem}-{tag}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        return folder
    except OSError:
        return Path(tempfile.mkdtemp(prefix=f"relaytune-eval-{data.name}-"))


def _keep_only_the_list(folder: Path) -> None:
    """Keep the --data file's quarantine list; drop the training data's (not this eval's business) and
    the folders, once empty."""
    from relaytune.data.assemble import EVAL_QUARANTINE

    try:
        for p in folder.iterdir():
            if p.name != EVAL_QUARANTINE and p.is_file():
                p.unlink()
        folder.rmdir()  # fails, as it should, while the list is there
        if folder.parent.name == EVAL_DATA:
            folder.parent.rmdir()
    except OSError:
        pass


def adapter_path_as_run(path: str | Path, names: str | None, option: str) -> tuple[Path, str | None]:
    """(run folder, adapter names): a checkpoint's own folder (RUN/checkpoints/step-N, RUN/final,
    RUN/best) given where the run folder belongs means that adapter of its run. Such a folder holds a
    metrics.jsonl, so it passed for a run and then failed on the configuration, which lives in the run.
    What a folder inside a run is, `run_folder.inner_folder` tells, as it does for status and compare."""
    p = Path(path).expanduser().resolve()
    found = inner_folder(p) if p.is_dir() else None
    if found is None:
        return Path(path), names
    what, run, adapter = found
    if run is None:
        raise UserError(f"{path} is {what} outside a run folder; relaytune reads an adapter within its run "
                        "(RUN holding checkpoints/step-N, final/): pass the run folder")
    if adapter is None:
        raise UserError(f"{path} is {what} of the run in {run}, not one adapter; use `{run}` ({option} picks one)")
    if names and names.strip() not in (adapter, adapter.removeprefix("step-")):
        raise UserError(f"`{path}` is {adapter} of the run in {run}, and {option} names {names}; use "
                        f"`{run} {option} {names}` or the checkpoint's folder alone")
    info(f"{path} is {adapter} of the run in {run}: using that")
    return run, adapter


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

