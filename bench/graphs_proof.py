"""CUDA graphs (`cuda_graphs: true`) proven on a GPU: the same curve as without them, a resume that
continues it, and an out-of-memory error that drops them and carries on.

Four runs of one config (Qwen2.5-3B QLoRA, bf16, packed, LoRA dropout 0.05 so the replays' dropout
masks matter, gradient checkpointing, torch_compile on), on data with a learnable pattern:
  off       cuda_graphs: false, the reference curve
  on        cuda_graphs: true
  resume    cuda_graphs: true, sent SIGTERM mid-run (relaytune saves and exits 75), then resumed to the end
  oom       cuda_graphs: true, an OOM injected (RELAYTUNE_OOM_AT) once the graphs are recorded: the
            layers drop their graphs, the step is redone at the same micro-batch (at half where the GPU
            has no graphs to drop), the run goes on
Printed: the loss curves every 10 steps, the largest difference of `on` against `off`, of `resume`
against `on` after the stop and of `oom` against `on`, each run's median tokens/s after step 5 and
peak memory, and whether each run's log says the graphs were (or were not) on, and dropped.

    python bench/graphs_proof.py --steps 40            # H200: 55-80 s per run (five runs, 5 min in all)
    python bench/graphs_proof.py --phase on            # one phase at a time (each writes WORK/graphs/<phase>.json)
    python bench/graphs_proof.py --phase report        # combine what the phases wrote
    python bench/graphs_proof.py --arch tiny --steps 30  # CPU smoke test of this script (no graphs there)
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from fp16_proof import agree, curve, records, session  # noqa: E402
from gpu_bench import WORK, build_model, pattern_data  # noqa: E402

OUT = WORK / "graphs"
PHASES = ("off", "on", "resume", "oom")
TOLERANCE = (1e-2, 1e-4)  # relative, absolute: GPU kernels are not bit-exact from run to run
GRAPHS_ON = "CUDA graphs"  # what the speed-ups line says when the layers replay graphs
GRAPHS_DROPPED = "out of memory with CUDA graphs on: the layers run without them"  # recovery's warning


def config(args, name: str) -> dict:
    model = build_model(args.arch)
    data = pattern_data(args.batch * (args.steps + 2), args.seq)
    cfg = dict(model=str(model), dataset=str(data), output_dir=str(OUT / "runs" / name), max_steps=args.steps,
               per_device_train_batch_size=args.batch, gradient_accumulation_steps=1, max_seq_length=args.seq,
               logging_steps=1, save_steps=10, save_total_limit=None, save_every_seconds=0, learning_rate=2e-4,
               lora_r=16, lora_alpha=32, lora_dropout=0.05, gradient_checkpointing=True, packing=True, seed=7,
               cuda_graphs=name != "off")
    if args.arch != "tiny":
        cfg.update(load_in_4bit=True, bf16=True, torch_compile=True)
    return cfg


def run_phase(args, phase: str) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    cfg = config(args, phase)
    run = Path(cfg["output_dir"])
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir(parents=True)
    log = run.parent / f"{phase}.log"
    log.unlink(missing_ok=True)
    t0 = time.time()
    result: dict = {"phase": phase}
    if phase == "resume":
        stop_at = args.stop_at or args.steps // 2 + 3  # not on a checkpoint step: the stop writes its own
        result["first_exit"] = session(cfg, args, stop_at, log=log)
        steps = [int(p.name[5:]) for p in (run / "checkpoints").glob("step-*")]
        result["stopped_at"] = max(steps) if steps else None
        result["second_exit"] = session(cfg, args, log=log)
    elif phase == "oom":
        result["oom_at"] = oom_at = args.stop_at or args.steps // 2 + 3  # 1-based; graphs record in step 3
        result["exit"] = session(cfg, args, log=log, env_extra={"RELAYTUNE_OOM_AT": f"{oom_at - 1}:0"})
    else:
        result["exit"] = session(cfg, args, log=log)
    everything = records(run / "metrics.jsonl")
    result["oom_events"] = [r for r in everything if r.get("event") == "oom"]
    rows = [r for r in everything if "loss" in r and "event" not in r]
    speeds = [r["tokens_per_second"] for r in rows if r["step"] > 5 and r.get("tokens_per_second")]
    text = log.read_text(errors="replace")
    result.update(seconds=round(time.time() - t0, 1), curve=curve(run),
                  median_tokens_per_second=statistics.median(speeds) if speeds else None,
                  peak_memory_gib=max((r.get("peak_memory_gib", 0) for r in rows), default=None),
                  graphs_on=GRAPHS_ON in text, graphs_dropped=GRAPHS_DROPPED in text,
                  speedups=[ln for ln in text.splitlines() if "speed-ups:" in ln][-1:],
                  errors=[ln for ln in text.splitlines() if "Error" in ln or "Traceback" in ln][:5])
    (OUT / f"{phase}.json").write_text(json.dumps(result))
    print(f"# {phase}: {result['seconds']}s", file=sys.stderr)


def compare(a: dict[int, float], b: dict[int, float], after: int = 0) -> dict:
    steps = [s for s in a if s in b and s > after]
    return {"steps_compared": len(steps),
            "max_rel_diff": max((abs(a[s] - b[s]) / abs(b[s]) for s in steps), default=None),
            "steps_outside_tolerance": [s for s in steps if not agree(a[s], b[s], TOLERANCE)]}


def report(args) -> int:
    got = {p: json.loads((OUT / f"{p}.json").read_text()) for p in PHASES if (OUT / f"{p}.json").exists()}
    curves = {p: {int(k): v for k, v in got.get(p, {}).get("curve", {}).items()} for p in PHASES}
    lines = [f"{'step':>5} " + " ".join(f"{p:>9}" for p in PHASES)]
    for s in sorted(set().union(*curves.values())):
        if s % 10 == 0 or s == 1:
            lines.append(f"{s:>5} " + " ".join(f"{curves[p].get(s, float('nan')):>9.4f}" for p in PHASES))
    print("\n".join(lines))
    expect_graphs = args.arch != "tiny"  # the CPU has no CUDA graphs: there the script proves only itself
    summary: dict = {"tolerance_rel_abs": TOLERANCE, "runs": {
        p: {k: r.get(k) for k in ("exit", "first_exit", "second_exit", "stopped_at", "oom_at", "oom_events",
                                  "median_tokens_per_second", "peak_memory_gib", "graphs_on", "graphs_dropped",
                                  "speedups", "errors", "seconds")}
        for p, r in got.items()}}
    ok = True
    if "on" in got and "off" in got:
        summary["on_vs_off"] = compare(curves["on"], curves["off"])
        ok &= _close(summary["on_vs_off"]) and got["on"]["exit"] == 0 and got["off"]["exit"] == 0
        ok &= got["on"]["graphs_on"] == expect_graphs and not got["off"]["graphs_on"]
    if "resume" in got and "on" in got:
        r = got["resume"]
        stop = r.get("stopped_at") or 0
        summary["resume_vs_on_after_stop"] = compare(curves["resume"], curves["on"], after=stop)
        ok &= r["first_exit"] == 75 and r["second_exit"] == 0 and stop > 0 and r["graphs_on"] == expect_graphs
        ok &= _close(summary["resume_vs_on_after_stop"])
    if "oom" in got and "on" in got:
        summary["oom_vs_on"] = compare(curves["oom"], curves["on"])
        ok &= _oom_recovered(got["oom"], expect_graphs) and _close(summary["oom_vs_on"])
    missing = [p for p in PHASES if p not in got]
    if missing:
        summary["missing_phases"] = missing
    summary["verdict"] = "INCOMPLETE" if missing else "PASS" if ok else "FAIL"
    print(json.dumps(summary, indent=1))
    return 0 if ok and not missing else 1


def _close(comparison: dict) -> bool:
    return comparison["steps_compared"] > 0 and not comparison["steps_outside_tolerance"]


def _oom_recovered(run: dict, expect_graphs: bool) -> bool:
    """The run finished, its graphs were on and then dropped (where the GPU has them), and exactly the
    injected step (0-based in metrics.jsonl) was redone: at the same micro-batch once the graphs were
    given up, at half without graphs to give up."""
    factor = 1 if expect_graphs else 2
    redone = [(e.get("step"), factor * e.get("micro_batch_size", 0) == e.get("was"))
              for e in run.get("oom_events", [])]
    return (run["exit"] == 0 and run["graphs_on"] == expect_graphs and run.get("graphs_dropped") == expect_graphs
            and redone == [(run.get("oom_at", 0) - 1, True)])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--phase", default="all", choices=["all", *PHASES, "report"])
    p.add_argument("--arch", default="qwen2.5-3b", choices=["qwen2.5-3b", "tiny"])
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--stop-at", type=int, default=None, help="SIGTERM after this step (default: steps/2 + 3)")
    p.add_argument("--cap-gib", type=float, default=14.5, help="the children's GPU memory cap")
    args = p.parse_args()
    if args.arch == "tiny" and args.seq == 512:
        args.seq = 64
    for phase in PHASES if args.phase == "all" else [args.phase] if args.phase != "report" else []:
        run_phase(args, phase)
    sys.exit(report(args))


if __name__ == "__main__":
    main()
