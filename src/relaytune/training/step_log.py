"""The step record of metrics.jsonl: the logging window's mean loss, the rates, MFU, peak memory.

The window (the steps since the last record) is saved with every checkpoint, so the first record
after a resume averages the same steps as an uninterrupted run's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
