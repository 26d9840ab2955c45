"""What every rank must decide together, each from one tiny all-reduce.

A rank that decides alone leaves the others waiting in a collective for ever. So:
- a stop (a signal on any rank, the deadline on any rank, checkpoints failing on rank 0) stops
  every rank at the same step boundary (`stop_flags`, once per step);
- an out-of-memory error on any rank makes every rank redo the step with half the micro-batch
  (`any_oom`, after each rank's forward/backward attempt, before gradients are reduced);
- a non-finite loss or gradient norm on any rank skips the step on every rank (`step_numbers`:
  the loss is summed over the ranks, and a non-finite norm anywhere counts for all).
With one process each is the local value, computed the same way as before.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from relaytune.distributed.world import World


@dataclass(frozen=True)
class StopFlags:
    signal: bool = False
    deadline: bool = False
    disk: bool = False

    @property
    def any(self) -> bool:
        return self.signal or self.deadline or self.disk


def stop_flags(world: World, signal: bool, deadline: bool, disk: bool) -> StopFlags:
    """The union of every rank's reasons to stop after this step."""
    values = [float(signal), float(deadline), float(disk)]
    if world.distributed:
        values = world.all_reduce(values, "max")
    return StopFlags(*(bool(v) for v in values))


def any_oom(world: World, oom: bool) -> bool:
    return world.any(oom) if world.distributed else oom


def all_released(world: World, released: list[str]) -> list[str]:
    """What an OOM made this rank give up, where every rank gave something up; else nothing, so
    that every rank halves the micro-batch together (they redo the step the same way)."""
    if not world.distributed:
        return released
    return released if not world.any(not released) else []


def step_numbers(world: World, local_loss: float, grad_norm: float) -> tuple[float, float]:
    """The global batch's loss (the sum of the ranks' shares, each already divided by the
    global target count) and the gradient norm (the same on every rank once gradients are
    reduced; a non-finite one anywhere is NaN everywhere)."""
    if not world.distributed:
        return local_loss, grad_norm
    import torch

    # float32, as one process accumulates its micro-batch losses: the same sum, the same digits
    loss, bad = world.all_reduce([local_loss, 0.0 if math.isfinite(grad_norm) else 1.0], "sum", torch.float32)
    return loss, (grad_norm if not bad else float("nan"))
