"""Fit verdicts against a GPU, the largest micro-batch at a fixed global batch, and what to change when nothing fits."""

from __future__ import annotations

from dataclasses import dataclass, replace

from relaytune.liger import PATCHES as LIGER_MODEL_TYPES
from relaytune.plan.architectures import Architecture
from relaytune.plan.gpus import Gpu
from relaytune.plan.memory import GIB, MemoryEstimate, Settings, estimate_memory

# "fits" keeps 10% of the card free beyond the prediction: measured on an H200 under a 14.5 GiB cap, a
# prediction at 94% of the cap ran out of memory, since the allocator fragments during the recomputed
# layer's backward (bench/results/planner.md).
MARGIN = 0.10
# Turning checkpointing off needs more room: activations grow with every row, and an OOM mid-run costs
# a step redone at a smaller micro-batch.
GC_OFF_MARGIN = 0.10
FITS, TIGHT, NO_FIT = "fits", "tight", "does not fit"
MIN_SEQ = 128


def fit_status(estimate: MemoryEstimate, gpu: Gpu, margin: float = MARGIN) -> str:
    """fits: on-card total within the card less the margin; does not fit: over the card even without the
    allocator's slack; tight: in between (it may run; relaytune steps the micro-batch down if not)."""
    if estimate.total_reserved <= gpu.memory_gib * (1 - margin) * GIB:
        return FITS
    if estimate.total_reserved - estimate.slack > gpu.memory_gib * GIB:
        return NO_FIT
    return TIGHT


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def largest_micro_batch(arch: Architecture, settings: Settings, gpu: Gpu, global_batch: int,
                        gradient_checkpointing: bool, margin: float = MARGIN,
                        divisors_only: bool = True) -> int | None:
    """The largest micro-batch that fits with the margin, at most the global batch, or None if even 1 does not.

    With divisors_only, it divides the global batch, so every micro-batch of a step is full and
    gradient_accumulation_steps = global_batch / micro-batch exactly. (relaytune's maths is the same
    either way: the loss is normalised over the whole global batch.)
    """
    candidates = divisors(global_batch) if divisors_only else list(range(1, global_batch + 1))
    best = None
    # Memory grows with the micro-batch, so the first one that does not fit ends the search.
    for mb in candidates:
        if fit_status(estimate_memory(arch, settings, mb, gradient_checkpointing), gpu, margin) != FITS:
            break
        best = mb
    return best


@dataclass(frozen=True)
class Change:
    """One thing to change in the config, with the predicted peak after it (at micro-batch 1)."""

    what: str  # e.g. "load_in_4bit: true"
    estimate: MemoryEstimate
    status: str


def changes_when_nothing_fits(arch: Architecture, settings: Settings, gpu: Gpu,
                              gradient_checkpointing: bool) -> list[Change]:
    """Each single change that helps, with its predicted peak at micro-batch 1, then all of them together."""
    options: list[tuple[str, Settings, bool]] = []
    if settings.quantization != "nf4":
        what = "load_in_4bit: true" + (" (and load_in_8bit: false)" if settings.quantization == "int8" else "")
        options.append((what, replace(settings, quantization="nf4"), gradient_checkpointing))
    if settings.optim != "paged_adamw_8bit":
        options.append(("optim: paged_adamw_8bit", replace(settings, optim="paged_adamw_8bit"),
                        gradient_checkpointing))
    if not gradient_checkpointing:
        options.append(("gradient_checkpointing: true", settings, True))
    if not settings.offload_activations:
        what = "offload_activations: true" + ("" if gradient_checkpointing else " (with gradient_checkpointing: true)")
        options.append((what, replace(settings, offload_activations=True), True))
    swiglu = with_liger_swiglu(arch, settings)
    if swiglu is not settings:
        options.append(("liger_kernels: [swiglu] (pip install liger-kernel)", swiglu, gradient_checkpointing))
    out = [_change(arch, s, gpu, gc, what) for what, s, gc in options]
    # Everything above at once; a shorter sequence is proposed only if that is not enough.
    combined = replace(swiglu, quantization="nf4", optim="paged_adamw_8bit", offload_activations=True)
    if len(options) > 1:
        out.append(_change(arch, combined, gpu, True, "all of the above"))
    if options and fit_status(estimate_memory(arch, combined, 1, True), gpu) == FITS:
        return out
    seq = _shortest_fitting_seq(arch, combined, gpu, True)
    if seq is not None:
        prefix = ("with all of the above, " if len(options) > 1 else f"with {options[0][0]}, " if options else "")
        out.append(_change(arch, replace(combined, max_seq_length=seq), gpu, True, f"{prefix}max_seq_length: {seq}"))
    return out


def with_liger_swiglu(arch: Architecture, settings: Settings) -> Settings:
    """`settings` with Liger's SwiGLU added where relaytune can put it on this model and the plan counts its
    saving (compiled layers; measured there only); the same object where not."""
    if not settings.compiled_layers or "swiglu" in settings.liger_kernels or arch.model_type not in LIGER_MODEL_TYPES:
        return settings
    return replace(settings, liger_kernels=(*settings.liger_kernels, "swiglu"))


def _change(arch, settings, gpu, gc, what) -> Change:
    estimate = estimate_memory(arch, settings, 1, gc)
    return Change(what, estimate, fit_status(estimate, gpu))


def _shortest_fitting_seq(arch, settings, gpu, gc) -> int | None:
    """The longest max_seq_length, halving from the configured one, at which micro-batch 1 fits."""
    seq = settings.max_seq_length
    while seq > MIN_SEQ:
        seq = max(MIN_SEQ, seq // 2)
        if fit_status(estimate_memory(arch, replace(settings, max_seq_length=seq), 1, gc), gpu) == FITS:
            return seq
    return None


def largest_with_offload(arch: Architecture, settings: Settings, gpu: Gpu, global_batch: int,
                         gradient_checkpointing: bool) -> int | None:
    """The largest micro-batch dividing the global batch that offload_activations would fit, when the
    config has checkpointing on and offloading off (None otherwise, or if not even 1 fits)."""
    if not gradient_checkpointing or settings.offload_activations:
        return None
    return largest_micro_batch(arch, replace(settings, offload_activations=True), gpu, global_batch, True)


@dataclass(frozen=True)
class CheckpointingOff:
    """Whether gradient checkpointing could be off: at the configured micro-batch, or else the largest that fits."""

    status: str  # at the configured micro-batch, with GC_OFF_MARGIN
    estimate: MemoryEstimate
    largest_micro_batch: int | None


def checkpointing_off(arch, settings, gpu, micro_batch: int, global_batch: int) -> CheckpointingOff:
    estimate = estimate_memory(arch, settings, micro_batch, False)
    return CheckpointingOff(fit_status(estimate, gpu, GC_OFF_MARGIN), estimate,
                            largest_micro_batch(arch, settings, gpu, global_batch, False, GC_OFF_MARGIN))


# With both set to auto, checkpointing goes off once a micro-batch of this many tokens fits without it (or
# the largest with it, if smaller): past a few thousand tokens per forward a larger micro-batch gains little,
# while recomputing every layer always costs about a third more compute.
AUTO_GC_OFF_TOKENS = 2048


def choose_auto(arch: Architecture, settings: Settings, gpu: Gpu, micro_batch: int | str, global_batch: int,
                gradient_checkpointing: bool | str) -> tuple[int | None, bool]:
    """Resolve `per_device_train_batch_size: auto` and `gradient_checkpointing: auto` on a GPU.

    Returns (micro-batch, checkpointing); the micro-batch is None when not even 1 fits by the plan.
    A fixed micro-batch with checkpointing auto: off when it fits with GC_OFF_MARGIN. A fixed
    checkpointing with micro-batch auto: the largest micro-batch dividing the global batch that fits.
    """
    auto_mb, auto_gc = micro_batch == "auto", gradient_checkpointing == "auto"
    if not auto_gc:
        gc = bool(gradient_checkpointing)
        return (largest_micro_batch(arch, settings, gpu, global_batch, gc) if auto_mb else int(micro_batch)), gc
    if not auto_mb:
        off = checkpointing_off(arch, settings, gpu, int(micro_batch), global_batch).status == FITS
        return int(micro_batch), not off
    on = largest_micro_batch(arch, settings, gpu, global_batch, True)
    off = largest_micro_batch(arch, settings, gpu, global_batch, False, GC_OFF_MARGIN)
    seq = settings.max_seq_length
    if off is not None and off * seq >= min((on or 0) * seq, AUTO_GC_OFF_TOKENS):
        return off, False
    return on, True


def checkpoint_in_force(arch: Architecture, settings: Settings, gpu: Gpu, micro_batch: int,
                        gradient_checkpointing: bool) -> Settings:
    """`compile_checkpoint: auto` at the micro-batch in force: where auto would compile the checkpoint
    inside each layer (the input embedding in host memory pays for its higher backward peak), it does so
    only if the plan with it inside fits this GPU with the margin; otherwise the settings come back with
    it outside, before the first step rather than after its out-of-memory error. On an H200 under a
    14.5 GiB cap, Llama-3-8B QLoRA at micro-batch 8 ran out of memory with it inside (14.31 GiB when it
    failed; planned 15.14) and trained with it outside (bench/results/vs-trl-h200.md, twentieth session)."""
    if settings.compile_checkpoint != "auto":
        return settings
    outside = replace(settings, compile_checkpoint="off")
    inside = estimate_memory(arch, settings, micro_batch, gradient_checkpointing)
    if inside.total_allocated == estimate_memory(arch, outside, micro_batch, gradient_checkpointing).total_allocated:
        return settings  # auto keeps it outside here anyway
    return settings if fit_status(inside, gpu) == FITS else outside
