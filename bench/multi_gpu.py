"""Issue 11: the multi-GPU path on 2 GPUs (scaling, FSDP2, a killed rank, another GPU count, T4-like fp16).

Random-init models of real architectures (gpu_bench.py's ARCHS, plus qwen2.5-0.5b here for the runs whose
point is recovery, not speed). Every session is `relaytune.train` in a child process of this script
(`_child`): with num_gpus > 1 that child is relaytune's launcher and the workers are ITS children, so the
script can SIGTERM the launcher (exit 75) or SIGKILL one worker. Figures come from metrics.jsonl (rank 0's;
tokens_per_second counts the whole global batch), sessions.jsonl and checkpoints/*/trainer_state.json.
Each measurement prints one JSON line; `--out FILE` appends a Markdown section per measurement.

Scaling at the same micro-batch per GPU. relaytune's global batch is per_device_train_batch_size x
gradient_accumulation_steps WHATEVER the GPU count, each GPU taking a contiguous share of it. So both runs
use one and the same config, micro-batch B and accumulation 2 (global batch 2B), and differ only in
num_gpus: 1 GPU runs 2 micro-batches of B per step, each of 2 GPUs runs 1 micro-batch of B (its share, B
rows). Same micro-batch per GPU, same rows and maths per step, so global tokens/s compare directly and
scaling = tokens/s(2 GPUs) / tokens/s(1 GPU). (Keeping accumulation 1 on 2 GPUs would need global batch
2B there, i.e. a different config; this way the only change is the GPU count.) The 2-GPU step also pays
the one flat all-reduce of the LoRA gradients and the cross-rank agreement calls; 1 GPU pays none.

The 14.5 GiB cap (`t4`): relaytune has no memory-cap knob and its workers are spawned by torch's elastic
agent, so the cap cannot be set from here. The script writes a `sitecustomize.py` into a temp folder put on
PYTHONPATH with RELAYTUNE_BENCH_CAP_GIB; in a spawned worker it wraps torch.cuda.set_device so that, once
relaytune picks the worker's GPU, torch.cuda.set_per_process_memory_fraction(cap / total) applies to it.
A 1-GPU child sets the same fraction itself.

H200 x2 (nvidia-h200-x2), from the repository root:

    .venv/bin/python bench/multi_gpu.py all --out bench/results/multi-gpu.md   # everything, ~9 min
    .venv/bin/python bench/multi_gpu.py scaling      # Qwen2.5-3B QLoRA, seq 2048, micro-batch 4, accum 2
    .venv/bin/python bench/multi_gpu.py fsdp         # Llama-3-8B LoRA bf16 + QLoRA float storage (refused today)
    .venv/bin/python bench/multi_gpu.py killed-rank  # Qwen2.5-0.5B, SIGKILL a worker mid-run
    .venv/bin/python bench/multi_gpu.py gpu-count    # Qwen2.5-0.5B, 2 -> 1 -> 2 GPUs vs an uninterrupted 1 GPU
    .venv/bin/python bench/multi_gpu.py t4           # Qwen2.5-3B QLoRA fp16, 14.5 GiB cap, micro-batch auto

CPU smoke tests (gloo, 2 processes of the tiny model; each well under a minute):

    OMP_NUM_THREADS=1 .venv/bin/python bench/multi_gpu.py scaling --arch tiny
    OMP_NUM_THREADS=1 .venv/bin/python bench/multi_gpu.py killed-rank --arch tiny
    OMP_NUM_THREADS=1 .venv/bin/python bench/multi_gpu.py gpu-count --arch tiny
    OMP_NUM_THREADS=1 .venv/bin/python bench/multi_gpu.py fsdp --arch tiny
    OMP_NUM_THREADS=1 .venv/bin/python bench/multi_gpu.py t4 --arch tiny     # fp32 on the CPU: no scaler
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(SRC))
import gpu_bench  # noqa: E402
from gpu_bench import WORK, build_model, long_text_data, package_versions, pattern_data  # noqa: E402
from multi_gpu_sessions import (  # noqa: E402
    adapter_diff,
    child,
    cuda,
    curve,
    records,
    session,
    starts,
    throughput,
    trainer_states,
)

gpu_bench.ARCHS.setdefault("qwen2.5-0.5b", dict(
    model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
    num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6,
    max_position_embeddings=32768))
OUT = WORK / "multi"
DEFAULT_ARCH = {"scaling": "qwen2.5-3b", "fsdp": "llama-3-8b", "killed-rank": "qwen2.5-0.5b",
                "gpu-count": "qwen2.5-0.5b", "t4": "qwen2.5-3b"}
GPU_COUNT_RTOL = 2e-2  # 2 -> 1 -> 2 GPUs vs 1 GPU: same rows, same maths; GPU kernels round differently
SCALING_AIM = 1.9
# --- configs -------------------------------------------------------------------------------------

def config(args, name: str, data: Path, **kw) -> dict:
    out = OUT / "runs" / name
    shutil.rmtree(out, ignore_errors=True)
    cfg = dict(model=str(build_model(args.arch)), dataset=str(data), output_dir=str(out), logging_steps=1,
               save_every_seconds=0, save_total_limit=None, learning_rate=2e-4, lora_r=16, lora_alpha=32,
               lora_dropout=0.0, seed=7, gradient_checkpointing=args.arch != "tiny")
    if args.arch != "tiny" and args.case != "fsdp":
        cfg.update(load_in_4bit=True)
    if cuda() and not kw.get("fp16"):
        cfg.update(bf16=True)
    cfg.update(kw)
    return cfg


def seq_of(args, default: int) -> int:
    return args.seq or (64 if args.arch == "tiny" else default)


# --- the measurements ----------------------------------------------------------------------------

def scaling(args) -> dict:
    seq, batch = seq_of(args, 2048), args.batch or (4 if args.arch != "tiny" else 2)
    steps = args.steps or (12 if args.arch != "tiny" else 8)
    data = long_text_data(2 * batch * (steps + 2), seq)
    result: dict = {"case": "scaling", "arch": args.arch, "seq": seq, "micro_batch_per_gpu": batch,
                    "gradient_accumulation_steps": 2, "global_batch": 2 * batch, "steps": steps}
    for n in (1, 2):
        cfg = config(args, f"scaling-{n}", data, max_steps=steps, save_steps=10_000, num_gpus=n,
                     per_device_train_batch_size=batch, gradient_accumulation_steps=2, max_seq_length=seq)
        s = session(args, cfg)
        result[f"gpus_{n}"] = {**s, **throughput(Path(cfg["output_dir"]))}
    one, two = (result[f"gpus_{n}"]["tokens_per_second_median"] for n in (1, 2))
    result["scaling"] = round(two / one, 3) if one and two else None
    result["aim"] = SCALING_AIM
    result["meets_aim"] = bool(result["scaling"] and result["scaling"] >= SCALING_AIM)
    return result


def fsdp_refusal(cfg: dict) -> str | None:
    from relaytune.config.loader import load_config

    try:
        load_config(cfg)
    except Exception as e:  # noqa: BLE001 - UserError today; any refusal counts
        return str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
    return None


def fsdp(args) -> list[dict]:
    from relaytune.config.schema import TrainConfig

    seq, batch = seq_of(args, 2048), args.batch or (2 if args.arch != "tiny" else 2)
    steps = args.steps or (8 if args.arch != "tiny" else 6)
    variants = {"lora-bf16": {},
                "qlora-float-storage": {"load_in_4bit": True, "bnb_4bit_quant_storage": "bfloat16"}}
    out = []
    for name, extra in variants.items():
        result: dict = {"case": f"fsdp-{name}", "arch": args.arch, "seq": seq, "micro_batch_per_gpu": batch}
        missing = [k for k in extra if k not in TrainConfig.model_fields]
        probe = dict(model="unused", dataset="unused.jsonl", output_dir=str(OUT / "probe"), fsdp=True,
                     num_gpus=2, **{k: v for k, v in extra.items() if k not in missing})
        refused = fsdp_refusal(probe)
        if refused or missing:
            why = [refused.strip()] if refused else []
            why += [f"no config key {missing} in relaytune yet"] if missing else []
            result.update(runnable=False, reason="; ".join(why))
            print(f"# fsdp {name}: not runnable yet: {result['reason']}", file=sys.stderr)
            out.append(result)
            continue
        data = long_text_data(2 * batch * (steps + 2), seq)
        result["runnable"] = True
        for n, sharded in ((1, False), (2, True)):
            cfg = config(args, f"fsdp-{name}-{n}", data, max_steps=steps, save_steps=10_000, num_gpus=n,
                         per_device_train_batch_size=batch, gradient_accumulation_steps=2, max_seq_length=seq,
                         fsdp=sharded if sharded else "auto", **extra)
            s = session(args, cfg)
            result[f"gpus_{n}"] = {**s, **throughput(Path(cfg["output_dir"]))}
        one, two = (result[f"gpus_{n}"]["tokens_per_second_median"] for n in (1, 2))
        result["scaling"] = round(two / one, 3) if one and two else None
        out.append(result)
    return out


def killed_rank(args) -> dict:
    seq, batch = seq_of(args, 1024), args.batch or (4 if args.arch != "tiny" else 2)
    steps = args.steps or (30 if args.arch != "tiny" else 12)
    data = pattern_data(2 * batch * (steps + 2), seq)
    kw = dict(max_steps=steps, save_steps=max(2, steps // 6), num_gpus=2, per_device_train_batch_size=batch,
              gradient_accumulation_steps=2, max_seq_length=seq, lora_dropout=0.1)
    ref_cfg = config(args, "killed-ref", data, **kw)
    ref = session(args, ref_cfg)
    cfg = config(args, "killed", data, **kw)
    kill_at = steps // 2 + 1
    killed = session(args, cfg, kill_worker_at=kill_at)
    run = Path(cfg["output_dir"])
    st = starts(run)
    got = sorted(curve(run))
    result = {"case": "killed-rank", "arch": args.arch, "steps": steps, "save_steps": kw["save_steps"],
              "uninterrupted": ref, "killed": killed,
              "sessions_started": len(st), "restart_from_step": [s.get("from_step") for s in st][1:],
              "all_steps_logged": got == list(range(1, steps + 1)),
              "finished": (run / "final/adapter_model.safetensors").exists(),
              "adapter_max_abs_diff_vs_uninterrupted": adapter_diff(run, Path(ref_cfg["output_dir"]))}
    if isinstance(killed["rc"], int) and isinstance(ref["rc"], int):
        result["seconds_lost"] = round(killed["wall_seconds"] - ref["wall_seconds"], 1)
    if args.arch == "tiny":
        result["note"] = ("CPU smoke: the killed run steps with RELAYTUNE_SLOW_STEP=0.3 s and the reference does "
                          "not, so seconds_lost includes that slowdown")
    result["recovered"] = killed["rc"] == 0 and result["finished"] and len(st) >= 2
    return result


def gpu_count(args) -> dict:
    seq, batch = seq_of(args, 1024), args.batch or (4 if args.arch != "tiny" else 2)
    steps = args.steps or (30 if args.arch != "tiny" else 12)
    data = pattern_data(2 * batch * (steps + 2), seq)
    kw = dict(max_steps=steps, save_steps=10_000, per_device_train_batch_size=batch, gradient_accumulation_steps=2,
              max_seq_length=seq)
    ref_cfg = config(args, "count-ref-1gpu", data, num_gpus=1, **kw)
    ref = session(args, ref_cfg)
    cfg = config(args, "count-2-1-2", data, num_gpus=2, **kw)
    s1, s2 = steps // 3, 2 * steps // 3
    legs = [session(args, cfg, stop_at=s1),
            session(args, cfg, {"num_gpus": 1}, stop_at=s2),
            session(args, cfg, {"num_gpus": 2})]
    run = Path(cfg["output_dir"])
    a, b = curve(Path(ref_cfg["output_dir"])), curve(run)
    st = starts(run)
    bounds = [s.get("from_step", 0) or 0 for s in st] + [steps]
    world = {}
    for i, s in enumerate(st):
        for k in range(bounds[i] + 1, bounds[i + 1] + 1):
            world[k] = s.get("world_size", [2, 1, 2][i] if i < 3 else None)
    rows = [(k, a.get(k), b.get(k), world.get(k)) for k in sorted(set(a) | set(b))]
    rel = [abs(y - x) / abs(x) for _, x, y, _ in rows if x is not None and y is not None and x]
    table = [f"{'step':>5} {'1 GPU':>10} {'2->1->2':>10} {'GPUs':>5}"]
    table += [f"{k:>5} {x if x is not None else float('nan'):>10.5f} {y if y is not None else float('nan'):>10.5f} "
              f"{w if w is not None else '?':>5}" for k, x, y, w in rows]
    print("\n".join(table), file=sys.stderr)
    states = trainer_states(run)
    result = {"case": "gpu-count", "arch": args.arch, "steps": steps,
              "exits": [leg["rc"] for leg in legs], "expected_exits": [75, 75, 0],
              "stopped_after": [legs[0].get("sigterm_after_step"), legs[1].get("sigterm_after_step")],
              "resumed_from": [s.get("from_step") for s in st][1:],
              "checkpoint_world_sizes": {k: v.get("world_size") for k, v in states.items()},
              "uninterrupted_1gpu": ref, "legs": legs,
              "max_rel_loss_diff": round(max(rel), 6) if rel else None, "tolerance": GPU_COUNT_RTOL,
              "compared_steps": len(rel), "table": table}
    result["ok"] = ([leg["rc"] for leg in legs] == [75, 75, 0] and len(rel) == steps
                    and result["max_rel_loss_diff"] is not None and result["max_rel_loss_diff"] <= GPU_COUNT_RTOL)
    return result


def replay_scaler(state: dict, skips: set[int], first: int, last: int) -> dict:
    """The scaler state after steps first+1..last from `state`, given which steps skipped (GradScaler's rule)."""
    scale, tracker = state["scale"], state["_growth_tracker"]
    for step in range(first + 1, last + 1):
        if step in skips:
            scale, tracker = scale * state.get("backoff_factor", 0.5), 0
        else:
            tracker += 1
            if tracker == state.get("growth_interval", 2000):
                scale, tracker = scale * state.get("growth_factor", 2.0), 0
    return {"scale": scale, "_growth_tracker": tracker}


def t4(args) -> dict:
    seq = seq_of(args, 1024)
    steps = args.steps or (8 if args.arch != "tiny" else 8)
    global_batch = args.global_batch or (16 if args.arch != "tiny" else 8)
    data = long_text_data(global_batch * (steps + 2), seq)
    prec = {"fp16": True, "bf16": False} if cuda() else {}
    extra = {"optim": "paged_adamw_8bit"} if args.arch != "tiny" else {}
    cfg = config(args, "t4", data, max_steps=steps, save_steps=2, num_gpus=2, per_device_train_batch_size="auto",
                 global_batch_size=global_batch, max_seq_length=seq, **prec, **extra)
    # Checkpoints every 2 steps, so that one is written after the resume: the scaler is compared there
    # (the final adapter has no trainer state), not at the stop's own checkpoint.
    stop_at = steps // 2
    legs = [session(args, cfg, stop_at=stop_at, cap=args.cap_gib)]
    run = Path(cfg["output_dir"])
    at_stop = trainer_states(run)
    legs.append(session(args, cfg, cap=args.cap_gib))
    states = trainer_states(run)
    stop_step = max(at_stop) if at_stop else None
    scaler_stop = at_stop[stop_step].get("scaler") if stop_step else None
    last = max(states) if states else None
    scaler_end = states[last].get("scaler") if last else None
    events = [r for r in records(run / "metrics.jsonl") if r.get("event")]
    skips = {e["step"] for e in events if e["event"] == "scaler_skip"}
    result = {"case": "t4", "arch": args.arch, "cap_gib_per_gpu": args.cap_gib, "seq": seq,
              "global_batch_size": global_batch, "precision": "fp16" if prec else "fp32 (CPU)",
              "exits": [leg["rc"] for leg in legs], "expected_exits": [75, 0], "legs": legs,
              "steps_completed": len(curve(run)),
              "micro_batch_chosen": {k: v.get("recovery", {}).get("micro_batch_size") for k, v in states.items()},
              "oom_events": [e for e in events if e["event"] == "oom"],
              "scaler_skips": sorted(skips), "stopped_at": stop_step, "scaler_at_stop": scaler_stop,
              "scaler_at_end": scaler_end, **throughput(run)}
    result["checkpoint_after_resume"] = bool(last and stop_step and last > stop_step)
    if scaler_stop and scaler_end and last and stop_step and last > stop_step:
        want = replay_scaler(scaler_stop, skips, stop_step, last)
        got = {"scale": scaler_end["scale"], "_growth_tracker": scaler_end["_growth_tracker"]}
        fresh = replay_scaler({**scaler_stop, "scale": 65536.0, "_growth_tracker": 0}, skips, stop_step, last)
        result.update(scaler_expected_if_restored=want, scaler_expected_if_reset=fresh,
                      scaler_survived_resume=got == want and got != fresh)
    else:
        result["scaler_survived_resume"] = None if not prec else False
    result["ok"] = result["exits"] == [75, 0] and result["steps_completed"] == steps and (
        result["scaler_survived_resume"] is not False)
    return result


# --- reporting -----------------------------------------------------------------------------------

def versions() -> dict:
    import torch

    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda() else "cpu"
    return {"python": platform.python_version(), "gpus": gpus,
            **package_versions(("torch", "transformers", "peft", "bitsandbytes", "relaytune"))}


def summary_line(r: dict) -> str:
    c = r["case"]
    if c == "scaling":
        return (f"| scaling | {r['gpus_1']['tokens_per_second_median']} -> {r['gpus_2']['tokens_per_second_median']} "
                f"tok/s = {r['scaling']}x | {'meets' if r['meets_aim'] else 'misses'} the {SCALING_AIM}x aim |")
    if c.startswith("fsdp"):
        if not r.get("runnable"):
            return f"| {c} | not runnable yet | {r['reason'][:150]} |"
        return (f"| {c} | {r['gpus_1']['tokens_per_second_median']} -> {r['gpus_2']['tokens_per_second_median']} "
                f"tok/s, peak {r['gpus_1']['peak_memory_gib_rank0']} -> {r['gpus_2']['peak_memory_gib_rank0']} "
                "GiB/GPU | |")
    if c == "killed-rank":
        return (f"| killed-rank | exit {r['killed']['rc']}, {r['sessions_started']} sessions, restarted from "
                f"{r['restart_from_step']} | {'recovered' if r['recovered'] else 'NOT recovered'}, "
                f"seconds lost {r.get('seconds_lost')} |")
    if c == "gpu-count":
        return (f"| gpu-count | exits {r['exits']}, resumed from {r['resumed_from']} | max rel loss diff "
                f"{r['max_rel_loss_diff']} over {r['compared_steps']} steps: {'ok' if r['ok'] else 'FAIL'} |")
    if c == "t4":
        return (f"| t4 | exits {r['exits']}, micro-batch {r['micro_batch_chosen']} | scaler survived resume: "
                f"{r['scaler_survived_resume']}: {'ok' if r['ok'] else 'FAIL'} |")
    return f"| {c} | | |"


def emit(results: list[dict], args, argv: list[str]) -> None:
    for r in results:
        print(json.dumps({k: v for k, v in r.items() if k != "table"}))
    lines = ["| measurement | figures | verdict |", "|---|---|---|"] + [summary_line(r) for r in results]
    print("\n".join(lines))
    if args.out:
        md = [f"\n## `{' '.join(['python bench/multi_gpu.py'] + argv)}` ({time.strftime('%Y-%m-%d %H:%M')})\n",
              f"versions: `{json.dumps(versions())}`\n", *lines, ""]
        for r in results:
            md.append(f"### {r['case']}\n")
            if r.get("table"):
                md += ["```", *r["table"], "```", ""]
            md += ["```json", json.dumps({k: v for k, v in r.items() if k != "table"}, indent=1), "```", ""]
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "a") as fh:
            fh.write("\n".join(md) + "\n")


CASES = {"scaling": scaling, "fsdp": fsdp, "killed-rank": killed_rank, "gpu-count": gpu_count, "t4": t4}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("case", choices=[*CASES, "all", "_child"])
    p.add_argument("--arch", default=None, choices=sorted(gpu_bench.ARCHS),
                   help="default: per measurement (see the docstring); tiny = a CPU smoke test")
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--batch", type=int, default=None, help="micro-batch per GPU")
    p.add_argument("--global-batch", type=int, default=None, help="t4: global_batch_size")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--cap-gib", type=float, default=14.5, help="t4: memory cap per GPU")
    p.add_argument("--timeout", type=float, default=None, help="seconds per session before it is killed")
    p.add_argument("--out", default=None, help="append a Markdown report to this file")
    p.add_argument("--cfg", help=argparse.SUPPRESS)
    p.add_argument("--set", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.case == "_child":
        return child(args)
    OUT.mkdir(parents=True, exist_ok=True)
    arch = args.arch
    results: list[dict] = []
    for case in (list(CASES) if args.case == "all" else [args.case]):
        args.case, args.arch = case, arch or DEFAULT_ARCH[case]
        if args.timeout is None:
            args.timeout = 45.0 if args.arch == "tiny" else 400.0
        t0 = time.monotonic()
        got = CASES[case](args)
        for r in got if isinstance(got, list) else [got]:
            r["measurement_seconds"] = round(time.monotonic() - t0, 1)
            results.append(r)
            print(f"# {r['case']} done after {r['measurement_seconds']} s", file=sys.stderr, flush=True)
    emit(results, args, sys.argv[1:])


if __name__ == "__main__":
    main()
