"""Where the time of a relaytune training step goes: torch.profiler over the timed steps of one run.

Short steps run far below the GPU's arithmetic: Qwen2.5-3B QLoRA at seq 512, packed, ran at 12% MFU
on an H200 and lost 40% of its tokens/s under cProfile (bench/results/vs-trl-h200.md), which says the
host bounds it, but not where. This runs relaytune in-process with exactly the config of
bench/vs_trl.py's relaytune worker, profiles the optimizer steps after --warmup, and prints:
  - the wall seconds of each profiled step (synchronised at the end of each optimizer step);
  - GPU busy: the summed duration of the GPU's kernels and copies in those steps over their wall
    time (well below 1, the GPU waits for the host; copies on a side stream overlapping kernels
    count twice);
  - the ops with the most self CPU time, and those with the most self GPU time.
The profiler adds host time of its own, so its steps are slower than vs_trl.py's: read the
fractions and the rankings, not the tokens/s.

--gaps records the GPU alone (no host ops, no sync between steps), so the host runs close to its
unprofiled pace, and reports where the GPU waits instead of the op tables: its idle time per step
in bands of gap length, totalled by the kernel that ended each wait, and the longest gaps with the
work on either side (a wait that ends at an optimizer kernel is the step boundary; one that ends at
a compiled layer's first kernel is that call's host overhead).

--kernels lists every GPU kernel's time per step and the matmuls grouped by input shape (an adapter's
have a dimension of its rank, the head's the vocabulary), instead of the op tables.

    python bench/step_profile.py --arch qwen2.5-3b --quant 4bit --batch 4 --seq 512 --packing \\
        --out bench/results/step-profile-h200.md
    python bench/step_profile.py --arch llama-3-8b --quant 4bit --batch 2 --packing --steps 3 --gaps
    python bench/step_profile.py --arch llama-3-8b --quant 4bit --batch 2 --packing --steps 3 --kernels
    python bench/step_profile.py --arch tiny --seq 128 --steps 2 --warmup 1   # CPU smoke test
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import vs_trl  # noqa: E402  (puts src/ on sys.path; the model, data and config of the comparison)
from gpu_bench import WORK, build_model  # noqa: E402
from gpu_power import PowerSampler, describe  # noqa: E402
from vs_trl_workers import relaytune_config  # noqa: E402

ROWS = 15  # ops listed per table


class StepClock:
    """Steps the profiler and times each optimizer step, from the end of one to the end of the next."""

    def __init__(self, prof, sync: bool):
        self.prof, self.sync, self.ends = prof, sync, []

    def __call__(self, optimizer, args, kwargs) -> None:
        import torch

        if self.sync:
            torch.cuda.synchronize()
        self.ends.append(time.perf_counter())
        self.prof.step()


def device_work(prof) -> list:
    """The device-side events (kernels, copies) the profiler recorded, in order of their start; the
    GPU-side spans of annotations (ProfilerStep#n covers whole steps) are not work and are left out."""
    from torch.autograd import DeviceType

    def is_work(e) -> bool:
        return not getattr(e, "is_user_annotation", False) and not e.name.startswith("ProfilerStep")

    events = [e for e in prof.events() if e.device_type == DeviceType.CUDA and is_work(e)]
    return sorted(events, key=lambda e: e.time_range.start)


def gpu_seconds(prof) -> float | None:
    """Summed duration of the GPU's kernels and copies."""
    events = device_work(prof)
    return sum(e.time_range.elapsed_us() for e in events) / 1e6 if events else None


GAP_BANDS = ((0, 10), (10, 100), (100, 1000), (1000, float("inf")))  # microseconds


def gap_report(prof, steps: int) -> list[str]:
    """Where the GPU waits: every interval between the end of the work so far and the start of the
    next kernel or copy, in bands of length, and the longest ones with the work on either side."""
    events = device_work(prof)
    if len(events) < 2:
        return ["- gaps: the profiler recorded no GPU work"]
    gaps, reach = [], events[0].time_range.end
    for before, after in zip(events, events[1:]):
        if after.time_range.start > reach:
            gaps.append((after.time_range.start - reach, before.name, after.name))
        reach = max(reach, after.time_range.end)
    span = (reach - events[0].time_range.start) / 1e3
    idle = sum(g for g, _, _ in gaps) / 1e3
    lines = [f"- GPU timeline of the profiled steps: {span:.1f} ms from the first kernel to the last, "
             f"{idle:.1f} ms of it idle ({idle / span:.0%}), {idle / steps:.1f} ms idle per step", "",
             "| gap length | gaps per step | idle ms per step |", "|---|---|---|"]
    for low, high in GAP_BANDS:
        band = [g for g, _, _ in gaps if low <= g < high]
        label = f"{low}-{high} us" if high != float("inf") else f">= {low} us"
        lines.append(f"| {label} | {len(band) / steps:.0f} | {sum(band) / 1e3 / steps:.2f} |")
    by_next: dict[str, list[float]] = {}
    for g, _, after in gaps:
        by_next.setdefault(after[:70], []).append(g)
    lines += ["", "Idle before each kind of work (ms per step, gaps per step, the work that ended the wait):",
              "", "```"]
    for name, waits in sorted(by_next.items(), key=lambda kv: -sum(kv[1]))[:ROWS]:
        lines.append(f"{sum(waits) / 1e3 / steps:8.2f}  {len(waits) / steps:6.1f}  {name}")
    lines += ["```", "", "Longest gaps (us, the work before, the work after):", "", "```"]
    for g, before, after in sorted(gaps, reverse=True)[:ROWS]:
        lines.append(f"{g:9.0f}  {before[:55]:55}  {after[:55]}")
    return lines + ["```"]


def op_tables(prof, cuda: bool) -> list[str]:
    """The ops with the most self CPU time, and (on a GPU) those with the most self GPU time."""
    averages = prof.key_averages()
    lines = ["", "Most self CPU time:", "", "```",
             averages.table(sort_by="self_cpu_time_total", row_limit=ROWS, max_name_column_width=60), "```"]
    if cuda:
        lines += ["", "Most self GPU time:", "", "```",
                  averages.table(sort_by="self_device_time_total", row_limit=ROWS, max_name_column_width=60),
                  "```"]
    return lines


MATMULS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_mm")


def kernel_tables(prof, steps: int) -> list[str]:
    """Every GPU kernel by name (ms per step, calls per step), and the matmuls by their input shapes,
    so that the time of the frozen weights' matmuls, the adapters' and the head's can be told apart."""
    totals: dict[str, list[float]] = {}
    for e in device_work(prof):
        entry = totals.setdefault(e.name, [0.0, 0])
        entry[0] += e.time_range.elapsed_us()
        entry[1] += 1
    busy = sum(t for t, _ in totals.values())
    lines = ["", f"GPU kernels and copies ({busy / 1e3 / steps:.1f} ms per step; ms per step, share, calls per step):",
             "", "```"]
    for name, (us, calls) in sorted(totals.items(), key=lambda kv: -kv[1][0])[:4 * ROWS]:
        lines.append(f"{us / 1e3 / steps:8.2f}  {us / busy:6.1%}  {calls / steps:7.1f}  {name[:110]}")
    lines += ["```", "", "Matmuls by input shapes (ms of GPU time per step, calls per step, shapes):", "", "```"]
    shaped = [a for a in prof.key_averages(group_by_input_shape=True) if a.key in MATMULS]
    for a in sorted(shaped, key=lambda a: -a.self_device_time_total)[:3 * ROWS]:
        lines.append(f"{a.self_device_time_total / 1e3 / steps:8.2f}  {a.count / steps:7.1f}  {a.key} {a.input_shapes}")
    return lines + ["```"]


def report(args, clock: StepClock, prof, cuda: bool, device: str, gpu: dict | None = None) -> str:
    # The profiler records steps warmup+1 .. warmup+steps; step i's wall time is ends[i] - ends[i-1].
    walls = [b - a for a, b in zip(clock.ends[args.warmup - 1:], clock.ends[args.warmup:])][:args.steps]
    lines = [f"### relaytune step profile: {args.arch} {'QLoRA' if args.quant == '4bit' else 'LoRA'}, "
             f"seq {args.seq}, micro-batch {args.batch} x accum {args.accum}{', packed' if args.packing else ''}"
             f" ({device}, {time.strftime('%Y-%m-%d')})", "",
             f"- profiled steps: {len(walls)} (after {args.warmup}); wall seconds each: "
             + ", ".join(f"{w:.3f}" for w in walls)]
    busy = gpu_seconds(prof) if cuda else None
    if busy is not None and walls:
        lines.append(f"- GPU busy: {busy:.3f} s of kernels and copies in {sum(walls):.3f} s of wall time "
                     f"= {busy / sum(walls):.0%}")
    if gpu:
        lines.append(f"- GPU over the whole run (nvidia-smi, samples at >= 90% utilisation): {describe(gpu)}")
    if args.gaps:
        lines += gap_report(prof, args.steps) if cuda else ["- gaps: no GPU"]
    elif args.kernels:
        lines += kernel_tables(prof, args.steps) if cuda else ["- kernels: no GPU"]
    else:
        lines += op_tables(prof, cuda)
    if args.relaytune_set:
        lines.append("- relaytune settings: " + ", ".join(args.relaytune_set))
    if args.relaytune_liger:
        lines.append("- with Liger's kernels: " + ", ".join(args.relaytune_liger) + " (--relaytune-liger)")
    lines.append(f"- versions: {vs_trl.stack_versions()}")
    lines.append(f"<!-- command: python bench/step_profile.py {' '.join(sys.argv[1:])} -->")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    vs_trl.case_arguments(p)
    p.add_argument("--steps", type=int, default=4, help="profiled steps, after --warmup steps")
    p.add_argument("--warmup", type=int, default=3, help="steps before profiling (at least 1: the compile)")
    p.add_argument("--trace", help="also write the Chrome trace of the profiled steps here")
    p.add_argument("--out", help="append the report to this file")
    p.add_argument("--gaps", action="store_true",
                   help="record the GPU alone (the host runs at its unprofiled pace, no sync between steps) "
                        "and report where the GPU waits instead of the op tables")
    p.add_argument("--kernels", action="store_true",
                   help="report every GPU kernel's time per step and the matmuls by input shape (records "
                        "shapes) instead of the op tables")
    args = p.parse_args()
    if args.warmup < 1:
        p.error("--warmup must be at least 1 (the first step compiles)")

    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook
    from torch.profiler import ProfilerActivity, profile, schedule

    import relaytune

    cuda = torch.cuda.is_available()
    if not cuda and args.quant == "4bit":
        print("# no GPU: --quant 4bit needs one; profiling without quantization", file=sys.stderr)
        args.quant = "none"
    if args.arch == "tiny" and args.seq > 1024:
        args.seq = 128
    args.model, args.save_steps = str(build_model(args.arch)), 0
    args.data = str(vs_trl.data_for(args, args.batch))
    out = WORK / "step_profile" / f"{args.arch}-{args.quant}-s{args.seq}-b{args.batch}"
    shutil.rmtree(out, ignore_errors=True)
    cfg = relaytune_config(args, out)

    activities = ([] if args.gaps else [ProfilerActivity.CPU]) + ([ProfilerActivity.CUDA] if cuda else [])
    if not activities:  # --gaps on a CPU: nothing to record on a GPU, so record the host
        activities = [ProfilerActivity.CPU]
    # Profiler step i is training step i+1: wait out the first warmup-1, warm the profiler up on one.
    plan = schedule(wait=args.warmup - 1, warmup=1, active=args.steps, repeat=1)
    with PowerSampler() as power, profile(activities=activities, schedule=plan, record_shapes=args.kernels) as prof:
        clock = StepClock(prof, sync=cuda and not args.gaps)
        handle = register_optimizer_step_post_hook(clock)
        try:
            relaytune.train(cfg)
        finally:
            handle.remove()
    if args.trace:
        prof.export_chrome_trace(args.trace)
    text = report(args, clock, prof, cuda, torch.cuda.get_device_name(0) if cuda else "cpu", power.summary())
    vs_trl.publish(text, args.out)


if __name__ == "__main__":
    main()
