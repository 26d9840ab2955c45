"""In-run recovery: an OOM halves the micro-batch and redoes the step; repeated
NaNs roll back to the last checkpoint with a lower learning rate.

HF's auto_find_batch_size restarts the whole loop and resets the step counter;
a NaN is only hidden from its logs. Here the global batch stays the same, so
the maths stays the same, and every event is written to metrics.jsonl.
"""

from __future__ import annotations

import collections
import gc
import math
import os
from dataclasses import dataclass

import torch

from relaytune.config.schema import TrainConfig
from relaytune.layers import decoder_layers, drop_cuda_graphs, move_checkpoints_outside
from relaytune.log import warn

GIB = 1024 ** 3
ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def prefer_expandable_segments(env=None) -> bool:
    """Let the CUDA caching allocator grow segments in place (expandable_segments), unless the user
    configured the allocator: activations change size from step to step, and fixed-size segments then
    leave gaps that count as reserved memory, which is what a memory cap (or a 15 GB card) runs out of.
    Returns whether it was set."""
    env = os.environ if env is None else env
    if not torch.cuda.is_available() or any(env.get(name) for name in ALLOC_CONF_VARS):
        return False
    # torch 2.10+ names it for every accelerator (the CUDA name warns there); older torch has the CUDA one.
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    try:
        (setter or torch.cuda.memory._set_allocator_settings)("expandable_segments:True")
    except (AttributeError, RuntimeError):  # an older torch, or a platform without it: keep the default
        return False
    return True


@dataclass
class Recovery:
    """What the run learned about itself: the micro-batch an OOM forced, the learning-rate
    scale after NaN rollbacks, the count of non-finite steps in a row. The trainer owns it;
    it is saved with every checkpoint so that a resume keeps it."""

    micro_batch_size: int
    accumulation: int
    lr_scale: float = 1.0
    consecutive_bad_steps: int = 0


class NoSmallerBatch(Exception):
    """An OOM at micro-batch 1: nothing left to halve."""


def free_memory(optimizer, model=None) -> list[str]:
    """Drop the partial gradients of the failed step and give cached memory back; compiled layers
    that replay CUDA graphs stop replaying them, and those whose checkpoint was compiled inside keep it
    outside, for the rest of the session. Returns what of those it gave up (the setting's name): with
    one of them gone, the same micro-batch may fit again."""
    optimizer.zero_grad(set_to_none=True)
    released = []
    if model is not None and drop_cuda_graphs(decoder_layers(model)):
        warn("out of memory with CUDA graphs on: the layers run without them for the rest of this session, "
             "and the graphs' memory is freed")
        released.append("cuda_graphs")
    if model is not None and move_checkpoints_outside(decoder_layers(model)):
        warn("out of memory with the checkpoint compiled inside the layers: it stays outside them for the "
             "rest of this session (compile_checkpoint), which lowers the backward's peak")
        released.append("compile_checkpoint")
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        empty_host_cache()  # offload_activations' pinned blocks of the larger micro-batch fit no smaller one
    return released


def empty_host_cache() -> None:
    """Give back the pinned host memory torch caches but no tensor uses (torch.accelerator's call, or the
    private one of older torch)."""
    release = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None) or \
        getattr(torch._C, "_host_emptyCache", None)
    if release is not None:
        release()


def forget_unscale(scaler: torch.amp.GradScaler | None) -> None:
    """fp16: an OOM after the gradients were unscaled and before the scaler's update (AdamW making its
    state on the first step) leaves the scaler sure that this step's gradients are unscaled already,
    and torch refuses the redo's `unscale_`. The per-step record goes back to what `update` leaves
    (torch keeps no public way to do it); the scale and its growth tracker stay as they were."""
    if scaler is not None:
        from torch.amp.grad_scaler import _refresh_per_optimizer_state

        scaler._per_optimizer_states = collections.defaultdict(_refresh_per_optimizer_state)


def release_gpu() -> None:
    """Give a finished run's GPU memory back (a notebook trains again in the same process)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        if hasattr(torch._C, "_cuda_clearCublasWorkspaces"):
            torch._C._cuda_clearCublasWorkspaces()  # cuBLAS keeps its workspaces allocated otherwise
        empty_host_cache()


def redo_after_oom(r: Recovery, global_batch: int, step: int, error: BaseException, released: list[str]) -> dict:
    """How step `step` is redone after an OOM, as its metrics event's fields: at the same micro-batch
    when free_memory gave something up (on every rank), else at half (NoSmallerBatch at 1)."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()  # the failed attempt's peak is not the redone step's
    if released:
        warn(f"redoing step {step + 1} at the same micro-batch {r.micro_batch_size} without {' and '.join(released)}")
        return {"micro_batch_size": r.micro_batch_size, "was": r.micro_batch_size, "released": released}
    old, new = shrink_after_oom(r, global_batch, step, error)
    return {"micro_batch_size": new, "was": old}


def shrink_after_oom(r: Recovery, global_batch: int, step: int, error: BaseException) -> tuple[int, int]:
    """Halve the micro-batch (the accumulation grows; the global batch is unchanged)."""
    if r.micro_batch_size <= 1:
        raise NoSmallerBatch(str(error))
    old = r.micro_batch_size
    r.micro_batch_size = max(1, old // 2)
    r.accumulation = math.ceil(global_batch / r.micro_batch_size)
    warn(f"out of memory at micro-batch {old}; redoing step {step + 1} with micro-batch "
         f"{r.micro_batch_size} x {r.accumulation} (same global batch, same maths)")
    return old, r.micro_batch_size


def memory_breakdown() -> str:
    if not torch.cuda.is_available():
        return "memory breakdown: not on a GPU"
    allocated = torch.cuda.memory_allocated() / GIB
    reserved = torch.cuda.memory_reserved() / GIB
    peak = torch.cuda.max_memory_allocated() / GIB
    free, total = torch.cuda.mem_get_info()
    return (f"memory: {allocated:.2f} GiB allocated, {reserved:.2f} GiB reserved, peak {peak:.2f} GiB, "
            f"{free / GIB:.2f} GiB free of {total / GIB:.2f} GiB")


def oom_advice(cfg: TrainConfig) -> str:
    tips = [f"a shorter max_seq_length (now {cfg.max_seq_length}; note: changing it starts a new run)"]
    if not (cfg.load_in_4bit or cfg.load_in_8bit):
        tips.append("load_in_4bit: true (QLoRA)")
    if not cfg.gradient_checkpointing:
        tips.append("gradient_checkpointing: true")
    if cfg.optim == "adamw_torch":
        tips.append("optim: paged_adamw_8bit")
    return ("out of memory even at micro-batch 1. What else would help:\n  - " + "\n  - ".join(tips)
            + f"\n  {memory_breakdown()}")


def is_bad_step(loss: float, grad_norm: float, uses_scaler: bool) -> bool:
    """A step that must not count as progress: non-finite loss, or non-finite gradients
    without a gradient scaler (with fp16 scaling, an overflow is routine and handled by it)."""
    return not math.isfinite(loss) or (not uses_scaler and not math.isfinite(grad_norm))


def lower_learning_rate(scheduler, optimizer, factor: float) -> None:
    """Scale the schedule's peak, and the rate in force now, by `factor`."""
    scheduler.base_lrs = [lr * factor for lr in scheduler.base_lrs]
    for group in optimizer.param_groups:
        group["lr"] *= factor
    scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]
