"""Liger's SwiGLU inside torch.compile: what Dynamo's failed look into its Triton kernels costs (GPU only).

Under torch.compile, Dynamo reads a user Triton kernel's TTIR to learn which tensors it writes. For
Liger 0.8.5's SwiGLU kernels that read fails on torch 2.11 ("'float' object has no attribute 'to'", at
`gate_multiplier.to(tl.float32)`), and Dynamo then assumes the kernel writes every tensor it is given,
so the compiled graph may copy the gate and up outputs (and the incoming gradient) before each launch.

This times one gated MLP, forward and backward, at a model's shapes (frozen bf16 weights, the input's
gradient taken, as LoRA's base layers are), four ways:
  hf-compiled          down(silu(gate(x)) * up(x)) under torch.compile (relaytune's default layers)
  liger-eager          Liger's LigerSiLUMulFunction, eager
  liger-compiled       the same under torch.compile (what `liger_kernels: [swiglu]` runs in compiled layers)
  liger-known-writes   the same, with Dynamo told what the kernels write (forward: c; backward: a and b)
  liger-opaque         compiled, but Liger's function run eagerly inside it (torch.compiler.disable), so its
                       backward writes the saved gate and up outputs in place as it does eagerly
It prints milliseconds per forward + backward (median of --iters) and the peak allocated above the
inputs and weights, and whether Dynamo's read of the kernels failed.

    python bench/liger_swiglu_compiled.py --shape qwen2.5-3b   # 8,192 tokens, hidden 2,048, intermediate 11,008
    python bench/liger_swiglu_compiled.py --shape llama-3-8b   # 4,096 tokens, hidden 4,096, intermediate 14,336
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import statistics
import sys

import torch
import torch.nn.functional as F

SHAPES = {"qwen2.5-3b": (8192, 2048, 11008), "llama-3-8b": (4096, 4096, 14336)}
# What each of Liger's SwiGLU kernels writes, read from liger_kernel/ops/swiglu.py (0.8.5).
KNOWN_WRITES = {"_swiglu_forward_kernel": ["c_ptr"], "_swiglu_backward_kernel": ["a_ptr", "b_ptr"]}


class FailedReads(logging.Handler):
    """Counts Dynamo's warnings that it could not read a Triton kernel's writes."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def emit(self, record):
        if "assuming every input is mutated" in record.getMessage():
            self.count += 1


def tell_dynamo_the_writes(on: bool) -> None:
    import torch._higher_order_ops.triton_kernel_wrap as wrap

    original = getattr(wrap, "_relaytune_original", None) or wrap.identify_mutated_tensors
    wrap._relaytune_original = original

    def identify(kernel, kwargs, *rest):
        name = getattr(getattr(kernel, "fn", None), "__name__", "")
        return KNOWN_WRITES[name] if name in KNOWN_WRITES else original(kernel, kwargs, *rest)

    wrap.identify_mutated_tensors = identify if on else original


def mlp_hf(x, wg, wu, wd):
    return F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)


def mlp_liger(x, wg, wu, wd):
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    return F.linear(LigerSiLUMulFunction.apply(F.linear(x, wg), F.linear(x, wu), 1.0, 1.0), wd)


@torch.compiler.disable
def silu_mul_opaque(a, b):
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    return LigerSiLUMulFunction.apply(a, b, 1.0, 1.0)


def mlp_liger_opaque(x, wg, wu, wd):
    return F.linear(silu_mul_opaque(F.linear(x, wg), F.linear(x, wu)), wd)


def measure(fn, tensors, iters: int) -> dict:
    x, weights = tensors
    for _ in range(3):  # compiles, then warms the allocator
        fn(x, *weights).sum().backward()
    x.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(x, *weights).sum().backward()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
        x.grad = None
    return {"ms": round(statistics.median(times), 3),
            "peak_above_inputs_gib": round((torch.cuda.max_memory_allocated() - base) / 2**30, 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-3b")
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args()
    missing = ("a CUDA GPU: Liger's kernels are Triton's" if not torch.cuda.is_available() else
               "liger-kernel: pip install liger-kernel" if importlib.util.find_spec("liger_kernel") is None else None)
    if missing:
        print(f"liger_swiglu_compiled.py needs {missing}.", file=sys.stderr)
        sys.exit(2)
    tokens, hidden, inter = SHAPES[args.shape]
    torch.manual_seed(0)
    dev, dt = torch.device("cuda"), torch.bfloat16
    x = torch.randn(tokens, hidden, device=dev, dtype=dt, requires_grad=True)
    weights = [torch.randn(inter, hidden, device=dev, dtype=dt) / hidden**0.5,
               torch.randn(inter, hidden, device=dev, dtype=dt) / hidden**0.5,
               torch.randn(hidden, inter, device=dev, dtype=dt) / inter**0.5]
    reads = FailedReads()
    logging.getLogger("torch._dynamo").addHandler(reads)  # triton_kernel_wrap.py logs through Dynamo's logger
    results = {}
    for name, fn, compiled, known in [("hf-compiled", mlp_hf, True, False), ("liger-eager", mlp_liger, False, False),
                                      ("liger-compiled", mlp_liger, True, False),
                                      ("liger-known-writes", mlp_liger, True, True),
                                      ("liger-opaque", mlp_liger_opaque, True, False)]:
        torch._dynamo.reset()
        tell_dynamo_the_writes(known)
        before = reads.count
        results[name] = measure(torch.compile(fn) if compiled else fn, (x, weights), args.iters)
        results[name]["failed_kernel_reads"] = reads.count - before
        print(f"{name:>20}: {results[name]}", flush=True)
    tell_dynamo_the_writes(False)
    print(json.dumps({"shape": args.shape, "tokens": tokens, "hidden": hidden, "intermediate": inter,
                      "device": torch.cuda.get_device_name(0), "torch": torch.__version__, **results}))


if __name__ == "__main__":
    main()
