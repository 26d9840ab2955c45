"""The T4 path, proven on an H200: Qwen2.5-3B QLoRA in fp16 with a gradient scaler under a 14.5 GiB cap.

Four runs of the same config on data with a learnable pattern (a cycle of words, so the loss falls):
  bf16      the reference curve
  fp16      fp16: true, the T4's precision (a GradScaler)
  resume    fp16 again, sent SIGTERM mid-run (relaytune saves and exits 75), then resumed to the end
Printed: both loss curves side by side every 10 steps, the largest relative fp16/bf16 difference after step 20,
the scaler skips (metrics.jsonl events {"event": "scaler_skip", "scale": ...}), and whether the resumed run
continues the uninterrupted fp16 curve with the scaler's state (scale, growth tracker) restored: the
resumed run's checkpoints after the stop hold the same scaler state as the uninterrupted run's at the same steps.

    python bench/fp16_proof.py                        # H200: ~2-3 min per run at seq 512, micro-batch 4
    python bench/fp16_proof.py --phase bf16           # one phase at a time (each writes WORK/fp16/<phase>.json)
    python bench/fp16_proof.py --phase report         # combine what the phases wrote
    python bench/fp16_proof.py --arch tiny --steps 40 # CPU smoke test of this script (fp32 on the CPU: no scaler)
    python bench/fp16_proof.py --low-memory --steps 60  # the same with what `relaytune plan` offers a T4 when
                                                        # nothing fits (LOW_MEMORY below); its own folder and report
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))
from gpu_bench import WORK, build_model, pattern_data  # noqa: E402

from relaytune.observe.metrics import parse_records  # noqa: E402

OUT = WORK / "fp16"
# The settings `relaytune plan` proposes when nothing fits, which a T4 runs in fp16.
LOW_MEMORY = {"offload_activations": True, "liger_kernels": ["swiglu"]}
# Two curves agree at a step when |a - b| <= rel x |b| + abs. The absolute floor matters once the pattern
# is learned: at a loss of 2e-4 a difference of 1e-4 is rounding, not divergence.
TOLERANCE = (0.05, 2e-3)  # fp16 vs bf16 after step 20 (the two formats round differently)
RESUME_TOLERANCE = (1e-2, 1e-4)  # the resumed fp16 curve vs the uninterrupted one (GPU kernels are not bit-exact)


def agree(a: float, b: float, tolerance: tuple[float, float]) -> bool:
    rel, floor = tolerance
    return abs(a - b) <= rel * abs(b) + floor


def config(args, name: str, precision: str) -> dict:
    model = build_model(args.arch)
    seq = args.seq
    data = pattern_data(args.batch * (args.steps + 2), seq)
    cfg = dict(model=str(model), dataset=str(data), output_dir=str(out_dir(args) / "runs" / name), max_steps=args.steps,
               per_device_train_batch_size=args.batch, gradient_accumulation_steps=1, max_seq_length=seq,
               logging_steps=1, save_steps=10, save_total_limit=None, save_every_seconds=0, learning_rate=2e-4,
               lora_r=16, lora_alpha=32, lora_dropout=0.0, gradient_checkpointing=True, seed=7)
    if args.arch != "tiny":
        cfg.update(load_in_4bit=True, optim="paged_adamw_8bit")
    cfg.update({"fp16": True, "bf16": False} if precision == "fp16" else {"bf16": True, "fp16": False})
    if args.low_memory:
        cfg.update(LOW_MEMORY)
    return cfg


def child(args) -> None:
    """One training session in this process, under the memory cap (the SIGTERM target)."""
    import torch

    import relaytune
    from relaytune.errors import StoppedEarly

    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(args.cap_gib * 2**30 / total)
    try:
        relaytune.train(json.loads(args.cfg))
    except StoppedEarly as e:
        print(f"stopped: {e}", file=sys.stderr)
        sys.exit(75)


def session(cfg: dict, args, stop_at: int | None = None, log: Path | None = None,
            env_extra: dict[str, str] | None = None) -> int:
    """One training session in a child process (SIGTERM after `stop_at`); its stderr appended to `log`;
    `env_extra` adds to its environment (a fault plan, say)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env_extra or {})}
    if args.arch == "tiny" and stop_at is not None:
        env["RELAYTUNE_SLOW_STEP"] = "0.2"  # so the signal lands mid-run on a tiny model
    cmd = [sys.executable, __file__, "_child", "--cap-gib", str(args.cap_gib), "--cfg", json.dumps(cfg)]
    stderr = open(log, "a") if log else None  # noqa: SIM115  (closed below, after the child exits)
    try:
        return _wait(subprocess.Popen(cmd, env=env, stderr=stderr), cfg, stop_at)
    finally:
        if stderr:
            stderr.close()


def _wait(proc: subprocess.Popen, cfg: dict, stop_at: int | None) -> int:
    if stop_at is not None:
        metrics = Path(cfg["output_dir"]) / "metrics.jsonl"
        while proc.poll() is None:
            if any(r.get("step", 0) >= stop_at and "loss" in r for r in records(metrics)):
                proc.send_signal(signal.SIGTERM)
                print(f"# SIGTERM sent after step {stop_at}", file=sys.stderr)
                break
            time.sleep(0.2)
    return proc.wait()


def records(metrics: Path) -> list[dict]:
    return parse_records(metrics.read_text()) if metrics.exists() else []  # a torn last line is being written


def curve(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(run / "metrics.jsonl") if "loss" in r and "event" not in r}


def scaler_states(run: Path) -> dict[int, dict | None]:
    out = {}
    for ckpt in sorted((run / "checkpoints").glob("step-*")):
        state = json.loads((ckpt / "trainer_state.json").read_text())
        s = state.get("scaler")
        out[int(ckpt.name[5:])] = None if s is None else {"scale": s.get("scale"),
                                                          "growth_tracker": s.get("_growth_tracker")}
    return out


def run_phase(args, phase: str) -> None:
    out = out_dir(args)
    out.mkdir(parents=True, exist_ok=True)
    precision = "bf16" if phase == "bf16" else "fp16"
    cfg = config(args, phase, precision)
    shutil.rmtree(cfg["output_dir"], ignore_errors=True)
    t0 = time.time()
    result: dict = {"phase": phase}
    if phase == "resume":
        stop_at = args.stop_at or args.steps // 2 + 3  # not on a checkpoint step: the stop writes its own
        first = session(cfg, args, stop_at)
        ckpts = scaler_states(Path(cfg["output_dir"]))
        result.update(first_exit=first, stopped_at=max(ckpts) if ckpts else None,
                      scaler_at_stop=ckpts.get(max(ckpts)) if ckpts else None)
        result["second_exit"] = session(cfg, args)
    else:
        result["exit"] = session(cfg, args)
    run = Path(cfg["output_dir"])
    events = [r for r in records(run / "metrics.jsonl") if r.get("event") not in (None, "checkpoint")]
    result.update(seconds=round(time.time() - t0, 1), curve=curve(run), scalers=scaler_states(run),
                  scaler_skips=[e for e in events if e["event"] == "scaler_skip"],
                  other_events=[e for e in events if e["event"] != "scaler_skip"])
    (out / f"{phase}.json").write_text(json.dumps(result))
    print(f"# {phase}: {result['seconds']}s", file=sys.stderr)


def out_dir(args) -> Path:
    return OUT.with_name("fp16-low-memory") if args.low_memory else OUT


def report(args) -> int:
    out = out_dir(args)
    got = {p: json.loads((out / f"{p}.json").read_text()) for p in ("bf16", "fp16", "resume")
           if (out / f"{p}.json").exists()}
    bf16 = {int(k): v for k, v in got.get("bf16", {}).get("curve", {}).items()}
    fp16 = {int(k): v for k, v in got.get("fp16", {}).get("curve", {}).items()}
    res = {int(k): v for k, v in got.get("resume", {}).get("curve", {}).items()}
    lines = [f"{'step':>5} {'bf16':>9} {'fp16':>9} {'fp16 resumed':>13}"]
    for s in sorted(set(bf16) | set(fp16)):
        if s % 10 == 0 or s == 1:
            lines.append(f"{s:>5} {bf16.get(s, float('nan')):>9.4f} {fp16.get(s, float('nan')):>9.4f} "
                         f"{res.get(s, float('nan')):>13.4f}")
    print("\n".join(lines))
    ok = True
    summary: dict = {}
    common = [s for s in bf16 if s in fp16 and s > 20]
    if common:
        rel = max(abs(fp16[s] - bf16[s]) / abs(bf16[s]) for s in common)
        summary["max_rel_diff_fp16_vs_bf16_after_step_20"] = round(rel, 5)
        summary["max_abs_diff_fp16_vs_bf16_after_step_20"] = round(max(abs(fp16[s] - bf16[s]) for s in common), 6)
        summary["tolerance_rel_abs"] = TOLERANCE
        summary["steps_outside_tolerance"] = [s for s in common if not agree(fp16[s], bf16[s], TOLERANCE)]
        ok &= not summary["steps_outside_tolerance"]
        summary["loss_first_last_fp16"] = (fp16[min(fp16)], fp16[max(fp16)])
    if "fp16" in got:
        skips = got["fp16"]["scaler_skips"]
        summary["fp16_scaler_skips"] = {"count": len(skips), "steps": [e["step"] for e in skips][:20],
                                        "of_steps": len(fp16)}
        summary["fp16_other_events"] = got["fp16"]["other_events"]
    if "resume" in got:
        r = got["resume"]
        stop = r.get("stopped_at") or 0
        after = [s for s in res if s > stop and s in fp16]
        diff = max((abs(res[s] - fp16[s]) / abs(fp16[s]) for s in after), default=None)
        outside = [s for s in after if not agree(res[s], fp16[s], RESUME_TOLERANCE)]
        same_scaler = {s: (st, got["fp16"]["scalers"].get(str(s)) if "fp16" in got else None)
                       for s, st in ((int(k), v) for k, v in r["scalers"].items()) if s > stop}
        restored = all(a == b for a, b in same_scaler.values()) if same_scaler else None
        summary["resume"] = {"first_exit": r["first_exit"], "second_exit": r["second_exit"], "stopped_at": stop,
                             "scaler_at_stop": r["scaler_at_stop"], "max_rel_diff_after_stop": diff,
                             "max_abs_diff_after_stop": max((abs(res[s] - fp16[s]) for s in after), default=None),
                             "tolerance_rel_abs": RESUME_TOLERANCE, "steps_outside_tolerance": outside,
                             "scaler_state_equal_to_uninterrupted_after_stop": restored,
                             "checkpoints_compared": sorted(same_scaler)}
        ok &= r["first_exit"] == 75 and r["second_exit"] == 0 and stop > 0
        ok &= bool(after) and not outside
        if r["scaler_at_stop"] is not None:  # a GPU run: fp16 with a scaler
            ok &= bool(restored)
    missing = [phase for phase in ("bf16", "fp16", "resume") if phase not in got]
    if missing:  # a phase that never ran (or was cut off) proves nothing, so the whole proof is not a pass
        summary["missing_phases"] = missing
    summary["verdict"] = "INCOMPLETE" if missing else "PASS" if ok else "FAIL"
    print(json.dumps(summary, indent=1))
    if args.arch != "tiny" and len(got) == 3:
        results = HERE / "results"
        results.mkdir(exist_ok=True)
        name, title, flag = ("fp16-proof-low-memory.md", f", with {json.dumps(LOW_MEMORY)}", " --low-memory") \
            if args.low_memory else ("fp16-proof.md", "", "")
        import torch

        (results / name).write_text(
            f"# fp16 (T4 path) vs bf16, Qwen2.5-3B QLoRA under a 14.5 GiB cap{title}\n\n"
            f"On {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'the CPU'}, "
            f"torch {torch.__version__}.\n\n"
            f"`python bench/fp16_proof.py{flag} --seq {args.seq} --steps {args.steps}`\n\n```\n" + "\n".join(lines)
            + "\n```\n\n```json\n" + json.dumps(summary, indent=1) + "\n```\n")
    return 0 if ok and not missing else 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("phase", nargs="?", default="all", choices=["all", "bf16", "fp16", "resume", "report", "_child"])
    p.add_argument("--phase", dest="phase_opt", choices=["bf16", "fp16", "resume", "report"])
    p.add_argument("--arch", default="qwen2.5-3b", choices=["qwen2.5-3b", "tiny"])
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--stop-at", type=int, default=None, help="SIGTERM after this step (default: steps/2 + 3)")
    p.add_argument("--cap-gib", type=float, default=14.5)
    p.add_argument("--low-memory", action="store_true",
                   help=f"add {json.dumps(LOW_MEMORY)} to every run (its own folder and results file)")
    p.add_argument("--cfg", help=argparse.SUPPRESS)
    args = p.parse_args()
    phase = args.phase_opt or args.phase
    if phase == "_child":
        return child(args)
    if args.arch == "tiny" and args.seq == 512:
        args.seq = 64
    for ph in (["bf16", "fp16", "resume"] if phase == "all" else [phase] if phase != "report" else []):
        run_phase(args, ph)
    sys.exit(report(args))


if __name__ == "__main__":
    main()
