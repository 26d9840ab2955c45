"""When the compiled decoder layers replay CUDA graphs (`cuda_graphs`), and why not.

A compiled layer call costs the host about 1.6 ms on the H200's host (the checkpoint's set-up,
Dynamo's guards, AOTAutograd's wrappers, the kernels' Python launchers; `bench/results/
host-overhead-h200.md`). When the GPU's own work in that call is shorter, the GPU waits on the host
and the step is as long as the host's work. CUDA graphs replay the recorded kernels in one launch,
which removes most of that host work; relaytune.layers.RecomputedLayer is the checkpoint that makes
the replays safe in training. They cost a longer warm-up, and some memory: on an H200, Qwen2.5-3B QLoRA
peaked 0.13 GiB higher with them at seq 2048. At seq 512 they cost nothing once the next step's batch
was made ahead on the host only (2.847 GiB with and without them; the batch's device tensors made
ahead had raised it to 2.894 with them: training/prefetch.py, bench/results/vs-trl-h200.md).

auto turns them on where a layer's forward, at the GPU's dense peak, is shorter than
AUTO_MAX_LAYER_MS: there the host bounds the step, or a good part of it. Measured on one H200
(bench/results/cuda-graphs-h200.md), QLoRA, packed: Qwen2.5-3B at seq 512, micro-batch 4 (0.32 ms at
peak) ran 2.4x the tokens/s with graphs; at seq 2048, micro-batch 4 (1.28 ms), +12%; Llama-3-8B at
seq 2048, micro-batch 2 (1.8 ms), no gain. auto also needs bf16: graphs were proven on a GPU in bf16
only (bench/graphs_proof.py), not on a T4's fp16 path with its gradient scaler (`true` runs there).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where it runs: the planner reads the rule below without it
    import torch

AUTO_MAX_LAYER_MS = 1.5  # a decoder layer's forward at the GPU's peak, below which the host bounds the step


def graphs_decision(cfg, device: torch.device, layers: list[torch.nn.Module],
                    bf16: bool = True) -> tuple[bool, str | None]:
    """(replay CUDA graphs?, why not, when the user asked for them or should know). `bf16`: the run
    computes in bf16; auto stays off otherwise, since graphs were proven on a GPU in bf16 only (fp16's
    gradient-scaler path, a T4's, has not run with them)."""
    setting = getattr(cfg, "cuda_graphs", False)
    if setting is False or not layers:
        return False, None
    asked = setting is True
    blocker = _blocker(cfg, device)
    if blocker:
        return False, blocker if asked else None
    if asked:
        return True, None
    if not bf16:
        return False, None
    ms = layer_forward_ms(layers[0], _tokens_per_micro_batch(cfg), device)
    return ms is not None and ms < AUTO_MAX_LAYER_MS, None


def auto_turns_on(layer_weights: float, tokens: int, peak_flops: float) -> bool:
    """auto's rule, given a layer's weights, a micro-batch's tokens and the GPU's dense peak (FLOP/s)."""
    return forward_ms(layer_weights, tokens, peak_flops) < AUTO_MAX_LAYER_MS


def forward_ms(layer_weights: float, tokens: int, peak_flops: float) -> float:
    """A decoder layer's forward for `tokens` tokens at `peak_flops`: 2 FLOPs per weight per token
    (attention's scores are left out: at most a few percent at these lengths)."""
    return 2.0 * layer_weights * tokens / peak_flops * 1e3


def _blocker(cfg, device: torch.device) -> str | None:
    """What keeps graphs off on this machine and run (the static contradictions are config errors)."""
    import torch

    if device.type != "cuda":
        return "CUDA graphs need a CUDA GPU"
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return "one GPU only (FSDP's hooks run between the layers' kernels)"
    if getattr(cfg, "gradient_checkpointing", False) is not True:
        return "gradient checkpointing is off: its checkpoint is what makes the replays safe in training"
    if getattr(cfg, "offload_activations", False):
        return "offload_activations copies the layer inputs between the replays"
    if getattr(cfg, "liger_kernels", None):
        return "Liger's kernels are not measured under CUDA graphs"
    if not getattr(cfg, "packing", False):
        return "unpacked batches vary in width: each width would record graphs of its own"
    return None


def _tokens_per_micro_batch(cfg) -> int | None:
    micro = getattr(cfg, "per_device_train_batch_size", None)
    return micro * int(cfg.max_seq_length) if isinstance(micro, int) else None


def layer_forward_ms(layer: torch.nn.Module, tokens: int | None, device: torch.device) -> float | None:
    """`forward_ms` of this layer's weights on this GPU; None for a GPU whose peak relaytune does not know."""
    import torch

    from relaytune.training.mfu import logical_numel, peak_flops

    if not tokens or device.type != "cuda":
        return None
    peak = peak_flops(torch.cuda.get_device_name(device))
    if not peak:
        return None
    weights = sum(logical_numel(p) for p in layer.parameters() if p.dim() >= 2 or hasattr(p, "quant_state"))
    return forward_ms(weights, tokens, peak)
