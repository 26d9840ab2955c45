"""Checks before the model loads (GPU memory) and before training (disk), printed as one table.

A dead notebook's process can keep most of a GPU after an OOM, and the next model load then
fails again: we look first and say so plainly.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from relaytune.config.schema import TrainConfig
from relaytune.errors import UserError
from relaytune.log import info, warn

GIB = 1024 ** 3


@dataclass
class Report:
    rows: list[tuple[str, str]] = field(default_factory=list)

    def add(self, what: str, value: str) -> None:
        self.rows.append((what, value))

    def print(self) -> None:
        width = max((len(w) for w, _ in self.rows), default=0)
        info("preflight:\n" + "\n".join(f"  {w.ljust(width)}  {v}" for w, v in self.rows))


def estimate_model_bytes(cfg: TrainConfig, model_dir: str | None, dtype_bytes: float) -> int | None:
    """Weights in memory, from the config's shapes and the load dtype (a first estimate)."""
    try:
        from transformers import AutoConfig

        mc = AutoConfig.from_pretrained(model_dir, trust_remote_code=cfg.trust_remote_code)
        h, layers = mc.hidden_size, mc.num_hidden_layers
        inter = getattr(mc, "intermediate_size", 4 * h)
        heads = mc.num_attention_heads
        kv = getattr(mc, "num_key_value_heads", heads) or heads
        head_dim = getattr(mc, "head_dim", None) or h // heads
        attn = h * heads * head_dim * 2 + h * kv * head_dim * 2
        per_layer = attn + 3 * h * inter
        embed = mc.vocab_size * h * (1 if getattr(mc, "tie_word_embeddings", False) else 2)
    except Exception:  # an unknown architecture: no estimate rather than a wrong one
        return None
    bits = 4.5 if cfg.load_in_4bit else 8 if cfg.load_in_8bit else dtype_bytes * 8
    return int(layers * per_layer * bits / 8 + embed * dtype_bytes)


def check_gpu(report: Report, need_bytes: int | None, env_free: tuple[int, int] | None = None) -> None:
    """Free and total memory per GPU; name who holds it if far below total."""
    if not torch.cuda.is_available():
        report.add("GPU", "none (training on CPU)")
        return
    for i in range(torch.cuda.device_count()):
        free, total = env_free or torch.cuda.mem_get_info(i)
        mine = torch.cuda.memory_reserved(i)
        others = max(total - free - mine, 0)
        report.add(f"GPU {i}", f"{torch.cuda.get_device_name(i)}: {free / GIB:.1f} GiB free of {total / GIB:.1f} GiB")
        if mine > 0.5 * GIB:
            warn(f"this process already holds {mine / GIB:.1f} GiB on GPU {i} (an earlier run or "
                 "model in this notebook?); in a notebook, restart the kernel to free it")
        if others > 0.25 * total:
            warn(f"another process holds {others / GIB:.1f} GiB on GPU {i}; if it is a dead run, "
                 "stop it (nvidia-smi lists it); in a notebook, restart the kernel")
        if need_bytes and i == 0 and need_bytes > free:
            raise UserError(
                f"GPU {i} has {free / GIB:.1f} GiB free; the model alone needs about "
                f"{need_bytes / GIB:.1f} GiB. Free the GPU (see above), or use load_in_4bit: true")


def predicted_checkpoint_bytes(model, cfg: TrainConfig) -> int:
    """One checkpoint: the fp32 adapter, the optimizer's two moments, a little JSON and RNG."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    adapter = trainable * 4
    if cfg.save_only_model:
        moments = 0
    elif cfg.optim == "adamw_torch":
        moments = trainable * 8
    else:  # 8-bit moments plus one fp32 absmax per block of 256
        moments = trainable * 2 + trainable // 256 * 8
    return adapter + moments + 64 * 1024


def check_disk(report: Report, output_dir: Path, per_checkpoint: int, cfg: TrainConfig, adapter_bytes: int) -> None:
    keep = (cfg.save_total_limit or 10) + 1  # +1: retention deletes only after the new one is committed
    need = keep * per_checkpoint + adapter_bytes
    free = shutil.disk_usage(output_dir).free
    report.add("checkpoint", f"about {per_checkpoint / 2**20:.1f} MiB each; "
                             f"{keep} at once + final = {need / 2**20:.1f} MiB")
    report.add("disk", f"{free / GIB:.1f} GiB free at {output_dir}")
    if free < need:
        raise UserError(
            f"{output_dir} has {free / 2**20:.0f} MiB free, but the run needs about {need / 2**20:.0f} MiB "
            f"({keep} checkpoints of {per_checkpoint / 2**20:.1f} MiB at once, plus the final adapter). "
            "Free space, lower save_total_limit, set save_only_model: true (a resume is then not exact), "
            "or choose another output_dir.")
