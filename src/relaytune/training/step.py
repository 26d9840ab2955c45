"""One optimizer step: forward and backward over the micro-batches of one global batch, then one update.

The loss of each micro-batch is its summed token loss divided by the target tokens of the
*whole* global batch, so the accumulated gradient is the same whatever the micro-batch size:
that is what lets an OOM halve the micro-batch without changing the maths.

With several processes each rank takes a contiguous share of the global batch (World.share),
still divides by the target tokens of the whole global batch (every rank knows every row), and
the ranks' gradients are summed (World.sum_grads) once they agree that nobody ran out of memory:
W ranks x micro-batch m and 1 rank x W*m train the same rows with the same maths, up to the
order of float summation. With one process none of that runs.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from relaytune import faults
from relaytune.data.batches import count_targets, micro_batches, to_device
from relaytune.distributed import agree, fsdp
from relaytune.distributed.world import World, current
from relaytune.model import Precision
from relaytune.training.loss import causal_lm_loss, supports_chunked_loss
from relaytune.training.optim import skips_on_device
from relaytune.training.prefetch import Prefetch


@dataclass
class StepParts:
    """What every step needs and never changes during a run."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None
    precision: Precision
    pad_id: int
    max_grad_norm: float
    world: World = field(default_factory=current)  # one process unless the recipe joined a group
    width: int | None = None  # pad every micro-batch to this many positions (speedups.batch_width)

    def __post_init__(self):
        self.chunked = supports_chunked_loss(self.model)
        self.params = [p for g in self.optimizer.param_groups for p in g["params"]]
        self.sharded = self.world.distributed and fsdp.is_sharded(self.model)
        # One process, no fp16 scaler, fused AdamW: the update is queued before the host reads the loss.
        self.queues_update = (self.scaler is None and not self.world.distributed
                              and skips_on_device(self.optimizer))
        # While it waits for the loss, the host makes the next step's micro-batches (the trainer names them).
        self.prefetch = Prefetch(self.model, self.pad_id, self.width, self.precision.device)

    def loss_scale(self) -> torch.Tensor | None:
        """fp16: the factor the gradient scaler multiplies the loss by, as a tensor on the device (no
        sync), so the loss can compute the output head's gradient in forward already scaled."""
        if self.scaler is None:
            return None
        return self.scaler.scale(torch.ones((), device=self.precision.device))


@dataclass(frozen=True)
class StepResult:
    loss: float
    grad_norm: float
    updated: bool  # False when a non-finite loss or gradient kept the weights unchanged


def optimizer_step(parts: StepParts, rows: list, micro_batch_size: int, step: int) -> StepResult:
    """Forward and backward over every micro-batch of one global batch, then one update."""
    n_targets = count_targets(rows)  # of the whole global batch, on every rank
    if parts.world.distributed:
        return _distributed_step(parts, rows, n_targets, micro_batch_size, step)
    total_loss = _forward_backward(parts, rows, n_targets, micro_batch_size, step)
    return _update(parts, total_loss, prepare_next=lambda: parts.prefetch.prepare(step + 1, micro_batch_size))


def _forward_backward(parts: StepParts, rows: list, n_targets: int, micro_batch_size: int,
                      step: int, passes: int = 0, filler: list | None = None) -> torch.Tensor:
    """Gradients of `rows`, micro-batch by micro-batch; returns their summed (normalised) loss.

    `passes`: under FSDP every rank must run as many forward/backward passes as the rank with the
    longest share (each pass all-gathers the layers); the missing ones run `filler` rows with the
    loss times zero, which gathers and adds nothing."""
    autocast = (torch.autocast(parts.precision.device.type, dtype=parts.precision.autocast)
                if parts.precision.autocast else contextlib.nullcontext())
    total_loss = torch.zeros((), device=parts.precision.device)
    scale = parts.loss_scale()
    done = 0
    for i, batch in enumerate(parts.prefetch.batches(rows, micro_batch_size)):
        if faults.oom_now(step, i):
            raise torch.OutOfMemoryError("CUDA out of memory (injected by RELAYTUNE_OOM_AT)")
        with autocast:
            loss = causal_lm_loss(parts.model, batch, n_targets, chunked=parts.chunked, loss_scale=scale)
        if i == 0 and faults.nan_now(step):
            loss = loss * float("nan")
        (parts.scaler.scale(loss) if parts.scaler else loss).backward()
        total_loss += loss.detach().float()
        done += 1
    for _ in range(passes - done):
        batch = to_device(next(micro_batches(filler, 1, parts.pad_id, width=parts.width)), parts.precision.device)
        with autocast:
            (causal_lm_loss(parts.model, batch, n_targets, chunked=parts.chunked, loss_scale=scale) * 0.0).backward()
    return total_loss


def _distributed_step(parts: StepParts, rows: list, n_targets: int, micro_batch_size: int,
                      step: int) -> StepResult:
    """This rank's share, then agreement on OOM, then the ranks' gradients summed, then the
    same update on every rank (their gradients, hence weights and optimizer states, are equal)."""
    world = parts.world
    mine = world.share(rows)
    if parts.sharded:  # collectives inside forward: an OOM cannot be agreed on, it ends the round (fsdp.py)
        longest = math.ceil(math.ceil(len(rows) / world.size) / micro_batch_size)
        total_loss = _forward_backward(parts, mine, n_targets, micro_batch_size, step, longest, rows[:1])
        world.sum_grads(parts.params)
        return _update(parts, total_loss)
    total_loss = torch.zeros((), device=parts.precision.device)
    oom: torch.OutOfMemoryError | None = None
    try:
        total_loss = _forward_backward(parts, mine, n_targets, micro_batch_size, step)
    except torch.OutOfMemoryError as e:
        oom = e
    if agree.any_oom(world, oom is not None):  # every rank redoes the step with half the micro-batch
        parts.optimizer.zero_grad(set_to_none=True)
        del total_loss
        raise oom or torch.OutOfMemoryError(f"out of memory on another rank at step {step + 1}")
    world.sum_grads(parts.params)
    return _update(parts, total_loss)


def _update(parts: StepParts, total_loss: torch.Tensor, prepare_next: Callable[[], None] | None = None
            ) -> StepResult:
    if parts.scaler:
        parts.scaler.unscale_(parts.optimizer)
    limit = parts.max_grad_norm if parts.max_grad_norm > 0 else float("inf")
    norm = torch.nn.utils.clip_grad_norm_(parts.params, limit)
    if parts.queues_update:
        return _queued_update(parts, total_loss, norm, prepare_next)
    loss_value, norm_value = agree.step_numbers(parts.world, total_loss.item(), norm.item())
    updated = math.isfinite(loss_value) and math.isfinite(norm_value)
    if parts.scaler:
        parts.scaler.step(parts.optimizer)  # skips by itself on inf/nan gradients
        parts.scaler.update()
    elif updated:
        parts.optimizer.step()
    parts.optimizer.zero_grad(set_to_none=True)
    return StepResult(loss_value, norm_value, updated)


def _queued_update(parts: StepParts, total_loss: torch.Tensor, norm: torch.Tensor,
                   prepare_next: Callable[[], None] | None) -> StepResult:
    """The same update, queued before the host reads the step's numbers: the fused AdamW skips it on
    the GPU when the loss or the gradient norm is not finite (`found_inf`: weights, moments and step
    counts stay as they were; only a skipped first step leaves zero moments where the host's skip left
    none, which the next update treats alike). Reading the loss first made the GPU idle while the host
    launched the update, then while it made the next step's batch, which `prepare_next` makes here."""
    finite = torch.isfinite(total_loss) & torch.isfinite(norm)
    parts.optimizer.found_inf = (~finite).float()
    try:
        parts.optimizer.step()
    finally:
        del parts.optimizer.found_inf
    parts.optimizer.zero_grad(set_to_none=True)
    if prepare_next is not None:
        prepare_next()
    loss_value, norm_value = total_loss.item(), norm.item()  # nothing allocated after the update: no OOM here
    return StepResult(loss_value, norm_value, math.isfinite(loss_value) and math.isfinite(norm_value))
