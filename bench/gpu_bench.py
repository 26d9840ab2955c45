"""GPU proofs and figures for relaytune, on random-init models of real architectures.

Throughput does not depend on the weights' values, so a random Qwen2.5-3B or
Llama-3-8B built from its config values measures what the real one would.
Every case trains through `relaytune.train` (the public API), reads the
figures back from metrics.jsonl, and prints one JSON line per case.

    python bench/gpu_bench.py throughput --arch qwen2.5-3b --quant none --batch 4 --steps 30
    python bench/gpu_bench.py throughput --arch qwen2.5-3b --quant 4bit --batch 4 --steps 30
    python bench/gpu_bench.py throughput --arch llama-3-8b --quant 4bit --batch 2 --steps 20
    python bench/gpu_bench.py oom --cap-gib 14.5 --batch 32     # a real CUDA OOM, stepped down
    python bench/gpu_bench.py stale                             # another process holds memory
    python bench/gpu_bench.py release                           # train() twice gives memory back
    python bench/gpu_bench.py throughput --arch tiny --steps 5  # a CPU smoke test of this script
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

# RELAYTUNE_BENCH_SRC: another checkout's src/ (an A/B of two commits). PYTHONPATH cannot do this:
# the repository's own src/ is put first here, ahead of it.
sys.path.insert(0, os.environ.get("RELAYTUNE_BENCH_SRC") or str(Path(__file__).resolve().parents[1] / "src"))
import relaytune  # noqa: E402
from relaytune.tiny import CORPUS, make_tokenizer  # noqa: E402

RELAYTUNE_SRC = str(Path(relaytune.__file__).resolve().parents[1])  # the src/ whose figures these are

ARCHS = {
    "qwen2.5-3b": dict(model_type="qwen2", hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                       num_attention_heads=16, num_key_value_heads=2, vocab_size=151936,
                       tie_word_embeddings=True, rope_theta=1e6, max_position_embeddings=32768),
    "llama-3-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                       tie_word_embeddings=False, rope_theta=5e5, max_position_embeddings=8192),
    "tiny": dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                 tie_word_embeddings=True, max_position_embeddings=4096),
}
COMPILE = {"auto": "auto", "true": True, "false": False}
WORK = Path(os.environ.get("BENCH_WORK", "/tmp/relaytune-bench"))


def package_versions(names=("torch", "transformers", "peft", "bitsandbytes", "trl", "liger-kernel")) -> dict:
    """The installed version of each package the figures depend on; None where it is absent."""
    from importlib.metadata import PackageNotFoundError, version

    found: dict = {}
    for name in names:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


def cuda_graphs_held() -> int | None:
    """The CUDA graphs Inductor's cudagraph trees hold on this GPU: one per recorded call of a compiled
    region, and one more each time a call is recorded again because an input it treats as fixed (a
    backward's saved tensor) came at another address. A count that grows every step means every step
    records again. None without CUDA or before any tree exists."""
    if not torch.cuda.is_available():
        return None
    try:
        from torch._inductor.cudagraph_trees import get_manager

        manager = get_manager(torch.cuda.current_device(), create_if_none_exists=False)
    except Exception:  # noqa: BLE001 - a torch that keeps its trees elsewhere
        return None
    if manager is None:
        return None
    held, pending = 0, [manager.roots]
    while pending:  # iterative: a step's path is one node per compiled call, hundreds deep
        for nodes in pending.pop().values():
            held += len(nodes)
            pending += [node.children for node in nodes]
    return held


def build_model(arch: str) -> Path:
    """Random-init weights of the architecture (seeded: the same weights on every call on one device type),
    saved as safetensors, with a local tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = WORK / "models" / arch
    if (folder / "config.json").exists():
        return folder
    values = dict(ARCHS[arch])
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.time()
    # The same weights in every invocation, so that losses can be compared across them (an A/B in two leases).
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    model.save_pretrained(folder)
    make_tokenizer().save_pretrained(folder)
    del model
    torch.cuda.empty_cache() if device == "cuda" else None
    print(f"# built {arch} in {time.time() - t0:.1f}s", file=sys.stderr)
    return folder


def long_text_data(rows: int, seq: int) -> Path:
    """Text rows long enough that every row fills max_seq_length (as packed data would)."""
    path = WORK / f"data-{rows}-{seq}.jsonl"
    if path.exists():
        return path
    rng = random.Random(0)
    words = " ".join(CORPUS).split()
    with open(path, "w") as fh:
        for _ in range(rows):
            fh.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(seq * 2))}) + "\n")
    return path


def pattern_data(rows: int, seq: int) -> Path:
    """Rows of one cycle of 24 words from a random starting point: predictable after a few tokens."""
    from relaytune.tiny import CORPUS

    path = WORK / f"pattern-{rows}-{seq}.jsonl"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    words = list(dict.fromkeys(" ".join(CORPUS).split()))[:24]
    rng = random.Random(0)
    with open(path, "w") as fh:
        for _ in range(rows):
            start = rng.randrange(len(words))
            fh.write(json.dumps({"text": " ".join(words[(start + i) % len(words)] for i in range(seq))}) + "\n")
    return path


def run(name: str, model: Path, data: Path, **cfg) -> dict:
    out = WORK / "runs" / name
    shutil.rmtree(out, ignore_errors=True)
    base = dict(model=str(model), dataset=str(data), output_dir=str(out), logging_steps=1,
                save_every_seconds=0, learning_rate=1e-4, lora_r=16, lora_alpha=32, lora_dropout=0.05)
    base.update(cfg)
    t0 = time.time()
    relaytune.train(base)
    wall = time.time() - t0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r and "event" not in r]
    warm = steps[3:] or steps
    saves = [r["blocked_seconds"] for r in records if r.get("event") == "checkpoint"]
    ckpts = sorted((out / "checkpoints").glob("step-*"))
    size = sum(f.stat().st_size for f in ckpts[-1].iterdir()) if ckpts else 0
    pairs = list(zip(warm, warm[1:]))
    step_seconds = statistics.median(
        (b["tokens_seen"] - a["tokens_seen"]) / b["tokens_per_second"] for a, b in pairs) if pairs else None
    return {
        "case": name, "steps": len(steps), "wall_seconds": round(wall, 1),
        "tokens_per_second_median": round(statistics.median(r["tokens_per_second"] for r in warm), 1),
        "peak_memory_gib": max((r.get("peak_memory_gib", 0) for r in steps), default=None),
        "first_loss": steps[0]["loss"], "last_loss": steps[-1]["loss"],
        "checkpoint_bytes": size, "save_blocked_seconds": saves,
        "step_seconds_median": round(step_seconds, 3) if step_seconds else None,
        "events": [r for r in records if r.get("event") not in (None, "checkpoint")],
    }


def throughput(args) -> None:
    model = build_model(args.arch)
    seq = args.seq if args.arch != "tiny" else 128
    data = long_text_data(args.batch * args.accum * (args.steps + 2), seq)
    quant = {"none": {}, "4bit": {"load_in_4bit": True}, "8bit": {"load_in_8bit": True}}[args.quant]
    result = run(f"{args.arch}-{args.quant}-b{args.batch}", model, data, max_steps=args.steps,
                 per_device_train_batch_size=args.batch, gradient_accumulation_steps=args.accum,
                 max_seq_length=seq, gradient_checkpointing=True, save_steps=args.save_steps,
                 optim=args.optim, torch_compile=COMPILE[args.compile], **quant)
    result.update(arch=args.arch, quant=args.quant, batch=args.batch, seq=seq, torch_compile=args.compile)
    print(json.dumps(result))


def oom(args) -> None:
    """Cap memory to a T4's share and start with a micro-batch that cannot fit."""
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(args.cap_gib * 2**30 / total)
    model = build_model(args.arch)
    data = long_text_data(args.batch * 4, args.seq)
    result = run(f"oom-{args.arch}", model, data, max_steps=3, per_device_train_batch_size=args.batch,
                 gradient_accumulation_steps=1, max_seq_length=args.seq, gradient_checkpointing=True,
                 load_in_4bit=True, save_steps=1000, optim="paged_adamw_8bit")
    result["cap_gib"] = args.cap_gib
    print(json.dumps(result))


def stale(args) -> None:
    """Another process holds most of the GPU: the preflight must say so before loading."""
    holder = subprocess.Popen([sys.executable, "-c",
                               "import torch,time; x=torch.empty(int(100*2**30),dtype=torch.uint8,device='cuda');"
                               "print('held',flush=True); time.sleep(600)"], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    try:
        model = build_model("tiny")
        data = long_text_data(16, 128)
        cfg = dict(model=str(model), dataset=str(data), output_dir=str(WORK / "runs/stale"), max_steps=2,
                   per_device_train_batch_size=2, save_every_seconds=0)
        shutil.rmtree(WORK / "runs/stale", ignore_errors=True)
        r = subprocess.run([sys.executable, "-c", f"import relaytune; relaytune.train({cfg!r})"],
                           capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                               [str(Path(__file__).resolve().parents[1] / "src"), os.environ.get("PYTHONPATH", "")])})
        lines = [line for line in r.stderr.splitlines() if "holds" in line or "GPU 0" in line]
        print(json.dumps({"case": "stale", "returncode": r.returncode, "preflight": lines,
                          "stderr_tail": r.stderr[-600:] if r.returncode else ""}))
    finally:
        holder.kill()


def release(args) -> None:
    """Calling train() twice in one process leaves GPU memory where it started."""
    model = build_model("qwen2.5-3b" if args.arch == "qwen2.5-3b" else "tiny")
    data = long_text_data(32, 256)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    after = []
    for i in range(2):
        run(f"release-{i}", model, data, max_steps=3, per_device_train_batch_size=2, max_seq_length=256,
            save_steps=2)
        torch.cuda.synchronize()
        after.append(torch.cuda.memory_allocated())
    print(json.dumps({"case": "release", "allocated_before": before, "allocated_after_each": after}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("case", choices=["throughput", "oom", "stale", "release"])
    p.add_argument("--arch", default="qwen2.5-3b", choices=sorted(ARCHS))
    p.add_argument("--quant", default="none", choices=["none", "4bit", "8bit"])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--save-steps", type=int, default=10)
    p.add_argument("--optim", default="adamw_torch")
    p.add_argument("--cap-gib", type=float, default=14.5)
    p.add_argument("--compile", default="auto", choices=sorted(COMPILE), help="torch_compile for throughput")
    args = p.parse_args()
    {"throughput": throughput, "oom": oom, "stale": stale, "release": release}[args.case](args)


if __name__ == "__main__":
    main()
