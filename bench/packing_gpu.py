"""Benchmark: training tokens/s with and without packing, on a GPU, for a realistic length spread.

    PYTHONPATH=src python bench/packing_gpu.py [--arch qwen2.5-3b] [--samples 480] [--seq 2048] [--batch 4]

A random-init model of the real architecture (throughput does not depend on the weights),
bf16, SDPA, gradient checkpointing, LoRA r=16 on all linear layers, AdamW: the set-up of the
TRL anchor in DESIGN.md. The same samples (lengths drawn from a long-tailed distribution like
chat data, token ids random) are trained:
  padded  - micro-batches of `batch` rows, each padded to its longest row (packing: false);
  packed  - best-fit-decreasing into `seq`-token sequences (relaytune.data.packing), `batch` per
            micro-batch, per-sample position_ids, no attention_mask (relaytune.data.batches.collate);
  flat    - (only if flash-attn is installed) the same packed rows as one varlen row.
tokens/s counts real tokens only. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import importlib.util
import time

import numpy as np
import torch

from relaytune.data import IGNORE

ARCHS = {
    "qwen2.5-3b": dict(model_type="qwen2", hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                       num_attention_heads=16, num_key_value_heads=2, vocab_size=151936,
                       tie_word_embeddings=True, rope_theta=1e6, max_position_embeddings=32768),
    "tiny": dict(model_type="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=2,  # a CPU smoke test
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=151936, max_position_embeddings=4096),
}
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def build(arch: str, attn: str):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(ARCHS[arch])
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    with torch.device(DEV):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation=attn)
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                                             target_modules="all-linear", task_type="CAUSAL_LM"))
    return model


def lengths(n: int, seq: int, seed: int = 0) -> np.ndarray:
    """Long-tailed like chat data: median ~330 tokens, a few up to `seq`."""
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(5.8, 0.8, size=n).astype(int), 16, seq)


def run(model, batches, warmup: int = 2) -> tuple[float, float]:
    """(real tokens/s, peak GiB) over (batch, real tokens) pairs after `warmup` of them."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    sync = torch.cuda.synchronize if DEV == "cuda" else (lambda: None)
    if DEV == "cuda":
        torch.cuda.reset_peak_memory_stats()
    tokens, t0 = 0, time.perf_counter()
    for i, (batch, real) in enumerate(batches):
        if i == warmup:
            sync()
            t0, tokens = time.perf_counter(), 0
        batch = {k: v.to(DEV, non_blocking=True) for k, v in batch.items()}
        n = int((batch["labels"][:, 1:] != IGNORE).sum())
        model(**batch, num_items_in_batch=n).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        tokens += real
    sync()
    peak = torch.cuda.max_memory_allocated() / 2**30 if DEV == "cuda" else float("nan")
    return tokens / (time.perf_counter() - t0), peak


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--arch", default="qwen2.5-3b", choices=sorted(ARCHS))
    p.add_argument("--samples", type=int, default=480)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4)
    args = p.parse_args()

    from relaytune.data import TokenRow
    from relaytune.data.batches import collate
    from relaytune.data.packing import best_fit_decreasing, concat, efficiency

    lens = lengths(args.samples, args.seq)
    rng = np.random.default_rng(1)
    samples = [TokenRow(ids, ids) for ids in (rng.integers(100, 150000, size=n) for n in lens)]
    groups = [samples[i:i + args.batch] for i in range(0, len(samples), args.batch)]
    padded = [(collate(g, 0), sum(len(r.input_ids) for r in g)) for g in groups]
    bins = best_fit_decreasing(lens, args.seq, seed=0)
    rows = [TokenRow(*concat([(samples[i].input_ids, samples[i].labels) for i in b])) for b in bins]
    groups = [rows[i:i + args.batch] for i in range(0, len(rows), args.batch)]
    packed = [(collate(g, 0), sum(len(r.input_ids) for r in g)) for g in groups]
    flat = [(collate(g, 0, flat=True), sum(len(r.input_ids) for r in g)) for g in groups]
    real = int(lens.sum())
    slots = sum(int(b["input_ids"].numel()) for b, _ in padded)
    device = torch.cuda.get_device_name() if DEV == "cuda" else "CPU"
    print(f"# {device}, torch {torch.__version__}, {args.arch}, {args.samples} samples, "
          f"{real} tokens (median {int(np.median(lens))}, max {int(lens.max())}), seq {args.seq}, batch {args.batch}")
    print(f"# padded: {len(padded)} micro-batches, {real / slots:.1%} of slots real; packed: "
          f"{len(bins)} sequences, {efficiency(real, len(bins), args.seq):.1%} of slots real")
    print("| layout | attention | micro-batches | real tokens/s | peak GiB |")
    print("|---|---|---|---|---|")
    model = build(args.arch, "sdpa")
    for name, batches in (("padded (packing: false)", padded), ("packed (packing: true)", packed)):
        tps, peak = run(model, batches)
        print(f"| {name} | sdpa | {len(batches)} | {tps:,.0f} | {peak:.2f} |", flush=True)
    if importlib.util.find_spec("flash_attn") and DEV == "cuda":
        del model
        torch.cuda.empty_cache()
        model = build(args.arch, "flash_attention_2")
        tps, peak = run(model, flat)
        print(f"| packed, flat varlen | flash_attention_2 | {len(flat)} | {tps:,.0f} | {peak:.2f} |")
    else:
        print("# flash-attn is not installed here: no varlen row")


if __name__ == "__main__":
    main()
