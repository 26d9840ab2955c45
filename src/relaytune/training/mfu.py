"""Model FLOPs utilisation: training FLOPs per token, against the GPU's dense peak.

Counted as torchtitan counts [pytorch/torchtitan: torchtitan/models/utils.py,
`get_dense_model_nparams_and_flops`]:

    flops_per_token = 6 * N + 6 * L * H * (qk_head_dim + v_head_dim) * S
                    = 6 * N + 12 * L * H * head_dim * S      (qk and v heads of equal size)

with N the parameters that are matrix multiplications (every parameter but the input embedding),
L layers, H query heads, S the training sequence length. The 6 is 2 FLOPs per multiply-add times
3 GEMMs per weight (forward, input gradient, weight gradient); the attention term counts QK^T and
AV (2 matmuls forward, 4 backward, x2 FLOPs), ignores causal sparsity and does not count the
recompute of flash attention or of gradient checkpointing. One deviation, stated: torchtitan
subtracts the embedding from N, which for a tied model also drops the output head; the head is a
real matmul (10% of Qwen2.5-3B), so it is counted here (N = 3.086e9 for Qwen2.5-3B, 20.3 GFLOP
per token at S = 2048, as in the speed review).

The LoRA-honest figure (`lora`): the frozen weights never get a weight gradient, so they cost
4 FLOPs per parameter (forward + input gradient); the adapters cost 6; attention as above.

Peaks are dense (no 2:4 sparsity) bf16 tensor-core TFLOP/s from the vendors' data sheets (fp16
for GPUs without bf16), torchtitan's tools/utils.py `get_peak_flops` where it has the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# (substring of torch.cuda.get_device_name, dense TFLOP/s); the first match wins: specific first.
PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("GH200", 989.0),
    ("H200 NVL", 835.0),
    ("H200", 989.0),
    ("H100 NVL", 835.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),  # SXM
    ("H800", 989.0),
    ("H20", 148.0),
    ("B200", 2250.0),
    ("B100", 1750.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("A10G", 125.0),  # A10's sheet (AWS quotes no separate dense figure)
    ("A10", 125.0),
    ("A30", 165.0),
    ("L40S", 362.0),
    ("L40", 181.0),
    ("L4", 121.0),
    ("RTX 6000 Ada", 364.0),
    ("RTX A6000", 155.0),
    ("A6000", 155.0),
    ("RTX 4090", 165.0),
    ("RTX 3090", 71.0),
    ("V100", 125.0),  # fp16 (no bf16)
    ("T4", 65.0),  # fp16 (no bf16)
    ("MI300X", 1307.0),
    ("MI325X", 1307.0),
    ("MI355X", 2500.0),
)


def peak_flops(device_name: str) -> float | None:
    """Dense bf16 (fp16 where the GPU has no bf16) FLOP/s of a known GPU; None if unknown."""
    for key, tflops in PEAK_TFLOPS:
        if key in device_name:
            return tflops * 1e12
    return None


def logical_numel(p: torch.Tensor) -> int:
    """Elements of the weight a parameter stands for (bitsandbytes 4-bit packs two per byte)."""
    qs = getattr(p, "quant_state", None)
    shape = getattr(qs, "shape", None)
    if shape is not None:
        n = 1
        for d in shape:
            n *= int(d)
        return n
    return p.numel()


@dataclass(frozen=True)
class FlopsPerToken:
    six_n: float  # torchtitan's convention: 6N + attention
    lora: float  # frozen weights 4N, adapters 6N, + attention
    n_matmul: int  # N
    n_trainable: int


def flops_per_token(model, seq_len: int) -> FlopsPerToken:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = base.config
    embedding = base.get_input_embeddings().weight
    head = base.get_output_embeddings()
    seen: set[int] = set()
    frozen = trainable = 0
    for p in base.parameters():  # each tensor once (a tied head is the embedding)
        if id(p) in seen:
            continue
        seen.add(id(p))
        if p is embedding:
            continue
        if p.requires_grad:
            trainable += logical_numel(p)
        else:
            frozen += logical_numel(p)
    if head is not None and head.weight is embedding:
        frozen += logical_numel(embedding)  # the tied head is still a matmul (see the module docstring)
    layers = int(config.num_hidden_layers)
    heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    attention = 6 * layers * heads * (2 * head_dim) * seq_len
    n = frozen + trainable
    return FlopsPerToken(6.0 * n + attention, 4.0 * frozen + 6.0 * trainable + attention, n, trainable)


class MfuMeter:
    """`fields(tokens_per_second)` -> {"mfu": ..., "mfu_lora": ...} on a known GPU in mixed
    precision; {} elsewhere (the CPU, fp32, an unknown GPU). FLOPs per token counted once."""

    def __init__(self, model, seq_len: int, precision):
        self.peak = None
        self.flops = None
        device = precision.device
        if device.type != "cuda" or precision.autocast is None:
            return
        self.peak = peak_flops(torch.cuda.get_device_name(device))
        if self.peak:
            try:
                self.flops = flops_per_token(model, seq_len)
            except Exception:  # noqa: BLE001  (an unusual model: no MFU, never a failed run)
                self.peak = None

    def fields(self, tokens_per_second: float) -> dict:
        if not self.peak or not self.flops or not tokens_per_second:
            return {}
        return {"mfu": round(tokens_per_second * self.flops.six_n / self.peak, 4),
                "mfu_lora": round(tokens_per_second * self.flops.lora / self.peak, 4)}
