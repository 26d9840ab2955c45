"""The recipe: LoRA / QLoRA supervised fine-tuning, top to bottom.

    set-up:  config -> data (before any model loads) -> model -> optimizer -> resume
    loop:    one global batch per optimizer step, split into micro-batches;
             log, evaluate, checkpoint; stop cleanly on a signal or the deadline
    finish:  commit final/ and return

Exactness rests on three rules kept here: the global batch of step s is a pure
function of (seed, s); the loss is normalised by the target tokens of the whole
global batch, so the micro-batch size does not change the maths; and every
piece of state is saved and restored at a step boundary.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from relaytune import atomic, faults
from relaytune.data import packing
from relaytune.atomic import verify
from relaytune.checkpoint.store import CheckpointStore
from relaytune.config.schema import TrainConfig
from relaytune.config.loader import load_config
from relaytune.data.prepare import prepare_data
from relaytune.training.environment import time_budget, warn_storage
from relaytune.commands.evaluate import eval_loss
from relaytune.errors import StoppedEarly, TrainingDiverged, UserError
from relaytune.training.stops import Deadline, StopRequest
from relaytune.log import info, notice, warn
from relaytune.training.loss import causal_lm_loss, supports_chunked_loss
from relaytune.observe.metrics import MetricsLog, SessionLog, parse_records
from relaytune.checkpoint.mirror import Mirror
from relaytune.model import choose_precision, load_model, load_tokenizer, resolve_source
from relaytune.training.preflight import Report, check_disk, check_gpu, estimate_model_bytes, predicted_checkpoint_bytes
from relaytune.training.recovery import (NoSmallerBatch, free_memory, is_bad_step, lower_learning_rate, oom_advice,
                       shrink_after_oom)
from relaytune.training.optim import build_optimizer, build_scheduler, warmup_steps
from relaytune.data.batches import DataOrder, count_targets, micro_batches, total_steps
from relaytune.checkpoint.resume import check_compatible, choose_checkpoint
from relaytune.checkpoint.best import keep_best
from relaytune.checkpoint.saver import Saver
from relaytune.observe.trackers import open_trackers
from relaytune.checkpoint.state import Counters, capture_rng, read_trainer_state, reset_rng, restore, snapshot


@dataclass
class RunResult:
    status: str  # "finished" or "already finished"
    step: int
    output_dir: Path
    final_adapter: Path


def train(config=None, /, *, fresh: bool = False, **overrides) -> RunResult:
    """Train, or continue the run in the config's output_dir. The CLI calls exactly this."""
    cfg = load_config(config, overrides)
    out = Path(cfg.output_dir).expanduser().resolve()
    if verify(out / "final") is None:
        info(f"{out} holds a finished run (final/ is committed); nothing to do")
        return RunResult("already finished", -1, out, out / "final")

    # --- set-up: everything that can reject the config happens before the model loads
    out.mkdir(parents=True, exist_ok=True)
    warn_storage(out)
    store = CheckpointStore(out / "checkpoints")
    store.startup_cleanup()
    atomic.clean_tmp(out)  # a kill inside the final commit leaves our tmp folder beside final/
    mirror = Mirror(cfg.mirror_to, cfg.save_total_limit, out / "mirror_state.json") if cfg.mirror_to else None
    if mirror and not fresh:
        local_newest, _, _ = store.latest_valid()
        mirror.restore_newer(store.root, local_newest)
    start_from = choose_checkpoint(cfg, store, fresh)
    precision = choose_precision(cfg)
    budget = time_budget(cfg)
    report = Report()
    report.add("time", budget.describe())
    tokenizer = load_tokenizer(cfg)
    data = prepare_data(cfg, tokenizer)
    order = DataOrder(len(data.train), cfg.global_batch_size, cfg.seed)
    total = total_steps(len(data.train), cfg.global_batch_size, cfg.num_train_epochs, cfg.max_steps)
    if warmup_steps(cfg, total) >= total:
        raise UserError(f"warmup ({warmup_steps(cfg, total)} steps) is not shorter than the run "
                        f"({total} steps); lower warmup_steps / warmup_ratio")
    saved = read_trainer_state(start_from) if start_from else None
    if saved:
        check_compatible(saved["config"], cfg, data.fingerprint, saved["data_fingerprint"])
        if precision.device.type == "cpu" and saved.get("torch_threads") not in (None, torch.get_num_threads()):
            notice(f"the checkpoint was written with {saved['torch_threads']} CPU threads, this session has "
                   f"{torch.get_num_threads()}: the run continues correctly, but not bit for bit "
                   "(set OMP_NUM_THREADS to match for an exact continuation)")
    source = resolve_source(cfg)
    check_gpu(report, estimate_model_bytes(cfg, source.path if not source.gguf_file else None,
                                           torch.finfo(precision.dtype).bits / 8))

    torch.manual_seed(cfg.seed)  # the LoRA initialisation; a resume overwrites it
    model = load_model(cfg, precision)
    if cfg.packing and (why := packing.check_isolation(model)):
        raise UserError(f"`packing`: {why}; set packing: false")
    optimizer = build_optimizer(cfg, model)
    scheduler = build_scheduler(cfg, optimizer, total)
    scaler = torch.amp.GradScaler("cuda") if precision.use_grad_scaler else None
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()  # loading (bf16 shards before quantizing) is not training
    per_checkpoint = predicted_checkpoint_bytes(model, cfg)
    check_disk(report, out, per_checkpoint, cfg, per_checkpoint // 3)
    report.print()
    metrics = MetricsLog(out / "metrics.jsonl")
    config_dump = cfg.model_dump(mode="json")
    saver = Saver(cfg, store, hashlib.sha256(json.dumps(config_dump, sort_keys=True).encode()).hexdigest()[:16], mirror)
    if start_from:
        c = restore(start_from, model, optimizer, scheduler, scaler)
        metrics.reset_to((start_from / "metrics.jsonl").read_text())
        saver.protect = {c.best_step} if c.best_step is not None else set()  # retention keeps the best after a resume too
        # Keep a micro-batch that an OOM forced down; otherwise follow the (harmless) new setting.
        was_forced = c.micro_batch_size < saved["config"]["per_device_train_batch_size"]
        c.micro_batch_size = min(c.micro_batch_size, cfg.per_device_train_batch_size) if was_forced \
            else cfg.per_device_train_batch_size
        c.accumulation = math.ceil(cfg.global_batch_size / c.micro_batch_size)
    else:
        c = Counters(micro_batch_size=cfg.per_device_train_batch_size,
                     accumulation=cfg.gradient_accumulation_steps)
        metrics.reset_to("")
    sessions = SessionLog(out / "sessions.jsonl")
    sessions.start(from_step=c.step, total_steps=total)
    trackers = open_trackers(cfg, out, c.step, sessions.session)  # same tracker run, continued at c.step
    metrics.add_sink(trackers)
    info(f"{len(data.train)} training rows, global batch {cfg.global_batch_size}, "
         f"{total} steps; starting at step {c.step}; {precision.device} {str(precision.dtype)[6:]}")

    def checkpoint_files():
        extra = {"config": config_dump, "data_fingerprint": data.fingerprint, "total_steps": total,
                 "torch_threads": torch.get_num_threads()}
        return snapshot(model, optimizer, scheduler, scaler, c, extra, metrics.text(),
                        include_optimizer=not cfg.save_only_model)

    # The rollback point for repeated NaNs when no checkpoint exists yet.
    initial_state = checkpoint_files() if not start_from else None

    # --- loop
    model.train()
    deadline = Deadline(budget.end, budget.source)
    step_seconds = 0.0
    bar = tqdm(total=total, initial=c.step, desc="train", unit="step", dynamic_ncols=True)
    try:
        with StopRequest() as stop:
            while c.step < total:
                t0 = time.monotonic()
                rows = [data.train[i] for i in order.batch_rows(c.step)]
                step_rng = capture_rng()
                while True:  # an OOM redoes the same step, from the same RNG, with smaller micro-batches
                    try:
                        loss, grad_norm, updated = optimizer_step(model, optimizer, scaler, rows, c, cfg,
                                                                  precision, tokenizer.pad_token_id)
                        break
                    except torch.OutOfMemoryError as e:
                        free_memory(optimizer)
                        reset_rng(step_rng)
                        try:
                            old, new = shrink_after_oom(c, cfg.global_batch_size, e)
                        except NoSmallerBatch:
                            stop_after_oom(saver, checkpoint_files, c, cfg)
                        metrics.write({"step": c.step, "event": "oom", "micro_batch_size": new, "was": old})
                lr = optimizer.param_groups[0]["lr"]
                scheduler.step()
                c.step += 1
                cursor = order.cursor(c.step)
                c.epoch, c.batch_in_epoch = cursor.epoch, cursor.batch
                c.tokens_seen += sum(len(r.input_ids) for r in rows)
                step_seconds = time.monotonic() - t0 if step_seconds == 0 else 0.9 * step_seconds + 0.1 * (time.monotonic() - t0)
                tok_s = sum(len(r.input_ids) for r in rows) / max(time.monotonic() - t0, 1e-9)
                if is_bad_step(loss, grad_norm, scaler is not None):
                    c.skipped_steps += 1
                    c.consecutive_bad_steps += 1
                    metrics.write({"step": c.step, "event": "skipped_step", "loss": loss, "grad_norm": grad_norm})
                    if c.consecutive_bad_steps >= cfg.max_bad_steps:
                        c = roll_back(store, initial_state, model, optimizer, scheduler, scaler, metrics, cfg, c)
                        bar.n = c.step
                        continue
                else:
                    c.consecutive_bad_steps = 0
                    c.window_loss += loss
                c.window_steps += 1
                if c.step % cfg.logging_steps == 0 or c.step == total:
                    metrics.write({"step": c.step, "loss": round(c.window_loss / c.window_steps, 6),
                                   "learning_rate": lr, "grad_norm": grad_norm, "epoch": round(c.step / order.steps_per_epoch, 4),
                                   "tokens_seen": c.tokens_seen, "tokens_per_second": round(tok_s, 1),
                                   **peak_memory()})
                    c.window_loss, c.window_steps = 0.0, 0
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{tok_s:.0f}")
                if data.eval and cfg.eval_steps and c.step % cfg.eval_steps == 0 and c.step < total:
                    record_eval(model, data.eval, c, cfg, precision, tokenizer.pad_token_id, metrics, saver)
                faults.step_ended()
                if stop.requested or deadline.must_stop(step_seconds, saver.save_seconds):
                    stop_and_save(saver, checkpoint_files, c, stop, deadline)
                if saver.due(c.step, total):
                    saver.save(checkpoint_files, c.step)
                    metrics.write({"step": c.step, "event": "checkpoint",
                                   "blocked_seconds": round(saver.last_blocked, 4)})
                if saver.consecutive_failures >= 3:
                    raise StoppedEarly(f"no checkpoint could be written {saver.consecutive_failures} times in a row "
                                       f"(disk full or failing); free space, then run again to continue from the "
                                       f"last committed checkpoint", c.step, None, how="disk")

        # --- finish
        if data.eval:
            record_eval(model, data.eval, c, cfg, precision, tokenizer.pad_token_id, metrics, saver)
        saver.flush()
        keep_best(cfg, model, c, out)  # best/; with load_best_model_at_end the model now holds the best adapter
        final = saver.commit_final(model, out, c.step)
        metrics.write({"step": c.step, "event": "finished", "skipped_steps": c.skipped_steps})
        sessions.end("finished", c.step)
        if mirror:
            mirror.drain()
        return RunResult("finished", c.step, out, final)
    except StoppedEarly as e:
        sessions.end(e.how, c.step)
        if mirror:
            mirror.drain(timeout=60)
        raise
    except BaseException as e:
        sessions.end(f"error: {type(e).__name__}", c.step)
        raise
    finally:
        trackers.close()
        bar.close()
        saver.writer.wait_quietly()
        del model, optimizer, scheduler, initial_state
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            if hasattr(torch._C, "_cuda_clearCublasWorkspaces"):
                torch._C._cuda_clearCublasWorkspaces()  # cuBLAS keeps its workspaces allocated otherwise


def optimizer_step(model, optimizer, scaler, rows, c: Counters, cfg: TrainConfig, precision, pad_id):
    """Forward and backward over every micro-batch of one global batch, then one update.

    Returns (loss, grad_norm, updated). The loss of each micro-batch is its summed
    token loss divided by the target tokens of the *whole* global batch, so the
    accumulated gradient is the same whatever the micro-batch size.
    """
    n_targets = count_targets(rows)
    autocast = (torch.autocast(precision.device.type, dtype=precision.autocast)
                if precision.autocast else contextlib.nullcontext())
    total_loss = torch.zeros((), device=precision.device)
    for i, batch in enumerate(micro_batches(rows, c.micro_batch_size, pad_id)):
        batch = {k: v.to(precision.device) for k, v in batch.items()}
        if faults.oom_now(c.step, i):
            raise torch.OutOfMemoryError("CUDA out of memory (injected by RELAYTUNE_OOM_AT)")
        with autocast:
            loss = causal_lm_loss(model, batch, n_targets, chunked=supports_chunked_loss(model))
        if i == 0 and faults.nan_now(c.step):
            loss = loss * float("nan")
        (scaler.scale(loss) if scaler else loss).backward()
        total_loss += loss.detach().float()
    if scaler:
        scaler.unscale_(optimizer)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf"))
    loss_value, norm_value = total_loss.item(), norm.item()
    updated = math.isfinite(loss_value) and math.isfinite(norm_value)
    if scaler:
        scaler.step(optimizer)  # skips by itself on inf/nan gradients
        scaler.update()
    elif updated:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss_value, norm_value, updated


def record_eval(model, rows, c: Counters, cfg, precision, pad_id, metrics: MetricsLog, saver: Saver) -> float:
    """Token-weighted mean loss over the eval rows. Uses no RNG (dropout is off)."""
    value, _ = eval_loss(model, rows, c.micro_batch_size, pad_id, precision)
    model.train()
    c.last_eval_loss = value
    if c.best_eval_loss is None or value < c.best_eval_loss:
        c.best_eval_loss, c.best_step = value, c.step
        saver.protect, saver.force_step = {c.step}, c.step
    metrics.write({"step": c.step, "eval_loss": round(value, 6)})
    return value


def peak_memory() -> dict:
    if not torch.cuda.is_available():
        return {}
    return {"peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3)}


def roll_back(store, initial_state, model, optimizer, scheduler, scaler, metrics, cfg, c: Counters) -> Counters:
    """Repeated non-finite steps: return to the last committed state, then lower the LR or stop."""
    _, saver_path, _ = store.latest_valid()
    source = saver_path if saver_path is not None else initial_state
    bad_at = c.step
    restored = restore(source, model, optimizer, scheduler, scaler)
    # Step records after the rollback point are redone; the events that led here are kept.
    events = [r for r in parse_records(metrics.text()) if "event" in r and r["step"] > restored.step]
    metrics.reset_to((saver_path / "metrics.jsonl").read_text() if saver_path else "")
    for record in events:
        metrics.write(record)
    restored.skipped_steps = c.skipped_steps
    where = saver_path.name if saver_path else "the start"
    if cfg.on_repeated_nan == "stop":
        metrics.write({"step": restored.step, "event": "nan_stop", "bad_steps_until": bad_at})
        raise TrainingDiverged(
            f"{cfg.max_bad_steps} steps in a row had a non-finite loss or gradient (up to step {bad_at}). "
            f"The run is intact at {where}. Likely causes: a learning rate too high "
            f"(now {cfg.learning_rate}), fp16 overflow (use bf16 where the GPU has it), or bad data rows.")
    new_scale = c.lr_scale * cfg.nan_lr_factor  # the restored schedule carries its own, older scale
    lower_learning_rate(scheduler, optimizer, new_scale / restored.lr_scale)
    restored.lr_scale = new_scale
    restored.micro_batch_size, restored.accumulation = c.micro_batch_size, c.accumulation
    metrics.write({"step": restored.step, "event": "nan_rollback", "bad_steps_until": bad_at,
                   "lr_scale": restored.lr_scale})
    warn(f"{cfg.max_bad_steps} non-finite steps in a row (up to step {bad_at}): rolled back to {where} "
         f"and continue with the learning rate x{restored.lr_scale:g}")
    return restored


def stop_after_oom(saver: Saver, files_fn, c: Counters, cfg: TrainConfig):
    advice = oom_advice(cfg)
    path = saver.save(files_fn, c.step, wait=True)
    if path is None:
        raise TrainingDiverged(advice)
    raise StoppedEarly(f"{advice}\nCheckpoint {path.name} is committed", c.step, str(path), how="oom")


def stop_and_save(saver: Saver, files_fn, c: Counters, stop: StopRequest, deadline: Deadline):
    why = stop.signal_name or f"time limit ({deadline.source})"
    began = stop.at or time.monotonic()
    path = saver.save(files_fn, c.step, wait=True)
    if path is None:
        raise StoppedEarly(f"stopped by {why} at step {c.step}, but the checkpoint could not be written",
                           c.step, None, how="signal" if stop.signal_name else "time_limit")
    info(f"stopped by {why}: checkpoint {path.name} committed {time.monotonic() - began:.1f}s after "
         "the request; run the same command to continue")
    raise StoppedEarly(f"stopped by {why} at step {c.step}", c.step, str(path),
                       how="signal" if stop.signal_name else "time_limit")
