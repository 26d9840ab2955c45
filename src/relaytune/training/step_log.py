"""What a finished optimizer step leaves behind: the step and token counts, the bad-step and
scaler-skip events, and the step record of metrics.jsonl (the logging window's mean loss, the rates,
MFU, peak memory). `record_step` is the trainer's part, as rollback.py and stopping.py are.

The window (the steps since the last record) is saved with every checkpoint, so the first record
after a resume averages the same steps as an uninterrupted run's.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from relaytune.training.recovery import is_bad_step


@dataclass
class LogWindow:
    """The steps since the last metrics record; saved with a checkpoint so the next record is exact."""

    window_loss: float = 0.0
    window_steps: int = 0


def step_record(state, window: LogWindow, lr: float, grad_norm: float, tok_s: float, steps_per_epoch: int,
                mfu_fields: dict) -> dict:
    """One metrics.jsonl line for the window ending at `state.step`."""
    return {"step": state.step, "loss": round(window.window_loss / window.window_steps, 6),
            "learning_rate": lr, "grad_norm": grad_norm, "epoch": round(state.step / steps_per_epoch, 4),
            "tokens_seen": state.tokens_seen, "tokens_per_second": round(tok_s, 1), **mfu_fields, **peak_memory()}


def peak_memory() -> dict:
    if not torch.cuda.is_available():
        return {}
    return {"peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3)}


def record_step(trainer, result, rows: list, t0: float) -> bool:
    """Count the step, log it; False when repeated non-finite steps rolled the run back."""
    lr = trainer.live.optimizer.param_groups[0]["lr"]
    trainer.live.scheduler.step()
    trainer.state.step += 1
    tokens = sum(len(r.input_ids) for r in rows)
    trainer.state.tokens_seen += tokens
    seconds = time.monotonic() - t0
    trainer.step_seconds = seconds if trainer.step_seconds == 0 else 0.9 * trainer.step_seconds + 0.1 * seconds
    tok_s = tokens / max(time.monotonic() - t0, 1e-9)
    if is_bad_step(result.loss, result.grad_norm, trainer.live.scaler is not None):
        trainer.state.skipped_steps += 1
        trainer.recovery.consecutive_bad_steps += 1
        trainer.metrics.write({"step": trainer.state.step, "event": "skipped_step", "loss": result.loss,
                               "grad_norm": result.grad_norm})
        if trainer.recovery.consecutive_bad_steps >= trainer.cfg.max_bad_steps:
            trainer.roll_back()
            trainer.bar.n = trainer.state.step
            return False
    else:
        trainer.recovery.consecutive_bad_steps = 0
        trainer.window.window_loss += result.loss
    if trainer.live.scaler is not None and math.isfinite(result.loss) and not math.isfinite(result.grad_norm):
        # fp16: the scaler skipped this update and halved its scale (routine, not a bad step): logged, counted
        trainer.scaler_skips += 1
        trainer.metrics.write({"step": trainer.state.step, "event": "scaler_skip",
                               "scale": trainer.live.scaler.get_scale()})
    trainer.window.window_steps += 1
    if trainer.state.step % trainer.cfg.logging_steps == 0 or trainer.state.step == trainer.total:
        _log_window(trainer, lr, result.grad_norm, tok_s)
    trainer.bar.update(1)
    trainer.bar.set_postfix(loss=f"{result.loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{tok_s:.0f}")
    return True


def _log_window(trainer, lr: float, grad_norm: float, tok_s: float) -> None:
    if getattr(trainer, "mfu_meter", None) is None:  # FLOPs per token counted once; {} on the CPU
        from relaytune.training.mfu import MfuMeter

        trainer.mfu_meter = MfuMeter(trainer.live.model, trainer.cfg.max_seq_length, trainer.precision)
    trainer.metrics.write(step_record(trainer.state, trainer.window, lr, grad_norm, tok_s,
                                      trainer.order.steps_per_epoch, trainer.mfu_meter.fields(tok_s)))
    trainer.window = LogWindow()
