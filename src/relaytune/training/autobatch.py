"""`per_device_train_batch_size: auto` and `gradient_checkpointing: auto`: planned, then confirmed.

1. Plan (before the model loads): the memory planner (relaytune.plan) is asked for the largest
   micro-batch dividing the global batch that fits this GPU, with the GPU's real free memory
   (torch.cuda.mem_get_info) capped by torch.cuda.set_per_process_memory_fraction if one is set,
   and whether the activations fit without checkpointing (plan/advice.choose_auto). On the CPU the
   planner does not apply (it models GPUs): the micro-batch is the largest divisor of the global
   batch up to CPU_MICRO_BATCH, and checkpointing is off.
2. Confirm (after the model loads): one trial step, forward and backward of the longest rows of
   the data at that micro-batch, with no optimizer step; the RNG state is saved and restored and
   the gradients dropped, so the run's numerics are untouched. A real torch.OutOfMemoryError bisects
   down over the divisors of the global batch; an OOM even at micro-batch 1 without checkpointing
   turns checkpointing on and bisects again.
3. Record: the choice and the GPU it was made for (name and total memory) go into every checkpoint
   ("auto_choice" in trainer_state.json); a resume on the same GPU takes it from there and does not
   probe again. The micro-batch in force is Recovery.micro_batch_size, as after an OOM.

The micro-batch only decides how a global batch is split (training/step.py divides the loss by the
target tokens of the whole global batch), so `auto` trains the same run as that micro-batch set by
hand; the global batch is the config's global_batch_size.
"""

from __future__ import annotations

import contextlib
import gc as garbage
from dataclasses import dataclass, field

import torch

from relaytune.errors import UserError
from relaytune.log import info, notice, warn
from relaytune.training.speedups import compile_decision

CPU_MICRO_BATCH = 8  # the CPU default for `auto`: the largest divisor of the global batch up to this
GIB = 2 ** 30
AUTO = "auto"


@dataclass
class AutoChoice:
    """The micro-batch and checkpointing in force at start-up, and how they were reached."""

    micro_batch: int
    gradient_checkpointing: bool
    device: str  # the GPU's name, or "cpu"
    total_memory: int  # bytes of the GPU (0 on the CPU): with the name, what "the same GPU" means
    how_micro: str  # for the preflight table
    how_gc: str
    auto_micro: bool = False
    auto_gc: bool = False
    from_checkpoint: bool = False
    budget_gib: float | None = None  # what the planner was told the GPU offers (None: CPU)
    trials: int = 0  # trial steps run in this session (0 on a resume on the same GPU)
    trial_peak: int | None = None  # peak allocated bytes of the last successful trial step
    estimate: object | None = field(default=None, repr=False)  # plan.MemoryEstimate at the choice
    frozen_bytes: int | None = None  # the planner's frozen-weights part (the preflight's refusal)
    plan_inputs: tuple | None = field(default=None, repr=False)  # (Architecture, Settings, Gpu) on a GPU
    checkpoint_outside: str | None = None  # why compile_checkpoint: auto stays off (plan.checkpoint_in_force)

    def refresh_estimate(self) -> None:
        """The planner's figure at the micro-batch and checkpointing now in force (after a trial step)."""
        if self.plan_inputs is not None:
            from relaytune.plan import estimate_memory

            arch, settings, _ = self.plan_inputs
            self.estimate = estimate_memory(arch, settings, self.micro_batch, self.gradient_checkpointing)
            self.frozen_bytes = self.estimate.parts["frozen weights"]

    def load_settings(self) -> dict:
        """The config's fields as the model loads with them: the checkpointing in force, and the
        checkpoint kept outside the compiled layers where the plan says it would not fit inside (which
        it also tells the user, once per load)."""
        if self.checkpoint_outside:
            notice(f"compile_checkpoint: off ({self.checkpoint_outside})")
            return {"gradient_checkpointing": self.gradient_checkpointing, "compile_checkpoint": False}
        return {"gradient_checkpointing": self.gradient_checkpointing}

    @property
    def probes(self) -> bool:
        """Whether a trial step confirms the choice at start-up (a fresh `auto` choice)."""
        return (self.auto_micro or self.auto_gc) and not self.from_checkpoint

    def record(self) -> dict:
        """What a checkpoint keeps (trainer_state.json "auto_choice")."""
        return {"micro_batch_size": self.micro_batch, "gradient_checkpointing": self.gradient_checkpointing,
                "device": self.device, "total_memory": self.total_memory}


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def device_identity() -> tuple[str, int]:
    if not torch.cuda.is_available():
        return "cpu", 0
    device = torch.cuda.current_device()  # each rank's own GPU
    return torch.cuda.get_device_name(device), int(torch.cuda.mem_get_info(device)[1])


def gpu_budget_bytes() -> int:
    """What torch's allocator may still get on this rank's GPU: free memory, under any fraction cap."""
    device = torch.cuda.current_device()
    free, total = torch.cuda.mem_get_info(device)
    fraction = 1.0
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if getter is not None:
        with contextlib.suppress(Exception):
            fraction = float(getter(device))
    capped = int(fraction * total) - torch.cuda.memory_reserved(device)
    return max(0, min(int(free), capped))


def planner_gpu():
    """This GPU as the planner's `Gpu`: its usable memory now (CUDA context counted as the table does),
    and its dense peak where known (whether the layers replay CUDA graphs follows from it)."""
    from relaytune.plan.gpus import CUDA_CONTEXT_GIB, Gpu
    from relaytune.training.mfu import peak_flops

    name, _ = device_identity()
    budget = gpu_budget_bytes() / GIB
    peak = peak_flops(name)
    return Gpu(f"{name} ({budget:.1f} GiB usable)", budget + CUDA_CONTEXT_GIB, torch.cuda.is_bf16_supported(),
               peak / 1e12 if peak else None, compiles=_compiles_here())


def _compiles_here() -> bool:
    """Whether torch_compile: auto compiles the layers on this GPU (False when its capability cannot be read)."""
    try:
        return compile_decision("auto", torch.device("cuda"))[0]
    except (RuntimeError, AssertionError):
        return False


def choose(cfg, saved: dict | None, model_dir: str | None = None) -> AutoChoice:
    """The micro-batch and checkpointing for this session, before the model loads.

    saved: the resumed checkpoint's trainer_state (None on a fresh start); model_dir: the model's local
    folder once resolved (its config.json is what the planner reads), else the config's `model`."""
    micro_setting, gc_setting = cfg.per_device_train_batch_size, cfg.gradient_checkpointing
    global_batch = cfg.global_batch_size
    auto_micro, auto_gc = micro_setting == AUTO, gc_setting == AUTO
    device, total = device_identity()
    choice = AutoChoice(micro_batch=micro_setting if not auto_micro else 0,
                        gradient_checkpointing=bool(gc_setting) if not auto_gc else False,
                        device=device, total_memory=total, how_micro="as configured", how_gc="as configured",
                        auto_micro=auto_micro, auto_gc=auto_gc)
    kept = _from_checkpoint(saved, device, total, auto_micro, auto_gc)
    if kept is not None:
        if auto_micro:
            choice.micro_batch = int(kept["micro_batch_size"])
            choice.how_micro = f"auto, from the checkpoint (chosen for {_where(device, total)}; not probed again)"
        if auto_gc:
            choice.gradient_checkpointing = bool(kept["gradient_checkpointing"])
            choice.how_gc = f"auto, from the checkpoint (chosen for {_where(device, total)})"
        choice.from_checkpoint = True
        info(f"auto: micro-batch {choice.micro_batch}, checkpointing "
             f"{'on' if choice.gradient_checkpointing else 'off'}, from the checkpoint (same GPU: "
             f"{_where(device, total)}); not probing again")
    elif saved is not None and (auto_micro or auto_gc) and saved.get("auto_choice"):
        old = saved["auto_choice"]
        info(f"auto: the checkpoint's choice was made for {_where(old.get('device'), old.get('total_memory'))}, "
             f"this is {_where(device, total)}: choosing again")
    arch, settings, gpu = _plan_inputs(cfg, model_dir) if device != "cpu" else (None, None, None)
    if not choice.from_checkpoint and (auto_micro or auto_gc):
        _choose_fresh(choice, (arch, settings, gpu), micro_setting, gc_setting, global_batch)
    if arch is not None:
        _place_checkpoint(choice, arch, settings, gpu)
        choice.refresh_estimate()
    return choice


def _place_checkpoint(choice: AutoChoice, arch, settings, gpu) -> None:
    """The plan's inputs with `compile_checkpoint: auto` resolved at the micro-batch in force."""
    from relaytune.plan import GIB, checkpoint_in_force, estimate_memory
    from relaytune.plan.advice import MARGIN

    in_force = checkpoint_in_force(arch, settings, gpu, choice.micro_batch, choice.gradient_checkpointing)
    choice.checkpoint_outside = None
    if in_force is not settings:
        inside = estimate_memory(arch, settings, choice.micro_batch, choice.gradient_checkpointing)
        choice.checkpoint_outside = (f"with the checkpoint compiled inside the layers, micro-batch "
                                     f"{choice.micro_batch} is planned at {inside.total_allocated / GIB:.2f} GiB, "
                                     f"more than {gpu.name} holds with a {MARGIN:.0%} margin")
    choice.plan_inputs = (arch, in_force, gpu)


def shard(choice: AutoChoice, cfg, shards: int) -> None:
    """The plan again once FSDP shards the frozen base over `shards` processes: each GPU's share of the
    weights, the settings the sharded model loads with (`cfg`, distributed/fsdp.load_settings applied),
    and a fresh `auto` choice from it (no trial step confirms one under FSDP)."""
    if choice.plan_inputs is None:
        return
    from relaytune.plan import settings_from_config

    arch, _, gpu = choice.plan_inputs
    settings = settings_from_config(cfg, gpu, shards=shards)
    if choice.probes:
        _choose_fresh(choice, (arch, settings, gpu), cfg.per_device_train_batch_size, cfg.gradient_checkpointing,
                      cfg.global_batch_size)
    _place_checkpoint(choice, arch, settings, gpu)
    choice.refresh_estimate()


def _choose_fresh(choice: AutoChoice, plan_inputs, micro_setting, gc_setting, global_batch: int) -> None:
    """The `auto` settings chosen on this device, with no checkpoint's choice to keep: the CPU's
    defaults, a safe start where the planner does not know the model, else the planner's."""
    arch, settings, gpu = plan_inputs
    auto_micro, auto_gc, device = choice.auto_micro, choice.auto_gc, choice.device
    if device == "cpu":
        if auto_micro:
            choice.micro_batch = max(d for d in divisors(global_batch) if d <= CPU_MICRO_BATCH)
            choice.how_micro = (f"auto: the CPU default, the largest divisor of {global_batch} up to "
                                f"{CPU_MICRO_BATCH}")
        if auto_gc:
            choice.gradient_checkpointing = False
            choice.how_gc = "auto: always off on the CPU; the memory planner is for GPUs"
    elif arch is None:
        if auto_micro:
            choice.micro_batch = max(d for d in divisors(global_batch) if d <= CPU_MICRO_BATCH)
            choice.how_micro = f"auto: no plan for this model; starting at {choice.micro_batch}"
        if auto_gc:
            choice.gradient_checkpointing = True
            choice.how_gc = "auto: on (no plan for this model)"
    else:
        from relaytune.plan import choose_auto

        micro, gc_on = choose_auto(arch, settings, gpu, micro_setting, global_batch, gc_setting)
        choice.budget_gib = gpu.memory_gib
        if auto_micro:
            choice.micro_batch = micro or 1
            choice.how_micro = (f"auto: planned for {gpu.name}" if micro else
                                f"auto: the plan says not even 1 fits {gpu.name}; trying 1")
        if auto_gc:
            choice.gradient_checkpointing = gc_on
            choice.how_gc = (f"auto: {'on' if gc_on else 'off'} (activations "
                             f"{'do not fit' if gc_on else 'fit'} {gpu.name} without it with a 10% margin)")


def _where(device, total) -> str:
    return "the CPU" if device == "cpu" else f"{device} ({(total or 0) / GIB:.1f} GiB)"


def _from_checkpoint(saved: dict | None, device: str, total: int, auto_micro: bool, auto_gc: bool) -> dict | None:
    """The checkpoint's auto choice, if it was made by `auto` on this very GPU (name and total memory)."""
    if saved is None or not (auto_micro or auto_gc):
        return None
    kept, config = saved.get("auto_choice"), saved.get("config") or {}
    if not kept or kept.get("device") != device or kept.get("total_memory") != total:
        return None
    if auto_micro and config.get("per_device_train_batch_size") != AUTO:
        return None
    if auto_gc and config.get("gradient_checkpointing") != AUTO:
        return None
    return kept


def _plan_inputs(cfg, model_dir: str | None):
    """(architecture, settings, this GPU) for the planner; (None, None, None) when it does not know the model."""
    from relaytune.plan import resolve_architecture, settings_from_config

    try:
        try:
            arch = resolve_architecture(model_dir) if model_dir else resolve_architecture(cfg.model)
        except UserError:
            if not model_dir:
                raise
            arch = resolve_architecture(cfg.model)
    except UserError as e:
        warn(f"the memory planner cannot plan this model ({str(e).splitlines()[0][:160]})")
        return None, None, None
    gpu = planner_gpu()
    return arch, settings_from_config(cfg, gpu), gpu


# --- the trial step ------------------------------------------------------------------------------
def longest_rows(rows, n: int) -> list:
    """The n longest training rows (the widest micro-batch a step can meet), longest first."""
    import numpy as np

    lengths = np.asarray(rows.lengths if hasattr(rows, "lengths") else [len(r.input_ids) for r in rows])
    order = np.argsort(-lengths, kind="stable")[:n]
    return [rows[int(i)] for i in order]


def trial_step(parts, rows: list) -> int | None:
    """Forward and backward of `rows` as one micro-batch, no optimizer step; returns the peak allocated bytes.

    The RNG state is saved and restored, the gradients dropped, and the model's train/eval mode put back,
    so nothing the run computes afterwards depends on whether this ran. A torch.OutOfMemoryError propagates."""
    from relaytune.checkpoint.state import capture_rng, reset_rng
    from relaytune.data.batches import collate, count_targets, to_device
    from relaytune.training.loss import causal_lm_loss

    model, precision = parts.model, parts.precision
    rng, was_training = capture_rng(), model.training
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    autocast = (torch.autocast(precision.device.type, dtype=precision.autocast)
                if precision.autocast else contextlib.nullcontext())
    try:
        model.train()  # checkpointing and dropout act in training mode only
        batch = to_device(collate(rows, parts.pad_id, width=parts.width), precision.device)
        with autocast:
            loss = causal_lm_loss(model, batch, count_targets(rows), chunked=parts.chunked,
                                  loss_scale=parts.loss_scale())
        (parts.scaler.scale(loss) if parts.scaler else loss).backward()
        del loss, batch
        return torch.cuda.max_memory_allocated() if cuda else None
    finally:
        parts.optimizer.zero_grad(set_to_none=True)
        for p in model.parameters():  # anything outside the optimizer (none in LoRA), to be sure
            p.grad = None
        model.train(was_training)
        reset_rng(rng)
        garbage.collect()
        if cuda:
            torch.cuda.empty_cache()


def confirm(choice: AutoChoice, parts, train_rows, cfg, enable_checkpointing=None, step=trial_step) -> AutoChoice:
    """Run the trial step at the chosen micro-batch; on a real OOM bisect down over the divisors of the
    global batch. `enable_checkpointing(model, offload=...)` turns checkpointing on when even 1 does not
    fit without it."""
    if not choice.probes:
        return choice
    global_batch = cfg.global_batch_size
    widest = longest_rows(train_rows, choice.micro_batch if choice.auto_micro else min(choice.micro_batch,
                                                                                       len(train_rows)))
    candidates = [d for d in divisors(global_batch) if d <= choice.micro_batch] if choice.auto_micro \
        else [choice.micro_batch]
    good, bad = -1, len(candidates)  # indices: candidates[good] fits, candidates[bad] does not
    index = len(candidates) - 1
    while True:
        micro = candidates[index]
        choice.trials += 1
        try:
            choice.trial_peak = step(parts, widest[:micro])
            good = index
        except torch.OutOfMemoryError:
            bad = index
            warn(f"auto: the trial step ran out of memory at micro-batch {micro}"
                 f"{'' if choice.gradient_checkpointing else ' without checkpointing'}")
        if bad - good <= 1:
            break
        index = (good + bad) // 2
    if good >= 0:
        picked = candidates[good]
        if picked != choice.micro_batch:
            choice.how_micro += f"; the trial step bisected {choice.micro_batch} down to {picked}"
        else:
            choice.how_micro += "; confirmed by a trial step"
        choice.micro_batch = picked
        choice.refresh_estimate()
        return choice
    if not choice.gradient_checkpointing and choice.auto_gc and enable_checkpointing is not None:
        enable_checkpointing(parts.model, offload=cfg.offload_activations)
        choice.gradient_checkpointing = True
        choice.how_gc = "auto: on (the trial step ran out of memory without it)"
        return confirm(choice, parts, train_rows, cfg, None, step)
    from relaytune.training.recovery import oom_advice

    resolved = cfg.model_copy(update={"gradient_checkpointing": choice.gradient_checkpointing})
    raise UserError(f"auto: the trial step runs out of memory even at micro-batch {candidates[0]}; "
                    + oom_advice(resolved))


def table_rows(choice: AutoChoice, global_batch: int) -> list[tuple[str, str]]:
    """The preflight table's rows for the micro-batch, checkpointing and the planner's memory figure."""
    accumulation = -(-global_batch // choice.micro_batch)
    rows = [("micro-batch", f"{choice.micro_batch} x {accumulation} = global batch {global_batch} "
                            f"({choice.how_micro})"),
            ("checkpointing", f"{'on' if choice.gradient_checkpointing else 'off'} ({choice.how_gc})")]
    if choice.trial_peak is not None:
        rows.append(("trial step", f"peak {choice.trial_peak / GIB:.2f} GiB allocated at micro-batch "
                                   f"{choice.micro_batch}"))
    return rows
