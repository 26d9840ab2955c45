"""Tokens per second and time to finish, from relaytune's measured H200 throughput scaled to other GPUs."""

from __future__ import annotations

import math
from dataclasses import dataclass

from relaytune.plan.architectures import Architecture, from_table
from relaytune.plan.gpus import TABLE as GPUS
from relaytune.plan.gpus import Gpu

H200_TFLOPS = GPUS["H200"].tflops
KAGGLE_SESSION_H, KAGGLE_WEEKLY_H, COLAB_SESSION_H = 12.0, 30.0, 12.0
# relaytune's own runs on one H200 with its defaults there (bench/results/vs-trl-h200.md: the fourteenth
# session's rows, Llama as the mean of its four runs; seq 2048, packed, gradient checkpointing, compiled
# layers, LoRA r16 all-linear with dropout 0.05, bf16): (model, quantized, micro-batch, tokens/s).
MEASURED = (("Qwen/Qwen2.5-3B", False, 4, 18_460), ("Qwen/Qwen2.5-3B", True, 4, 19_894),
            ("meta-llama/Meta-Llama-3-8B", True, 2, 10_476))
MEASURED_SEQ = 2048
# The 8-bit (LLM.int8) matmul is far slower than bf16 or NF4; fp32 runs without tensor cores' half-precision rate.
INT8_SLOWDOWN, FP32_SLOWDOWN = 0.5, 0.25


def flops_per_token(arch: Architecture, seq: int, gradient_checkpointing: bool,
                    labelled_fraction: float = 1.0) -> float:
    """Training FLOPs per token for LoRA: frozen weights need no weight gradient.

    Linear layers: forward 2N, input gradient 2N, and with checkpointing a second forward 2N.
    The head runs on labelled tokens only: forward and input gradient (the loss computes its gradient
    in forward, so no chunk is recomputed). Causal attention: 2 x S x q per layer per forward, twice
    that in backward.
    """
    passes = 3 if gradient_checkpointing else 2
    layers = sum(m.in_features * m.out_features for m in arch.layer_linears()) * arch.num_layers
    head = 2 * 2 * arch.vocab_size * arch.hidden_size * labelled_fraction
    attention = 2 * seq * arch.q_dim * arch.num_layers * (passes + 1)
    return 2 * passes * layers + head + attention


def _efficiency_anchors() -> list[tuple[float, float]]:
    """(parameters, share of the H200's peak reached) for each measured case."""
    points = []
    for model, _, _, tokens_per_s in MEASURED:
        arch = from_table(model)
        used = tokens_per_s * flops_per_token(arch, MEASURED_SEQ, True)
        points.append((arch.total_params(), used / (H200_TFLOPS * 1e12)))
    return points


def efficiency(params: int) -> float:
    """Share of peak FLOP/s reached, log-linear in model size through the measured points (clamped).

    Small models reach less: their kernels are too short to fill the GPU. The ceiling is the highest
    share measured (Llama-3-8B QLoRA, 0.49 of the H200's peak), since larger models were not run.
    """
    points = _efficiency_anchors()
    small = [e for n, e in points if n < 5e9]
    large = [e for n, e in points if n >= 5e9]
    n_small = next(n for n, _ in points if n < 5e9)
    n_large = next(n for n, _ in points if n >= 5e9)
    e_small, e_large = sum(small) / len(small), sum(large) / len(large)
    slope = (e_large - e_small) / math.log2(n_large / n_small)
    return min(max(e for _, e in points), max(0.04, e_small + slope * math.log2(params / n_small)))


@dataclass(frozen=True)
class Throughput:
    tokens_per_second: float | None
    basis: str  # how the figure was reached, for the report


def estimate_throughput(arch: Architecture, gpu: Gpu, seq: int, gradient_checkpointing: bool,
                        quantization: str = "none", compute_dtype: str = "bf16") -> Throughput:
    if gpu.tflops is None:
        return Throughput(None, f"{gpu.name}'s speed is not in the table; give a known card to get an estimate")
    flops = flops_per_token(arch, seq, gradient_checkpointing)
    rate = efficiency(arch.total_params()) * gpu.tflops * 1e12 / flops
    notes = [f"an estimate: relaytune's measured H200 throughput, scaled by model FLOPs and by "
             f"{gpu.name}'s dense {gpu.precision} peak ({gpu.tflops:g} vs {H200_TFLOPS:g} TFLOP/s)"]
    if quantization == "int8":
        rate *= INT8_SLOWDOWN
        notes.append("halved for 8-bit matmuls")
    if compute_dtype == "fp32":
        rate *= FP32_SLOWDOWN
        notes.append("quartered for fp32")
    return Throughput(rate, "; ".join(notes))


@dataclass(frozen=True)
class Eta:
    hours: float
    kaggle_sessions: int
    kaggle_weeks: int
    colab_sessions: int

    def describe(self) -> str:
        return (f"about {_plural(self.kaggle_sessions, 'Kaggle session')} of {KAGGLE_SESSION_H:g} h; about "
                f"{_plural(self.kaggle_weeks, 'week')} of Kaggle's {KAGGLE_WEEKLY_H:g} h weekly GPU quota; "
                f"Colab: about {_plural(self.colab_sessions, 'session')} of up to {COLAB_SESSION_H:g} h "
                "(the free tier often ends sooner and gives no guarantee)")


def estimate_eta(tokens: float, tokens_per_second: float) -> Eta:
    hours = tokens / tokens_per_second / 3600
    return Eta(hours, max(1, math.ceil(hours / KAGGLE_SESSION_H)), max(1, math.ceil(hours / KAGGLE_WEEKLY_H)),
               max(1, math.ceil(hours / COLAB_SESSION_H)))


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")
