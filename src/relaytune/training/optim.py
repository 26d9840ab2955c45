"""Optimizer and learning-rate schedule, as HF TrainingArguments define them."""

from __future__ import annotations

import math

import torch

from relaytune import faults
from relaytune.config.schema import TrainConfig
from relaytune.log import warn


def build_optimizer(cfg: TrainConfig, model) -> torch.optim.Optimizer:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            # As HF Trainer: no decay on biases and norms.
            (no_decay if p.ndim < 2 or "norm" in name.lower() else decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    kwargs = dict(lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon)
    if cfg.optim == "adamw_torch":
        return torch.optim.AdamW(groups, fused=fusable(decay + no_decay) or None, **kwargs)
    import bitsandbytes as bnb

    cls = bnb.optim.PagedAdamW8bit if cfg.optim == "paged_adamw_8bit" else bnb.optim.AdamW8bit
    return cls(groups, **kwargs)


def fusable(params: list[torch.Tensor]) -> bool:
    """Whether AdamW runs as one fused kernel: plain CUDA tensors (LoRA's weights are, also under FSDP,
    which leaves them unsharded; a DTensor would not be). It is the same update as the per-tensor
    kernels up to float rounding (it computes the bias corrections in float32 on the GPU), in one
    launch instead of hundreds, and it can skip a non-finite step on the GPU (step.py), so the host
    never waits for the loss before queuing the update. Hugging Face's Trainer uses it by default on
    torch >= 2.8 too. The CPU keeps the per-tensor path, on which its exact-resume tests are
    byte-identical."""
    cpu_too = faults.fused_adamw()  # a test plan runs this path on the CPU as well
    return bool(params) and all(type(p.data) is torch.Tensor and (p.is_cuda or cpu_too) and p.is_floating_point()
                                for p in params)


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """A fused torch AdamW: it reads `found_inf` on the GPU and leaves weights, moments and step
    count untouched when it is non-zero."""
    return isinstance(optimizer, torch.optim.AdamW) and all(g.get("fused") for g in optimizer.param_groups)


def warmup_steps(cfg: TrainConfig, total: int) -> int:
    return cfg.warmup_steps if cfg.warmup_steps > 0 else math.ceil(cfg.warmup_ratio * total)


def build_scheduler(cfg: TrainConfig, optimizer, total: int):
    from transformers import get_scheduler

    return get_scheduler(cfg.lr_scheduler_type, optimizer,
                         num_warmup_steps=warmup_steps(cfg, total), num_training_steps=total)


def warn_short_schedule(cfg, total: int) -> None:
    """Hugging Face's Trainer accepts a warmup as long as the run too; with max_steps set, the config
    already said so."""
    warmup = warmup_steps(cfg, total)
    if warmup >= total and cfg.max_steps <= 0:
        warn(f"warmup ({warmup} steps) is not shorter than the run ({total} steps): the learning "
             "rate never reaches its peak; training goes on as configured, as Hugging Face's Trainer does")
