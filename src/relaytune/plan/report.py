"""The text `relaytune plan` prints: memory parts, verdict, micro-batch, checkpointing, disk, speed and ETA."""

from __future__ import annotations

import math

from relaytune.plan.advice import FITS, GC_OFF_MARGIN, MARGIN, NO_FIT
from relaytune.plan.memory import GIB, MemoryEstimate
from relaytune.plan.planner import Plan

WIDTH = 24  # label column of the memory table


def gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def format_plan(plan: Plan) -> str:
    sections = [_header(plan), _memory(plan.memory, plan), _verdict(plan), _disk_and_time(plan)]
    if plan.notes:
        sections.append("notes\n" + "\n".join(f"  - {n}" for n in plan.notes))
    return "\n\n".join(sections) + "\n"


def _header(plan: Plan) -> str:
    s, a, g = plan.settings, plan.arch, plan.gpu
    quant = {"none": "LoRA", "int8": "LoRA on an 8-bit base", "fp4": "QLoRA (FP4)",
             "nf4": f"QLoRA (NF4{', double quant' if s.double_quant else ''})"}[s.quantization]
    targets = s.lora_target_modules if isinstance(s.lora_target_modules, str) else ", ".join(s.lora_target_modules)
    gc = "on" if plan.gradient_checkpointing else "off"
    card = f"{g.memory_gib:g} GiB, " + ("bf16" if g.bf16 else "no bf16: fp16 with a gradient scaler") + \
        (f"; {g.note}" if g.note else "")
    return "\n".join([
        f"relaytune plan: {a.name or a.model_type} on {g.name} ({card})",
        f"  model     {a.describe()}",
        f"            values from {a.source}",
        f"  training  {quant}, r {s.lora_r} on {targets}, {s.optim}, {s.compute_dtype}, gradient checkpointing {gc}",
        f"  batch     micro-batch {plan.micro_batch} x {plan.accumulation} accumulation = global batch "
        f"{plan.global_batch} rows of up to {s.max_seq_length} tokens"])


def _memory(m: MemoryEstimate, plan: Plan) -> str:
    rows = [f"peak memory at micro-batch {m.micro_batch} (reached in the {m.peak_phase})"]
    for name, n in m.parts.items():
        rows.append(f"  {name.ljust(WIDTH)}{gib(n):>11}  {m.details.get(name, '')}")
    rows.append(f"  {'= allocated'.ljust(WIDTH)}{gib(m.total_allocated):>11}  torch.cuda.max_memory_allocated()")
    rows.append(f"  {'+ allocator slack'.ljust(WIDTH)}{gib(m.slack):>11}  reserved but not in use")
    rows.append(f"  {'+ CUDA context'.ljust(WIDTH)}{gib(m.cuda_context):>11}  outside torch's count")
    if m.paged:
        rows.append(f"  {'+ paged optimizer state'.ljust(WIDTH)}{gib(m.paged):>11}  CUDA unified memory")
    rows.append(f"  {'= on the card'.ljust(WIDTH)}{gib(m.total_reserved):>11}  nvidia-smi; the card has "
                f"{plan.gpu.memory_gib:g} GiB")
    if m.off_peak:
        other = ", ".join(f"{k} {gib(v)}" for k, v in m.off_peak.items())
        rows.append(f"  not at the same moment: {other}")
    return "\n".join(rows)


def _verdict(plan: Plan) -> str:
    m, g = plan.memory, plan.gpu
    head = {FITS: f"verdict: FITS: {gib(m.total_reserved)} of {g.memory_gib:g} GiB, with {MARGIN:.0%} of the "
                  "card kept free",
            NO_FIT: f"verdict: DOES NOT FIT: {gib(m.total_reserved)} needed, {g.memory_gib:g} GiB on the card"}
    lines = [head.get(plan.status, f"verdict: TIGHT: {gib(m.total_reserved)} of {g.memory_gib:g} GiB, inside the "
                                   f"{MARGIN:.0%} margin; it may run out of memory (relaytune then halves the "
                                   "micro-batch and redoes the step)")]
    lines += _micro_batch_lines(plan)
    lines += _checkpointing_lines(plan)
    if plan.changes:
        lines.append("  what would help (predicted peak at micro-batch 1, on the card):")
        for c in plan.changes:
            lines.append(f"    - {c.what}: {gib(c.estimate.total_reserved)} ({c.status})")
    return "\n".join(lines)


def _micro_batch_lines(plan: Plan) -> list[str]:
    best, global_batch = plan.best_micro_batch, plan.global_batch
    if plan.best_any is None:
        return ["  nothing fits, not even micro-batch 1 "
                f"({gib(_at_one(plan))} on the card)"]
    lines = []
    if best is None:
        lines.append(f"  no micro-batch that divides the global batch {global_batch} fits")
    elif best == plan.micro_batch:
        lines.append(f"  micro-batch {best} is the largest that fits at global batch {global_batch}")
    else:
        faster = " (faster)" if best > plan.micro_batch else ""
        lines.append(f"  largest micro-batch that fits at global batch {global_batch}: {best}{faster}: "
                     f"per_device_train_batch_size: {best}, gradient_accumulation_steps: {global_batch // best} "
                     f"({gib(plan.best_memory.total_reserved)} on the card; same global batch, same maths)")
    if plan.offload_best and plan.offload_best > (best or 0):
        lines.append(f"  with offload_activations: true, micro-batch {plan.offload_best} fits (each layer's input "
                     "waits in pinned CPU memory for backward: PCIe traffic every step)")
    # Fewer micro-batches per step are possible when the largest that fits does not divide the global batch:
    # relaytune then cuts each step into unequal ones (the loss is normalised over the global batch).
    steps_any = math.ceil(global_batch / plan.best_any)
    if steps_any < (global_batch // best if best else global_batch + 1):
        even = math.ceil(global_batch / steps_any)
        lines.append(f"  {steps_any} micro-batches of up to {even} rows fit too (per_device_train_batch_size: {even}; "
                     f"it does not divide {global_batch}, so the last one is smaller; same maths)")
    return lines


def _at_one(plan: Plan) -> int:
    from relaytune.plan.memory import estimate_memory

    return estimate_memory(plan.arch, plan.settings, 1, plan.gradient_checkpointing).total_reserved


def _checkpointing_lines(plan: Plan) -> list[str]:
    off = plan.gc_off
    if off is None:
        return []
    speed = ""
    if plan.gc_off_throughput and plan.gc_off_throughput.tokens_per_second and plan.throughput.tokens_per_second:
        gain = plan.gc_off_throughput.tokens_per_second / plan.throughput.tokens_per_second - 1
        speed = f"; about {gain:.0%} more tokens/s"
    need = gib(off.estimate.total_reserved)
    if off.status == FITS:
        return [f"  gradient checkpointing could be off at micro-batch {plan.micro_batch}: {need} on the card, "
                f"with {GC_OFF_MARGIN:.0%} kept free{speed}"]
    if off.largest_micro_batch:
        return [f"  gradient checkpointing off fits only up to micro-batch {off.largest_micro_batch} "
                f"(at {plan.micro_batch} it needs {need}){speed}"]
    return [f"  gradient checkpointing must stay on: off needs {need} at micro-batch {plan.micro_batch}"]


def _disk_and_time(plan: Plan) -> str:
    lines = [f"checkpoints  about {plan.checkpoint_bytes / 2**20:.1f} MiB each; {plan.checkpoints_kept} on disk at "
             f"once + the final adapter = {plan.disk_bytes / 2**20:.0f} MiB of disk"]
    t = plan.throughput
    if t.tokens_per_second:
        lines.append(f"speed        about {t.tokens_per_second:,.0f} tokens/s ({t.basis})")
    else:
        lines.append(f"speed        not estimated: {t.basis}")
    if plan.tokens is None:
        lines.append(f"time         not estimated: {plan.tokens_note}")
    else:
        lines.append(f"time         {_count(plan.tokens)} tokens ({plan.tokens_note})")
        if plan.eta:
            lines.append(f"             about {_duration(plan.eta.hours)}: {plan.eta.describe()}")
    return "\n".join(lines)


def _count(n: float) -> str:
    return f"{n / 1e9:,.2f} G" if n >= 1e9 else f"{n / 1e6:,.1f} M" if n >= 1e6 else f"{n:,.0f}"


def _duration(hours: float) -> str:
    return f"{hours:,.1f} h" if hours >= 1 else f"{max(1, round(hours * 60))} min"
