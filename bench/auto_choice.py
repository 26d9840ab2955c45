"""`per_device_train_batch_size: auto` + `gradient_checkpointing: auto` against the hand-set defaults
(micro-batch 4, checkpointing on), under a 14.5 GiB cap (a T4's share) on an H200.

For Qwen2.5-3B QLoRA and Llama-3-8B QLoRA at seq 2048, global batch 16, ~10 steps each: the chosen
micro-batch and checkpointing (from trainer_state.json "auto_choice" and "recovery"), tokens/s (median after
warm-up) and peak allocated memory, one JSON line per case and a table at the end. Each case runs in its
own process, so the cap and the peak are its own.

    python bench/auto_choice.py                                   # both models (~4 runs, ~8-10 min)
    python bench/auto_choice.py --arch qwen2.5-3b                 # one model (~3 min)
    python bench/auto_choice.py --arch tiny --steps 4             # CPU smoke test of this script
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))
from gpu_bench import WORK, build_model, long_text_data, run  # noqa: E402

MODES = {
    "auto": dict(per_device_train_batch_size="auto", gradient_checkpointing="auto"),
    "hand": dict(per_device_train_batch_size=4, gradient_checkpointing=True),
}


def case(args) -> None:
    import torch

    seq = args.seq if args.arch != "tiny" else 128
    model = build_model(args.arch)  # before the cap: building the random weights on the GPU is not training
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(args.cap_gib * 2**30 / total)
    data = long_text_data(args.global_batch * (args.steps + 2), seq)
    quant = {} if args.arch == "tiny" else dict(load_in_4bit=True, optim="paged_adamw_8bit")
    name = f"auto-choice-{args.arch}-{args.mode}"
    result = run(name, model, data, max_steps=args.steps, global_batch_size=args.global_batch,
                 max_seq_length=seq, save_steps=max(1, args.steps // 2), save_total_limit=None,
                 **MODES[args.mode], **quant)
    # the newest checkpoint's trainer_state.json (save_steps < steps, so one is committed mid-run)
    states = sorted((WORK / "runs" / name).rglob("trainer_state.json"), key=lambda p: p.stat().st_mtime)
    state = json.loads(states[-1].read_text())
    result.update(arch=args.arch, mode=args.mode, seq=seq, cap_gib=args.cap_gib,
                  chosen=state.get("auto_choice"), micro_batch_in_force=state["recovery"]["micro_batch_size"],
                  accumulation=state["recovery"]["accumulation"])
    print("RESULT " + json.dumps(result), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="all", choices=["all", "qwen2.5-3b", "llama-3-8b", "tiny"])
    p.add_argument("--mode", default="both", choices=["both", "auto", "hand"])
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--cap-gib", type=float, default=14.5)
    p.add_argument("--case", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.case:
        return case(args)
    archs = ["qwen2.5-3b", "llama-3-8b"] if args.arch == "all" else [args.arch]
    modes = ["auto", "hand"] if args.mode == "both" else [args.mode]
    rows = []
    for arch in archs:
        for mode in modes:
            cmd = [sys.executable, __file__, "--case", "--arch", arch, "--mode", mode, "--seq", str(args.seq),
                   "--steps", str(args.steps), "--global-batch", str(args.global_batch), "--cap-gib", str(args.cap_gib)]
            r = subprocess.run(cmd, capture_output=True, text=True)
            line = next((x[7:] for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
            if r.returncode or line is None:
                print(json.dumps({"arch": arch, "mode": mode, "returncode": r.returncode,
                                  "stderr_tail": r.stderr[-1500:]}))
                continue
            print(line)
            pre = [x for x in r.stderr.splitlines() if x.strip().startswith(("micro-batch", "checkpointing", "memory",
                                                                             "trial step"))]
            print("\n".join("# " + x.strip() for x in pre), file=sys.stderr)
            rows.append(json.loads(line))
    print(f"\n{'model':<12}{'mode':<6}{'micro-batch':>12}{'checkpointing':>15}{'tokens/s':>10}{'peak GiB':>10}")
    for x in rows:
        chosen = x.get("chosen") or {}
        print(f"{x['arch']:<12}{x['mode']:<6}{x['micro_batch_in_force']:>6} x {x['accumulation']:<3}"
              f"{'on' if chosen.get('gradient_checkpointing') else 'off':>15}{x['tokens_per_second_median']:>10.0f}"
              f"{(x['peak_memory_gib'] or 0):>10.2f}")


if __name__ == "__main__":
    main()
