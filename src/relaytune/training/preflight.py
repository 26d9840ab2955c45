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
from relaytune.distributed.world import local_size
from relaytune.errors import UserError
from relaytune.log import info, warn
from relaytune.plan import checkpoint_bytes

GIB = 1024 ** 3
HOST_SHARE = 0.8  # of the host's available memory that offloaded activations may pin (the rest: data, Python)


@dataclass
class Report:
    rows: list[tuple[str, str]] = field(default_factory=list)

    def add(self, what: str, value: str) -> None:
        self.rows.append((what, value))

    def print(self) -> None:
        width = max((len(w) for w, _ in self.rows), default=0)
        info("preflight:\n" + "\n".join(f"  {w.ljust(width)}  {v}" for w, v in self.rows))


def check_gpu(report: Report, frozen_bytes: int | None, env_free: tuple[int, int] | None = None) -> None:
    """Free and total memory per GPU; name who holds it if far below total; refuse when the model's
    frozen weights alone (the memory planner's part, training/autobatch.py) exceed the free memory of
    a GPU this run trains on: GPU 0, or with several ranks on this host, GPUs 0..LOCAL_WORLD_SIZE-1.
    Every rank checks all of them, so all ranks refuse together (exit 2) rather than one alone."""
    if not torch.cuda.is_available():
        report.add("GPU", "none (training on CPU)")
        return
    used = local_size()  # the local rank picks the GPU
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
        if frozen_bytes and i < used and frozen_bytes > free:
            raise UserError(
                f"GPU {i} has {free / GIB:.1f} GiB free; the model's weights alone need about "
                f"{frozen_bytes / GIB:.1f} GiB. Free the GPU (see above), or use load_in_4bit: true")


def memory_rows(report: Report, estimate, micro_batch: int, gradient_checkpointing: bool) -> None:
    """The planner's peak on this GPU at the micro-batch and checkpointing in force (was a weights-only figure)."""
    if not torch.cuda.is_available():
        return
    if estimate is None:
        report.add("memory", "not planned (the planner does not know this model)")
        return
    report.add("memory", f"peak {estimate.total_allocated / GIB:.2f} GiB allocated, "
                         f"{estimate.total_reserved / GIB:.2f} GiB on the card (planned at micro-batch {micro_batch}, "
                         f"checkpointing {'on' if gradient_checkpointing else 'off'}); "
                         f"frozen weights {estimate.parts['frozen weights'] / GIB:.2f} GiB")


def check_built(report: Report, model, cfg: TrainConfig, auto, precision, output_dir: Path) -> None:
    """The checks that need the built model: the planned peak at the micro-batch in force (`auto`, an
    autobatch.AutoChoice), the host memory offloading pins, and the disk its checkpoints need."""
    memory_rows(report, auto.estimate, auto.micro_batch, auto.gradient_checkpointing)
    check_offload(report, model, cfg, auto.micro_batch, auto.gradient_checkpointing, precision)
    per_checkpoint = predicted_checkpoint_bytes(model, cfg)
    check_disk(report, output_dir, per_checkpoint, cfg, per_checkpoint // 3)


def predicted_checkpoint_bytes(model, cfg: TrainConfig) -> int:
    """One checkpoint of this model's trainable tensors, by the planner's arithmetic (plan.checkpoint_bytes)."""
    params = [p for p in model.parameters() if p.requires_grad]
    adapter_bytes = params[0].element_size() if params else 4
    return checkpoint_bytes([p.numel() for p in params], cfg.optim, adapter_bytes, cfg.save_only_model)


def check_offload(report: Report, model, cfg: TrainConfig, micro_batch: int, gradient_checkpointing: bool,
                  precision, available: int | None = None) -> None:
    """offload_activations pins every layer's input of a micro-batch in host memory (each block rounded up to
    a power of two, as torch's pinned allocator does): say how much, and refuse (exit 2) what this host cannot
    hold, since the kernel would kill the run at that step on every re-run. Ranks on one host each pin their
    own. Nothing is pinned on the CPU or without checkpointing."""
    if not (cfg.offload_activations and gradient_checkpointing and precision.device.type == "cuda"):
        return
    seq, activation_bytes = cfg.max_seq_length, (precision.autocast or precision.dtype).itemsize
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    text = getattr(base.config, "get_text_config", lambda: base.config)()
    ranks = local_size()
    # torch's pinned-memory allocator rounds each block up to a power of two (CachingHostAllocator.h).
    per_input = micro_batch * seq * text.hidden_size * activation_bytes
    need = ranks * text.num_hidden_layers * (1 << (per_input - 1).bit_length())
    available = host_available_bytes() if available is None else available
    where = f"{available / GIB:.1f} GiB available" if available else "available memory unknown"
    report.add("offload", f"{need / GIB:.2f} GiB of pinned host memory for the layer inputs ({where})")
    if available and need > HOST_SHARE * available:
        raise UserError(
            f"offload_activations: true pins about {need / GIB:.1f} GiB of host memory for the layer inputs "
            f"(micro-batch {micro_batch} x {seq} tokens x {text.num_hidden_layers} layers"
            f"{f' x {ranks} processes' if ranks > 1 else ''}), and this machine has {available / GIB:.1f} GiB "
            "available; lower per_device_train_batch_size (the global batch can stay) or max_seq_length, "
            "or set offload_activations: false")


def host_available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux: Colab, Kaggle, SLURM nodes); None elsewhere."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


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
