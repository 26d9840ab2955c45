"""The Trainer: holds a run's live objects and does each part of the recipe.

recipe.py reads top to bottom (setup, run, finish); the mechanics of each part are here.
Saved progress is `TrainState`; what the run learned about itself (micro-batch in force,
learning-rate scale, bad steps in a row) is `Recovery`; the logging window is `LogWindow`.
The data cursor is not stored: the global batch of step s is a pure function of (seed, s).
"""

from __future__ import annotations

import gc
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from relaytune import faults
from relaytune.checkpoint import Checkpointer, Live, TrainState
from relaytune.checkpoint.resume import check_compatible
from relaytune.checkpoint.state import capture_rng, progress_of, read_trainer_state, recovery_of, reset_rng
from relaytune.config import TrainConfig
from relaytune.data import prepare_data
from relaytune.data.batches import DataOrder, total_steps
from relaytune.data.packing import check_isolation
from relaytune.errors import StoppedEarly, TrainingDiverged, UserError
from relaytune.log import info, notice, warn
from relaytune.model import choose_precision, load_model, load_tokenizer, resolve_source
from relaytune.observe.metrics import MetricsLog, SessionLog, parse_records
from relaytune.observe.trackers import open_trackers
from relaytune.run_dir import RunDir
from relaytune.training.environment import time_budget, warn_storage
from relaytune.training.evaluation import eval_loss
from relaytune.training.optim import build_optimizer, build_scheduler, warmup_steps
from relaytune.training.preflight import Report, check_disk, check_gpu, estimate_model_bytes, predicted_checkpoint_bytes
from relaytune.training.recovery import (NoSmallerBatch, Recovery, free_memory, is_bad_step, lower_learning_rate,
                                         oom_advice, shrink_after_oom)
from relaytune.training.step import StepParts, StepResult, optimizer_step
from relaytune.training.stops import StopRequest


@dataclass
class LogWindow:
    """The steps since the last metrics record; saved with a checkpoint so the next record is exact."""

    window_loss: float = 0.0
    window_steps: int = 0


class Trainer:
    def __init__(self, cfg: TrainConfig, run: RunDir):
        self.cfg = cfg
        self.run = run
        self.checkpointer = Checkpointer(cfg, run)
        self.sessions: SessionLog | None = None
        self.state = TrainState()
        self.window = LogWindow()
        self.step_seconds = 0.0
        self.bar = None
        self.trackers = None

    # --- set-up ----------------------------------------------------------------------------
    def setup(self, fresh: bool) -> None:
        """Everything that can reject the config or the data happens before the model loads."""
        cfg = self.cfg
        self.run.root.mkdir(parents=True, exist_ok=True)
        warn_storage(self.run.root)
        start_from = self.checkpointer.resume_point(fresh)
        self.precision = choose_precision(cfg)
        self.deadline = time_budget(cfg)
        report = Report()
        report.add("time", self.deadline.describe())
        source = resolve_source(cfg)
        self.tokenizer = load_tokenizer(cfg, source)
        self.data = prepare_data(cfg, self.tokenizer)
        self.order = DataOrder(len(self.data.train), cfg.global_batch_size, cfg.seed)
        self.total = total_steps(len(self.data.train), cfg.global_batch_size, cfg.num_train_epochs, cfg.max_steps)
        self._check_schedule()
        saved = read_trainer_state(start_from) if start_from else None
        if saved:
            self._check_resumable(saved)
        check_gpu(report, estimate_model_bytes(cfg, source.path if not source.gguf_file else None,
                                               torch.finfo(self.precision.dtype).bits / 8))
        self._build(source, report)
        self._start(start_from, saved)

    def _check_schedule(self) -> None:
        warmup = warmup_steps(self.cfg, self.total)
        if warmup >= self.total:
            raise UserError(f"warmup ({warmup} steps) is not shorter than the run "
                            f"({self.total} steps); lower warmup_steps / warmup_ratio")

    def _check_resumable(self, saved: dict) -> None:
        check_compatible(saved["config"], self.cfg, self.data.fingerprint, saved["data_fingerprint"])
        threads = saved.get("torch_threads")
        if self.precision.device.type == "cpu" and threads not in (None, torch.get_num_threads()):
            notice(f"the checkpoint was written with {threads} CPU threads, this session has "
                   f"{torch.get_num_threads()}: the run continues correctly, but not bit for bit "
                   "(set OMP_NUM_THREADS to match for an exact continuation)")

    def _build(self, source, report: Report) -> None:
        """The model with its adapter, the optimizer, schedule and scaler; then the disk check."""
        cfg = self.cfg
        torch.manual_seed(cfg.seed)  # the LoRA initialisation; a resume overwrites it
        model = load_model(cfg, self.precision, source)
        if cfg.packing and (why := check_isolation(model)):
            raise UserError(f"`packing`: {why}; set packing: false")
        optimizer = build_optimizer(cfg, model)
        scheduler = build_scheduler(cfg, optimizer, self.total)
        scaler = torch.amp.GradScaler("cuda") if self.precision.use_grad_scaler else None
        self.live = Live(model, optimizer, scheduler, scaler)
        self.parts = StepParts(model, optimizer, scaler, self.precision, self.tokenizer.pad_token_id,
                               cfg.max_grad_norm)
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()  # loading (bf16 shards before quantizing) is not training
        per_checkpoint = predicted_checkpoint_bytes(model, cfg)
        check_disk(report, self.run.root, per_checkpoint, cfg, per_checkpoint // 3)
        report.print()

    def _start(self, start_from: Path | None, saved: dict | None) -> None:
        """Restore the checkpoint (or take the state to roll back to), open the logs."""
        cfg = self.cfg
        self.metrics = MetricsLog(self.run.metrics)
        self.recovery = Recovery(cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps)
        if start_from:
            self._restore(start_from)
            self.metrics.reset_to((start_from / "metrics.jsonl").read_text())
            self._follow_micro_batch_setting(saved["config"]["per_device_train_batch_size"])
        else:
            self.metrics.reset_to("")
        self.sessions = SessionLog(self.run.sessions)
        self.sessions.start(from_step=self.state.step, total_steps=self.total)
        self.trackers = open_trackers(cfg, self.run.root, self.state.step, self.sessions.session)
        self.metrics.add_sink(self.trackers)
        info(f"{len(self.data.train)} training rows, global batch {cfg.global_batch_size}, "
             f"{self.total} steps; starting at step {self.state.step}; {self.precision.device} "
             f"{str(self.precision.dtype)[6:]}")
        # The rollback point for repeated NaNs when no checkpoint exists yet.
        self.initial_state = self.snapshot() if not start_from else None

    def _follow_micro_batch_setting(self, saved_micro_batch: int) -> None:
        """Keep a micro-batch that an OOM forced down; otherwise follow the (harmless) new setting."""
        r, configured = self.recovery, self.cfg.per_device_train_batch_size
        was_forced = r.micro_batch_size < saved_micro_batch
        r.micro_batch_size = min(r.micro_batch_size, configured) if was_forced else configured
        r.accumulation = math.ceil(self.cfg.global_batch_size / r.micro_batch_size)

    def _restore(self, source: Path | dict) -> None:
        saved = self.checkpointer.restore(source, self.live)
        self.state = progress_of(saved)
        extra = recovery_of(saved)
        self.recovery = Recovery(**{k: extra[k] for k in Recovery.__dataclass_fields__})
        window = saved.get("log_window") or extra
        self.window = LogWindow(window["window_loss"], window["window_steps"])

    def snapshot(self) -> dict:
        """Every file of a checkpoint at this step boundary (tensors serialised later)."""
        from relaytune.checkpoint.state import snapshot

        state = {"progress": asdict(self.state), "recovery": asdict(self.recovery),
                 "log_window": asdict(self.window), "config": self.cfg.model_dump(mode="json"),
                 "data_fingerprint": self.data.fingerprint, "total_steps": self.total,
                 "torch_threads": torch.get_num_threads()}
        return snapshot(self.live, state, self.metrics.text(), include_optimizer=not self.cfg.save_only_model)

    # --- the loop --------------------------------------------------------------------------
    def run_loop(self) -> None:
        """One global batch per optimizer step; log, evaluate, checkpoint; stop on a signal or the deadline."""
        self.live.model.train()
        self.bar = tqdm(total=self.total, initial=self.state.step, desc="train", unit="step", dynamic_ncols=True)
        with StopRequest() as stop:
            while self.state.step < self.total:
                t0 = time.monotonic()
                rows = [self.data.train[i] for i in self.order.batch_rows(self.state.step)]
                result = self.step(rows)
                if not self.record(result, rows, t0):
                    continue  # rolled back to a checkpoint: the steps after it are redone
                self.maybe_evaluate()
                faults.step_ended()
                if stop.requested or self.deadline.must_stop(self.step_seconds, self.checkpointer.save_seconds):
                    self.stop_and_save(stop)
                self.maybe_save()

    def step(self, rows: list) -> StepResult:
        """One optimizer step; an OOM redoes it from the same RNG state with half the micro-batch."""
        step_rng = capture_rng()
        while True:
            try:
                return optimizer_step(self.parts, rows, self.recovery.micro_batch_size, self.state.step)
            except torch.OutOfMemoryError as e:
                free_memory(self.live.optimizer)
                reset_rng(step_rng)
                try:
                    old, new = shrink_after_oom(self.recovery, self.cfg.global_batch_size, self.state.step, e)
                except NoSmallerBatch:
                    self.stop_after_oom()
                self.metrics.write({"step": self.state.step, "event": "oom", "micro_batch_size": new, "was": old})

    def record(self, result: StepResult, rows: list, t0: float) -> bool:
        """Count the step, log it; False when repeated non-finite steps rolled the run back."""
        lr = self.live.optimizer.param_groups[0]["lr"]
        self.live.scheduler.step()
        self.state.step += 1
        tokens = sum(len(r.input_ids) for r in rows)
        self.state.tokens_seen += tokens
        seconds = time.monotonic() - t0
        self.step_seconds = seconds if self.step_seconds == 0 else 0.9 * self.step_seconds + 0.1 * seconds
        tok_s = tokens / max(time.monotonic() - t0, 1e-9)
        if is_bad_step(result.loss, result.grad_norm, self.live.scaler is not None):
            self.state.skipped_steps += 1
            self.recovery.consecutive_bad_steps += 1
            self.metrics.write({"step": self.state.step, "event": "skipped_step", "loss": result.loss,
                                "grad_norm": result.grad_norm})
            if self.recovery.consecutive_bad_steps >= self.cfg.max_bad_steps:
                self.roll_back()
                self.bar.n = self.state.step
                return False
        else:
            self.recovery.consecutive_bad_steps = 0
            self.window.window_loss += result.loss
        self.window.window_steps += 1
        if self.state.step % self.cfg.logging_steps == 0 or self.state.step == self.total:
            self._log_window(lr, result.grad_norm, tok_s)
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{result.loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{tok_s:.0f}")
        return True

    def _log_window(self, lr: float, grad_norm: float, tok_s: float) -> None:
        s, w = self.state, self.window
        self.metrics.write({"step": s.step, "loss": round(w.window_loss / w.window_steps, 6),
                            "learning_rate": lr, "grad_norm": grad_norm,
                            "epoch": round(s.step / self.order.steps_per_epoch, 4),
                            "tokens_seen": s.tokens_seen, "tokens_per_second": round(tok_s, 1), **peak_memory()})
        self.window = LogWindow()

    def maybe_evaluate(self) -> None:
        steps = self.cfg.eval_steps
        if self.data.eval and steps and self.state.step % steps == 0 and self.state.step < self.total:
            self.evaluate()

    def evaluate(self) -> float:
        """Token-weighted mean loss over the eval rows. Uses no RNG (dropout is off)."""
        value, _ = eval_loss(self.live.model, self.data.eval, self.recovery.micro_batch_size,
                             self.tokenizer.pad_token_id, self.precision)
        self.live.model.train()
        s = self.state
        s.last_eval_loss = value
        if s.best_eval_loss is None or value < s.best_eval_loss:
            s.best_eval_loss, s.best_step = value, s.step
            self.checkpointer.mark_best(s.step)
        self.metrics.write({"step": s.step, "eval_loss": round(value, 6)})
        return value

    def maybe_save(self) -> None:
        step = self.state.step
        if self.checkpointer.due(step, self.total):
            self.checkpointer.save(self.snapshot, step)
            self.metrics.write({"step": step, "event": "checkpoint",
                                "blocked_seconds": round(self.checkpointer.blocked_seconds, 4)})
        self.checkpointer.raise_if_failing(step)

    # --- recovery and stopping ---------------------------------------------------------------
    def roll_back(self) -> None:
        """Repeated non-finite steps: return to the last committed state, then lower the LR or stop."""
        cfg, bad_at, before = self.cfg, self.state.step, self.recovery
        skipped = self.state.skipped_steps
        path = self.checkpointer.rollback_point()
        self._restore(path if path is not None else self.initial_state)
        # Step records after the rollback point are redone; the events that led here are kept.
        events = [r for r in parse_records(self.metrics.text()) if "event" in r and r["step"] > self.state.step]
        self.metrics.reset_to((path / "metrics.jsonl").read_text() if path else "")
        for record in events:
            self.metrics.write(record)
        self.state.skipped_steps = skipped
        where = path.name if path else "the start"
        if cfg.on_repeated_nan == "stop":
            self.metrics.write({"step": self.state.step, "event": "nan_stop", "bad_steps_until": bad_at})
            raise TrainingDiverged(
                f"{cfg.max_bad_steps} steps in a row had a non-finite loss or gradient (up to step {bad_at}). "
                f"The run is intact at {where}. Likely causes: a learning rate too high "
                f"(now {cfg.learning_rate}), fp16 overflow (use bf16 where the GPU has it), or bad data rows.")
        new_scale = before.lr_scale * cfg.nan_lr_factor  # the restored schedule carries its own, older scale
        lower_learning_rate(self.live.scheduler, self.live.optimizer, new_scale / self.recovery.lr_scale)
        self.recovery.lr_scale = new_scale
        self.recovery.micro_batch_size, self.recovery.accumulation = before.micro_batch_size, before.accumulation
        self.metrics.write({"step": self.state.step, "event": "nan_rollback", "bad_steps_until": bad_at,
                            "lr_scale": new_scale})
        warn(f"{cfg.max_bad_steps} non-finite steps in a row (up to step {bad_at}): rolled back to {where} "
             f"and continue with the learning rate x{new_scale:g}")

    def stop_after_oom(self) -> None:
        advice = oom_advice(self.cfg)
        path = self.checkpointer.save(self.snapshot, self.state.step, wait=True)
        if path is None:
            raise TrainingDiverged(advice)
        raise StoppedEarly(f"{advice}\nCheckpoint {path.name} is committed", self.state.step, str(path), how="oom")

    def stop_and_save(self, stop: StopRequest) -> None:
        why = stop.signal_name or f"time limit ({self.deadline.source})"
        how = "signal" if stop.signal_name else "time_limit"
        began = stop.at or time.monotonic()
        path = self.checkpointer.save(self.snapshot, self.state.step, since=began, wait=True)
        step = self.state.step
        if path is None:
            raise StoppedEarly(f"stopped by {why} at step {step}, but the checkpoint could not be written",
                               step, None, how=how)
        info(f"stopped by {why}: checkpoint {path.name} committed {time.monotonic() - began:.1f}s after "
             "the request; run the same command to continue")
        raise StoppedEarly(f"stopped by {why} at step {step}", step, str(path), how=how)

    # --- the end -----------------------------------------------------------------------------
    def finish(self) -> Path:
        """The last evaluation, best/, final/; the session is recorded as finished."""
        if self.data.eval:
            self.evaluate()
        final = self.checkpointer.finish(self.live, self.state)
        self.metrics.write({"step": self.state.step, "event": "finished", "skipped_steps": self.state.skipped_steps})
        self.sessions.end("finished", self.state.step)
        self.checkpointer.drain_mirror()
        return final

    def end_session(self, error: BaseException) -> None:
        """Record how the session ended; a stop on purpose gives the mirror a minute to catch up."""
        if self.sessions is None:
            return
        if isinstance(error, StoppedEarly):
            self.sessions.end(error.how, self.state.step)
            self.checkpointer.drain_mirror(timeout=60)
        else:
            self.sessions.end(f"error: {type(error).__name__}", self.state.step)

    def close(self) -> None:
        """On every way out: close the sinks, let the writer finish, and free the model and GPU memory."""
        if self.trackers is not None:
            self.trackers.close()
        if self.bar is not None:
            self.bar.close()
        self.checkpointer.close()
        # An exception kept by the caller holds this frame: drop every reference to the model here.
        self.__dict__.clear()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            if hasattr(torch._C, "_cuda_clearCublasWorkspaces"):
                torch._C._cuda_clearCublasWorkspaces()  # cuBLAS keeps its workspaces allocated otherwise


def peak_memory() -> dict:
    if not torch.cuda.is_available():
        return {}
    return {"peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3)}
