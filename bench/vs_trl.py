"""relaytune vs TRL SFTTrainer (and TRL + Liger), side by side, in one invocation on one GPU.

Every system trains the same random-init model (built once by gpu_bench.build_model and cached
in BENCH_WORK), on the same text rows (gpu_bench.long_text_data: every row is longer than --seq,
so every sequence is a full --seq tokens and nothing is padded), with the same sequence length,
micro-batch, accumulation, LoRA (r 16, alpha 32, --lora-dropout, all linear layers), non-reentrant
gradient checkpointing, bf16, optimizer and learning rate. --quant 4bit loads the base model with
BitsAndBytesConfig NF4 (double quant, bf16 compute) in both systems.

Each system runs in its own child process (`python bench/vs_trl.py --worker SYSTEM ...`), so one
system's allocator state or peak cannot leak into the next. In every worker the peak statistics are
reset after the model (with its adapter) is loaded and before the first step:
  - TRL: torch.cuda.reset_peak_memory_stats() right before trainer.train(), after SFTTrainer
    construction (model load, get_peft_model, adapter casts).
  - relaytune: relaytune resets them itself after building model + adapter + optimizer (the
    Trainer's _build); the worker also wraps relaytune's load_model, where it can, to reset at
    the same point as TRL.
Peak ALLOCATED = torch.cuda.max_memory_allocated() and peak RESERVED = max_memory_reserved(), both
read at the end of the last training step (relaytune: at its last metrics record, so the final
adapter save after the loop is excluded; the figure including it is in the JSON as well).
tokens/s = median over the timed steps (after --warmup steps) of tokens in the step / step time.
  - TRL: a TrainerCallback times on_step_begin .. on_step_end with torch.cuda.synchronize() on
    both ends; tokens are counted from each micro-batch (attention_mask sum, or input_ids size
    when padding-free).
  - relaytune: tokens_per_second of each step's metrics.jsonl record (logging_steps 1), as
    gpu_bench.run reads it; checkpoints are off inside the timed window unless --save-steps.

    # the four cases of issue 16 (each one invocation, ~2-4 min on an H200):
    python bench/vs_trl.py --arch qwen2.5-3b --quant none --batch 4
    python bench/vs_trl.py --arch qwen2.5-3b --quant 4bit --batch 4
    python bench/vs_trl.py --arch llama-3-8b --quant 4bit --batch 2
    python bench/vs_trl.py --arch qwen2.5-3b --quant 4bit --batch 4 --seq 512
    # the largest micro-batch that fits in a T4-sized 14.5 GiB, per system:
    python bench/vs_trl.py --arch qwen2.5-3b --quant 4bit --cap-gib 14.5 --systems relaytune,trl
    # CPU smoke test of this script:
    python bench/vs_trl.py --arch tiny --seq 128 --steps 3 --warmup 1
"""

from __future__ import annotations

import argparse
import json
import random
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import gpu_bench  # noqa: E402  (puts src/ on sys.path and imports relaytune)
from gpu_bench import ARCHS, WORK, build_model, long_text_data, package_versions  # noqa: E402
from gpu_power import PowerSampler, describe  # noqa: E402
from vs_trl_workers import RESULT, halved_micro_batch, liger_kernels, relaytune_adapter_dtype, worker  # noqa: E402

from relaytune.liger import KERNELS  # noqa: E402

# Extra sizes for quick checks, local to this script (gpu_bench.ARCHS is the same dict object,
# so build_model knows them too).
ARCHS.setdefault("qwen2.5-0.5b", dict(
    model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
    num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
    tie_word_embeddings=True, rope_theta=1e6, max_position_embeddings=32768))
ARCHS.setdefault("qwen2.5-7b", dict(
    model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
    num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
    tie_word_embeddings=False, rope_theta=1e6, max_position_embeddings=32768))

SYSTEMS = ("relaytune", "trl", "trl-liger")
SEARCH = (1, 2, 4, 8, 16, 32)


# --- data ------------------------------------------------------------------------------------
def docs_data(min_tokens: int, seq: int) -> Path:
    """Documents of 64..min(1024, seq) words for --packing (both systems pack them to --seq)."""
    path = WORK / f"docs-{min_tokens}-{seq}.jsonl"
    if path.exists():
        return path
    rng = random.Random(0)
    words = " ".join(gpu_bench.CORPUS).split()
    total = 0
    WORK.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        while total < min_tokens:
            n = rng.randint(64, max(64, min(1024, seq)))
            total += n
            fh.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(n))}) + "\n")
    return path


def data_for(args, batch: int) -> Path:
    steps = args.warmup + args.steps + 2
    if args.packing:
        return docs_data(batch * args.accum * steps * args.seq, args.seq)
    return long_text_data(batch * args.accum * steps, args.seq)


# --- the parent: build once, spawn one child per system -----------------------------------------
def spawn(args, system: str, batch: int, model: Path, data: Path) -> dict:
    run_dir = WORK / "vs_trl" / f"{system}-{args.arch}-{args.quant}-s{args.seq}-b{batch}"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", system, "--model", str(model),
           "--data", str(data), "--run-dir", str(run_dir), "--arch", args.arch, "--quant", args.quant,
           "--seq", str(args.seq), "--batch", str(batch), "--accum", str(args.accum),
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--optim", args.optim,
           "--lr", str(args.lr), "--lora-dropout", str(args.lora_dropout),
           "--save-steps", str(args.save_steps or 0), "--adapter-dtype", args.adapter_dtype]
    if args.packing:
        cmd.append("--packing")
    if system == "relaytune":
        for item in args.relaytune_set or []:
            cmd += ["--relaytune-set", item]
        if args.relaytune_liger:
            cmd += ["--relaytune-liger", ",".join(args.relaytune_liger)]
        cmd += ["--relaytune-offload-stream", args.relaytune_offload_stream]
    if args.cap_gib:
        cmd += ["--cap-gib", str(args.cap_gib)]
    log = WORK / "vs_trl" / f"{run_dir.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with open(log, "w") as fh, PowerSampler() as power:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, text=True)
        killed = False
        while proc.poll() is None:
            time.sleep(1)
            # Under a cap, relaytune halves its micro-batch on OOM by itself and carries on; for the
            # search that run did not fit at this micro-batch, so stop it there.
            if args.cap_gib and system == "relaytune" and _has_oom_event(run_dir):
                proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                killed = True
    seconds = time.time() - t0
    text = log.read_text(errors="replace")
    lines = [x for x in text.splitlines() if x.startswith(RESULT)]
    if lines:
        res = json.loads(lines[-1][len(RESULT):])
    elif killed:
        res = dict(system=system, batch=batch, fits=False, oom_events=["oom event in metrics.jsonl"],
                   notes=["stopped at relaytune's first oom event"])
    else:
        tail = "\n".join(text.splitlines()[-25:])
        res = dict(system=system, batch=batch, fits=False, error=f"worker exited {proc.returncode}: see {log}",
                   notes=[])
        print(f"# {system} b{batch} FAILED (exit {proc.returncode}); last lines of {log}:\n{tail}", file=sys.stderr)
    res["process_seconds"] = round(seconds, 1)
    res["gpu"] = power.summary()  # over the whole child, while the GPU was busy (gpu_power.py)
    if system == "relaytune":
        res["notices"] = relaytune_notices(text)
    # A worker that crashed did not run out of memory: say which, or a cap search reads a crash as "too big".
    outcome = (f" (failed: exit {proc.returncode})" if "error" in res
               else "" if res.get("fits", True) else " (did not fit)")
    print(f"# {system} micro-batch {batch}: {seconds:.0f}s in its process{outcome}", file=sys.stderr, flush=True)
    return res


NOTICE = re.compile(r"relaytune: (?:note: |speed-ups: )[^\r\n]*")


def relaytune_notices(log_text: str) -> list[str]:
    """What relaytune told the user about its choices (its notes and speed-ups line), from a child's
    log, where tqdm's carriage returns may share a line with them."""
    return NOTICE.findall(log_text)


def _has_oom_event(run_dir: Path) -> bool:
    """Whether relaytune halved its micro-batch after an OOM. An OOM redone at the same micro-batch
    (CUDA graphs or the compiled checkpoint given up) still fits that micro-batch."""
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return False
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line still being written
        if record.get("event") == "oom" and halved_micro_batch(record):
            return True
    return False


def fmt(v, spec=",.0f", missing=""):
    return missing if v is None else format(v, spec)


def ratio(a, b):
    return round(a / b, 2) if a and b else None


def report(args, results: list[dict], notes: list[str], header: str) -> str:
    by = {r["system"]: r for r in results}
    rt = by.get("relaytune", {})
    lines = [header, "",
             "| system | micro-batch | tok/s | peak allocated GiB | peak reserved GiB | relaytune's tok/s / this | "
             "relaytune's peak alloc / this |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(
            f"| {r['system']} | {r.get('batch', '')} | {fmt(r.get('tokens_per_second'))} | "
            f"{fmt(r.get('peak_allocated_gib'), '.2f')} | {fmt(r.get('peak_reserved_gib'), '.2f')} | "
            f"{fmt(ratio(rt.get('tokens_per_second'), r.get('tokens_per_second')), '.2f')} | "
            f"{fmt(ratio(rt.get('peak_allocated_gib'), r.get('peak_allocated_gib')), '.2f')} |")
    summary = {}
    for other in ("trl", "trl-liger"):
        if other in by and rt:
            o = by[other]
            summary[f"relaytune/{other}"] = dict(
                tokens_per_second=ratio(rt.get("tokens_per_second"), o.get("tokens_per_second")),
                peak_allocated=ratio(rt.get("peak_allocated_gib"), o.get("peak_allocated_gib")),
                peak_reserved=ratio(rt.get("peak_reserved_gib"), o.get("peak_reserved_gib")),
                micro_batch=ratio(rt.get("batch"), o.get("batch")) if args.cap_gib else None)
    lines.append("")
    for k, v in summary.items():
        lines.append(f"- {k}: tok/s x{fmt(v['tokens_per_second'], '.2f', 'n/a')}, peak allocated "
                     f"x{fmt(v['peak_allocated'], '.2f', 'n/a')}, "
                     f"peak reserved x{fmt(v['peak_reserved'], '.2f', 'n/a')}"
                     + (f", micro-batch x{fmt(v['micro_batch'], '.2f')}" if v["micro_batch"] else ""))
    lines += [f"- note: {n}" for n in notes]
    lines += [f"- GPU while {r['system']} ran (nvidia-smi, samples at >= 90% utilisation): {describe(r['gpu'])}"
              for r in results if r.get("gpu")]
    lines += ["- peak memory: torch.cuda.max_memory_allocated / max_memory_reserved, statistics reset after "
              "the model and adapter are loaded (every system alike), read at the end of the last step; "
              f"tok/s: median of {args.steps} steps after {args.warmup} warm-up steps."]
    tps = {tuple(r.get("tokens_per_step") or ()) for r in results if r.get("tokens_per_step")}
    if len(tps) > 1 and not args.packing and not args.cap_gib:
        lines.append(f"- WARNING: tokens per step differ between systems: {sorted(tps)}")
    lines.append("")
    for r in results:
        lines.append(json.dumps(r))
    if summary:
        lines.append(json.dumps({"ratios": summary, "arch": args.arch, "quant": args.quant, "seq": args.seq}))
    return "\n".join(lines) + "\n"


def case_arguments(p: argparse.ArgumentParser) -> None:
    """The case: model, quantization, shapes, optimizer, LoRA and relaytune settings (step_profile.py too)."""
    p.add_argument("--arch", default="qwen2.5-3b", choices=sorted(ARCHS))
    p.add_argument("--quant", default="none", choices=["none", "4bit"])
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4, help="micro-batch (per_device_train_batch_size)")
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--optim", default="adamw_torch", choices=["adamw_torch", "paged_adamw_8bit"])
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--lora-dropout", type=float, default=0.05)
    p.add_argument("--adapter-dtype", default="match", choices=["match", "float32", "bfloat16"],
                   help="relaytune's adapter_dtype; match: the dtype TRL gives its adapters in this case")
    p.add_argument("--packing", action="store_true",
                   help="short documents packed to --seq by both systems (TRL: bfd, padding-free)")
    p.add_argument("--relaytune-set", action="append", metavar="KEY=VALUE",
                   help="a relaytune config key for its run (repeatable), e.g. torch_compile=false, attention=sdpa")
    p.add_argument("--relaytune-liger", nargs="?", const=",".join(KERNELS), type=liger_kernels,
                   metavar="KERNELS", help="relaytune's run with its liger_kernels: a comma list of "
                   + ", ".join(KERNELS) + " (both when no list is given)")
    p.add_argument("--relaytune-offload-stream", default="side", choices=["side", "compute"],
                   help="with offload_activations: relaytune's copies on its side stream (as it runs), or on the "
                   "compute stream (as before 6c76cf5), to measure the overlap")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    case_arguments(p)
    p.add_argument("--steps", type=int, default=20, help="timed steps, after --warmup steps")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--save-steps", type=int, default=0, help="relaytune checkpoint every N steps (0: none)")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--cap-gib", type=float, default=0.0,
                   help="cap each worker at this much GPU memory and search the largest micro-batch that fits")
    p.add_argument("--search", default=",".join(map(str, SEARCH)), help="micro-batches tried under --cap-gib")
    p.add_argument("--out", help="append the Markdown table and the JSON lines to this file")
    # worker-only
    p.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)

    import torch

    cuda = torch.cuda.is_available()
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    for s in systems:
        if s not in SYSTEMS:
            p.error(f"unknown system {s!r}; choose from {', '.join(SYSTEMS)}")
    notes = []
    if not cuda:
        notes.append("no GPU: float32 on the CPU, no bf16, no memory figures")
        if "trl-liger" in systems:
            systems.remove("trl-liger")
            notes.append("trl-liger skipped: Liger's kernels need triton and a GPU")
        if args.cap_gib:
            notes.append(f"--cap-gib {args.cap_gib} ignored on the CPU")
            args.cap_gib = 0.0
        if args.quant == "4bit":
            notes.append("--quant 4bit on the CPU: bitsandbytes 4-bit needs a GPU; running without quantization")
            args.quant = "none"
    elif "trl-liger" in systems:
        try:
            import liger_kernel  # noqa: F401
        except ImportError:
            systems.remove("trl-liger")
            notes.append("trl-liger skipped: liger-kernel is not installed")
    if args.arch == "tiny" and args.seq > 1024:
        notes.append(f"tiny model: --seq {args.seq} lowered to 128")
        args.seq = 128
    t0 = time.time()
    model = build_model(args.arch)
    print(f"# model {args.arch} ready in {time.time() - t0:.0f}s ({model})", file=sys.stderr, flush=True)
    device = torch.cuda.get_device_name(0) if cuda else "cpu"
    results = []
    if args.cap_gib:
        batches = [int(b) for b in args.search.split(",")]
        data = data_for(args, max(batches))
        for system in systems:
            best = None
            tried = []
            for b in batches:
                r = spawn(args, system, b, model, data)
                tried.append({"batch": b, "fits": r.get("fits", False),
                              "peak_allocated_gib": r.get("peak_allocated_gib"),
                              **({"error": r["error"]} if "error" in r else {})})
                if not r.get("fits"):
                    break
                best = r
            best = dict(best or {"system": system, "batch": None, "notes": ["no micro-batch fit"]})
            best["search"] = tried
            results.append(best)
        header = (f"### {args.arch} {'QLoRA' if args.quant == '4bit' else 'LoRA'}, seq {args.seq}, cap "
                  f"{args.cap_gib} GiB: largest micro-batch that fits ({device}, {time.strftime('%Y-%m-%d')})")
    else:
        data = data_for(args, args.batch)
        for system in systems:
            results.append(spawn(args, system, args.batch, model, data))
        header = (f"### {args.arch} {'QLoRA' if args.quant == '4bit' else 'LoRA'}, seq {args.seq}, micro-batch "
                  f"{args.batch} x accum {args.accum}, {args.optim}{', packed' if args.packing else ''} "
                  f"({device}, {time.strftime('%Y-%m-%d')})")
    header += f"; relaytune adapter_dtype {relaytune_adapter_dtype(args)}"
    if args.relaytune_set:
        header += ", " + ", ".join(args.relaytune_set)
    if args.relaytune_liger:
        header += ", with Liger's kernels: " + ", ".join(args.relaytune_liger)
    if args.relaytune_offload_stream != "side":
        header += ", offload copies on the compute stream"
    text = report(args, results, notes, header) + f"- versions: {stack_versions()}\n"
    text += f"<!-- command: python bench/vs_trl.py {' '.join(sys.argv[1:])} ; total {time.time() - t0:.0f}s -->\n"
    publish(text, args.out)


def stack_versions() -> str:
    """The versions the figures depend on (transformers 5.2x moved gradient checkpointing into the
    layer's forward, which once changed relaytune's peak memory fourfold)."""
    return (", ".join(f"{name} {v}" for name, v in package_versions().items() if v)
            + f"; relaytune from {gpu_bench.RELAYTUNE_SRC}")


def publish(text: str, out: str | None) -> None:
    """Print the report and append it to --out (step_profile.py too)."""
    print(text)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        with open(out, "a") as fh:
            fh.write(text + "\n")


if __name__ == "__main__":
    main()
