"""A whole plan for one run config on one GPU: memory, verdict, micro-batch, checkpoints, disk, speed and ETA."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from relaytune.errors import UserError
from relaytune.plan.advice import (
    MARGIN,
    Change,
    CheckpointingOff,
    changes_when_nothing_fits,
    checkpoint_in_force,
    checkpointing_off,
    choose_auto,
    fit_status,
    largest_micro_batch,
    largest_with_offload,
)
from relaytune.plan.architectures import Architecture
from relaytune.plan.gpus import Gpu
from relaytune.plan.memory import (
    GIB,
    MemoryEstimate,
    Settings,
    estimate_memory,
    lora_tensor_sizes,
    optimizer_bytes,
    uses_chunked_loss,
)
from relaytune.plan.sources import resolve_architecture
from relaytune.plan.throughput import Eta, Throughput, estimate_eta, estimate_throughput

CHECKPOINT_EXTRA = 64 * 1024  # trainer state, RNG states, metrics history and manifest, as measured
UNLIMITED_KEEP = 10  # save_total_limit unset keeps every checkpoint; the preflight counts this many too


def settings_from_config(cfg, gpu: Gpu, labelled_fraction: float = 1.0, shards: int = 1) -> Settings:
    """Settings from a TrainConfig (or anything with its field names), precision chosen as relaytune would;
    `shards`: the processes FSDP shards the frozen base over."""
    if cfg.bf16 and not gpu.bf16:
        dtype = "fp16"  # relaytune falls back to fp16 with a gradient scaler, with a notice
    elif cfg.fp16:
        dtype = "fp16"
    elif cfg.bf16 is False:
        dtype = "fp32"
    else:
        dtype = gpu.precision
    quant = (getattr(cfg, "bnb_4bit_quant_type", "nf4") if cfg.load_in_4bit else
             "int8" if cfg.load_in_8bit else "none")
    targets = cfg.lora_target_modules
    return Settings(
        max_seq_length=cfg.max_seq_length, quantization=quant,
        double_quant=getattr(cfg, "bnb_4bit_use_double_quant", True), compute_dtype=dtype, optim=cfg.optim,
        lora_r=cfg.lora_r, lora_target_modules=targets if isinstance(targets, str) else tuple(targets),
        lora_dropout=cfg.lora_dropout, save_only_model=cfg.save_only_model, labelled_fraction=labelled_fraction,
        compiled_layers=compiles_layers(getattr(cfg, "torch_compile", "auto"), gpu, sharded=shards > 1),
        offload_activations=bool(getattr(cfg, "offload_activations", False)),
        adapter_bytes=2 if getattr(cfg, "adapter_dtype", "float32") == "bfloat16" else 4,
        graphs=graphs_setting(cfg, gpu, dtype), graphs_peak_flops=(gpu.tflops or 0.0) * 1e12,
        offload_embeddings=offload_setting(cfg),
        compile_checkpoint=checkpoint_setting(cfg), shards=shards,
        liger_kernels=tuple(getattr(cfg, "liger_kernels", None) or ()))


def checkpoint_setting(cfg) -> str:
    """compile_checkpoint as speedups.py resolves it: auto is off under FSDP (fsdp.load_settings) and
    beside liger_kernels."""
    setting = getattr(cfg, "compile_checkpoint", False)
    if setting is False or (setting == "auto" and (getattr(cfg, "fsdp", False) is True
                                                   or getattr(cfg, "liger_kernels", None))):
        return "off"
    return "on" if setting is True else "auto"


def offload_setting(cfg) -> str:
    """offload_embeddings as embedding_offload.py resolves it on a GPU: off under FSDP (the table is sharded)."""
    setting = getattr(cfg, "offload_embeddings", False)
    if setting is False or getattr(cfg, "fsdp", False) is True:
        return "off"
    return "on" if setting is True else "auto"


def graphs_setting(cfg, gpu: Gpu, dtype: str) -> str:
    """cuda_graphs as training/cuda_graphs.py resolves it on this card: "off", "on", or "auto" (decided
    per micro-batch). They run on one GPU, compiled, packed, nothing offloaded, without Liger's kernels;
    auto in bf16 only."""
    setting = getattr(cfg, "cuda_graphs", "auto")
    runs = (setting is not False and compiles_layers(getattr(cfg, "torch_compile", "auto"), gpu)
            and getattr(cfg, "packing", False) and not getattr(cfg, "offload_activations", False)
            and not getattr(cfg, "liger_kernels", None)
            and getattr(cfg, "num_gpus", 1) in (1, "auto") and getattr(cfg, "fsdp", False) is not True)
    if not runs:
        return "off"
    return "on" if setting is True else "auto" if dtype == "bf16" else "off"


def compiles_layers(setting, gpu: Gpu, sharded: bool = False) -> bool:
    """Whether relaytune will compile the decoder layers on this card, as training/speedups.py decides
    (`auto` is off under FSDP: distributed/fsdp.load_settings)."""
    return setting is True or (setting == "auto" and gpu.compiles and not sharded)


@dataclass
class Plan:
    arch: Architecture
    gpu: Gpu
    settings: Settings
    micro_batch: int
    global_batch: int
    gradient_checkpointing: bool
    memory: MemoryEstimate
    status: str  # fits | tight | does not fit
    best_micro_batch: int | None  # the largest dividing the global batch that fits
    best_any: int | None  # the largest up to the global batch that fits, dividing it or not
    best_memory: MemoryEstimate | None
    gc_off: CheckpointingOff | None  # only when the config has checkpointing on
    gc_off_throughput: Throughput | None
    changes: list[Change]  # only when not even micro-batch 1 fits
    offload_best: int | None  # the largest micro-batch with offload_activations (checkpointing on, offload off)
    checkpoint_bytes: int
    checkpoints_kept: int
    disk_bytes: int
    throughput: Throughput
    steps: int | None
    tokens: float | None
    tokens_note: str
    eta: Eta | None
    notes: list[str] = field(default_factory=list)

    @property
    def accumulation(self) -> int:
        return math.ceil(self.global_batch / self.micro_batch)


def make_plan(cfg, gpu: Gpu, *, arch: Architecture | None = None, rows: int | None = None,
              mean_tokens: float | None = None, labelled_fraction: float = 1.0) -> Plan:
    """Everything `relaytune plan` prints, for a config (TrainConfig field names) on a GPU.

    rows: training rows, if known (else the ETA needs max_steps); mean_tokens: tokens per row, if
    known (else every row is assumed to fill max_seq_length, an upper bound).
    """
    arch = arch or resolve_architecture(cfg.model)
    gpus = getattr(cfg, "num_gpus", 1)
    shards = gpus if getattr(cfg, "fsdp", False) is True and isinstance(gpus, int) and gpus > 1 else 1
    settings = settings_from_config(cfg, gpu, labelled_fraction, shards=shards)
    # `auto` micro-batch / checkpointing: resolved for this card as the trainer would (plan/advice.choose_auto).
    global_batch = getattr(cfg, "global_batch_size", None) or \
        cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps
    micro, gc = choose_auto(arch, settings, gpu, cfg.per_device_train_batch_size, global_batch,
                            cfg.gradient_checkpointing)
    micro = micro or 1
    in_force = checkpoint_in_force(arch, settings, gpu, micro, gc)
    memory = estimate_memory(arch, in_force, micro, gc)
    best = largest_micro_batch(arch, settings, gpu, global_batch, gc)
    best_any = largest_micro_batch(arch, settings, gpu, global_batch, gc, divisors_only=False)
    per_ckpt, kept, disk = checkpoint_disk(arch, settings, cfg.save_total_limit)
    throughput = estimate_throughput(arch, gpu, settings.max_seq_length, gc, settings.quantization,
                                     settings.compute_dtype)
    steps, tokens, note = run_tokens(cfg, global_batch, rows, mean_tokens)
    eta = estimate_eta(tokens, throughput.tokens_per_second) if tokens and throughput.tokens_per_second else None
    return Plan(
        arch=arch, gpu=gpu, settings=settings, micro_batch=micro, global_batch=global_batch,
        gradient_checkpointing=gc, memory=memory, status=fit_status(memory, gpu), best_micro_batch=best,
        best_any=best_any, best_memory=estimate_memory(arch, settings, best, gc) if best else None,
        gc_off=checkpointing_off(arch, settings, gpu, micro, global_batch) if gc else None,
        gc_off_throughput=estimate_throughput(arch, gpu, settings.max_seq_length, False, settings.quantization,
                                              settings.compute_dtype) if gc else None,
        changes=changes_when_nothing_fits(arch, settings, gpu, gc) if best_any is None else [],
        offload_best=largest_with_offload(arch, settings, gpu, global_batch, gc),
        checkpoint_bytes=per_ckpt, checkpoints_kept=kept, disk_bytes=disk, throughput=throughput, steps=steps,
        tokens=tokens, tokens_note=note, eta=eta,
        notes=plan_notes(arch, settings, gpu, cfg) + checkpoint_note(arch, settings, in_force, micro, gc))


def checkpoint_disk(arch: Architecture, settings: Settings, save_total_limit: int | None) -> tuple[int, int, int]:
    """(bytes per checkpoint, checkpoints on disk at once, disk for the run including the final adapter).

    A checkpoint holds the adapter (in adapter_dtype), the whole optimizer state (unless save_only_model) and
    ~64 KiB of JSON; retention deletes only after the next one is committed, so one more is on disk.
    """
    sizes = lora_tensor_sizes(arch, settings)
    adapter = settings.adapter_bytes * sum(sizes)
    per_checkpoint = checkpoint_bytes(sizes, settings.optim, settings.adapter_bytes, settings.save_only_model)
    kept = (save_total_limit or UNLIMITED_KEEP) + 1
    return per_checkpoint, kept, kept * per_checkpoint + adapter + CHECKPOINT_EXTRA


def checkpoint_bytes(sizes: list[int], optim: str, adapter_bytes: int, save_only_model: bool) -> int:
    """One checkpoint on disk, for adapter tensors of these sizes: the adapter (adapter_bytes per value),
    the whole optimizer state unless save_only_model (paged or not, it is all saved), and the JSON."""
    optimizer = 0 if save_only_model else sum(optimizer_bytes(sizes, optim, adapter_bytes))
    return adapter_bytes * sum(sizes) + optimizer + CHECKPOINT_EXTRA


def run_tokens(cfg, global_batch: int, rows: int | None, mean_tokens: float | None):
    """(optimizer steps, tokens the run trains on, how that was reached); None where not known."""
    seq = cfg.max_seq_length
    per_row = min(float(mean_tokens), seq) if mean_tokens else float(seq)
    basis = (f"rows of {per_row:,.0f} tokens on average" if mean_tokens
             else f"every row filling max_seq_length ({seq}), an upper bound")
    units = rows
    if cfg.packing and rows and mean_tokens:
        units = math.ceil(rows * per_row / seq)  # packed sequences of max_seq_length
        per_row = float(seq)
        basis = f"{rows:,} rows packed into about {units:,} sequences of {seq}"
    if cfg.max_steps and cfg.max_steps > 0:
        steps = cfg.max_steps
    elif units:
        steps = max(1, math.ceil(cfg.num_train_epochs * math.ceil(units / global_batch)))
    else:
        return None, None, ("the number of rows is not known (a Hub dataset, or several files); set "
                            "max_steps or pass --rows N to get a time estimate")
    tokens = steps * global_batch * per_row
    return steps, tokens, f"{steps:,} steps x {global_batch} rows, assuming {basis}"


def plan_notes(arch: Architecture, settings: Settings, gpu: Gpu, cfg) -> list[str]:
    notes = list(arch.notes)
    if cfg.bf16 and not gpu.bf16:
        notes.append(f"{gpu.name} has no bf16: relaytune trains in fp16 with a gradient scaler")
    if settings.labelled_fraction >= 1.0:
        notes.append("memory assumes every row of a micro-batch reaches max_seq_length and every token is "
                     "labelled (the worst case a step can meet)")
    if settings.compiled_layers:
        notes.append("each decoder layer compiled (torch_compile: auto), which saves fewer activations than "
                     "eager layers; with torch_compile: false the estimate is for eager layers")
    if getattr(cfg, "liger_kernels", None):
        notes.append("liger_kernels: their SwiGLU's in-place backward is counted at the least its H100 "
                     "measurements saved, so the memory here is an upper bound")
    if settings.compiled_layers and "rms_norm" in settings.liger_kernels:
        notes.append("liger_kernels: rms_norm saves no memory in compiled layers, which already keep the norm's "
                     "input in the compute dtype, and it cost 2% of tokens/s beside swiglu on an H100; "
                     "liger_kernels: [swiglu] keeps the saving")
    if not uses_chunked_loss(arch):
        notes.append(f"{arch.model_type} computes its loss through the model's own forward (full logits); "
                     "longer sequences cost much more memory than with relaytune's chunked loss")
    return notes


def checkpoint_note(arch: Architecture, settings: Settings, in_force: Settings, micro: int, gc: bool) -> list[str]:
    """Why `compile_checkpoint: auto` keeps the checkpoint outside the layers at this micro-batch, if it does."""
    if in_force is settings:
        return []
    inside = estimate_memory(arch, settings, micro, gc).total_allocated / GIB
    return [f"compile_checkpoint: auto keeps the checkpoint outside the layers at micro-batch {micro}: compiled "
            f"inside them it would take {inside:.2f} GiB, more than this card holds with a {MARGIN:.0%} margin"]


def check_plan_inputs(rows: int | None, mean_tokens: float | None) -> None:
    if rows is not None and rows < 1:
        raise UserError("--rows must be at least 1")
    if mean_tokens is not None and mean_tokens <= 0:
        raise UserError("--mean-tokens must be greater than 0")
