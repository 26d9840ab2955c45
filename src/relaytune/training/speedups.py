"""GPU speed-ups applied once to a loaded model: document-masked attention and regional compilation.

`apply_speedups(model, cfg, precision)` runs at the end of `model.load_model` and returns what it
applied, in words. Both levers keep the maths (equal to eager SDPA within rounding) and both fail
safe: whatever cannot run here is left off with a notice, never a crash.

- attention (packed batches): FlexAttention or FlashAttention's varlen kernel, with the batch's
  documents described once per batch (training/attention.py). Packed micro-batches are padded to
  max_seq_length (`batch_width`). Padded batches keep SDPA and its fast path.
- torch_compile: every decoder layer's forward is compiled (regional compilation, as torchtune and
  the PyTorch recipe do), after PEFT wrapping and inside gradient checkpointing (relaytune.layers
  keeps the checkpoint outside the compiled region). Layers of one model share one graph, so
  warm-up is one layer's compile (printed after the first step). bitsandbytes' 4-bit linear layers
  in them run as torch ops when compiled (relaytune.linear4bit), so Inductor fuses dequantization.
  Recompilations are bounded (RECOMPILE_LIMIT) and logged; a compile error runs that code eagerly
  (`torch._dynamo.config.suppress_errors`). Where the host bounds the step, the compiled layers
  replay CUDA graphs (`cuda_graphs`; when: training/cuda_graphs.py, how: layers.RecomputedLayer).

On the CPU both default to off. torch_compile: true works there (inductor C++); neither attention
kernel trains there, so packed batches keep SDPA.
"""

from __future__ import annotations

import contextlib
import os
import shutil

import torch

from relaytune.embedding_offload import offload_decision
from relaytune.layers import checkpoints_inside, compile_layers, decoder_layers, is_compiled, uncompile_layers
from relaytune.linear4bit import fuse_4bit_linears, unfuse_4bit_linears, unfused_4bit_linears
from relaytune.log import info, notice, warn
from relaytune.training import attention, hardware
from relaytune.training.cuda_graphs import graphs_decision
from relaytune.training.warmup import WarmUpTimer, start_clean

RECOMPILE_LIMIT = 16  # graphs per compiled code object: train/eval x a few shapes; beyond it, eager
MIN_COMPILE_SM = (7, 0)  # Triton's floor
MIN_COMPILE_TORCH = (2, 6)


def apply_speedups(model, cfg, precision) -> list[str]:
    """Document-masked attention and regional compilation as the config and hardware allow; what was
    applied."""
    applied: list[str] = []
    for name, lever in (("attention", attention.apply_attention), ("compile", _apply_compile)):
        try:
            applied += lever(model, cfg, precision)
        except Exception as e:  # noqa: BLE001  (a speed-up must never stop a run)
            warn(f"{name}: could not be applied ({type(e).__name__}: {e}); continuing without it")
    if applied:
        info("speed-ups: " + "; ".join(applied))
    try:
        model.relaytune_speedups = list(applied)  # for the preflight table
    except Exception:  # noqa: BLE001
        pass
    return applied


# --- regional compilation --------------------------------------------------------------------
def compile_decision(setting, device) -> tuple[bool, str | None]:
    """(compile?, why not, when the user asked for it or should know)."""
    if setting is False:
        return False, None
    asked = setting is True
    if hardware.torch_version() < MIN_COMPILE_TORCH:
        return False, f"torch {torch.__version__} is older than 2.6" if asked else None
    cap = hardware.capability(device)
    if cap is None:  # the CPU
        if not asked:
            return False, None  # auto: off, so CPU runs stay byte-identical
        if not (shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")):
            return False, "no C++ compiler for inductor on the CPU"
        return True, None
    if cap < MIN_COMPILE_SM:
        return False, f"compute capability {cap[0]}.{cap[1]} is below 7.0 (Triton)"
    if not hardware.has_triton():
        return False, "Triton is not installed"
    return True, None


def _apply_compile(model, cfg, precision) -> list[str]:
    want, why = compile_decision(getattr(cfg, "torch_compile", "auto"), precision.device)
    if not want:
        if why:
            notice(f"torch_compile: off ({why})")
        return []
    layers = decoder_layers(model)
    if not layers:
        notice("torch_compile: off (no decoder layers found in this model)")
        return []
    configure_dynamo()
    start_clean()
    WarmUpTimer.install(model)
    graphs, why = graphs_decision(cfg, precision.device, layers, bf16=precision.autocast == torch.bfloat16)
    if graphs and attention.in_use(model) == "varlen":
        graphs, why = False, "varlen attention's document starts change shape with every batch; graphs replay one"
    if why:
        notice(f"cuda_graphs: off ({why})")
    inside = checkpoint_inside_decision(cfg, graphs, model, precision.device)
    try:
        fused = fuse_4bit_linears(layers, precision.autocast)
        kept = unfused_4bit_linears(layers) if inside else 0
        if kept:
            inside = False
            notice(f"compile_checkpoint: off ({kept} 4-bit matmuls stay bitsandbytes' own ops, and a compiled "
                   "checkpoint would keep each one's dequantized weight for backward)")
        compile_layers(layers, cuda_graphs=graphs, checkpoint_inside=inside)
    except Exception:
        uncompile_layers(layers)  # all or none
        unfuse_4bit_linears(layers)
        raise
    inside = any(map(checkpoints_inside, layers))
    if getattr(cfg, "compile_checkpoint", False) is True and graphs:
        notice("compile_checkpoint: off (the layers replay CUDA graphs, which checkpoint their own way)")
    elif getattr(cfg, "compile_checkpoint", False) is True and not inside and not kept:
        notice("compile_checkpoint: not yet (gradient checkpointing is off as the model loads; the checkpoint "
               "is compiled with each layer if the trial step turns it on)")
    return [f"torch.compile on each of {len(layers)} decoder layers"
            + (f" ({fused} 4-bit matmuls as torch ops)" if fused else "") + (", CUDA graphs" if graphs else "")
            + (", checkpoint compiled inside" if inside else "")]


def checkpoint_inside_decision(cfg, graphs: bool, model, device: torch.device) -> bool:
    """compile_checkpoint: whether a compiled layer's checkpoint is compiled with it (config checks
    refuse `true` beside the settings that rule it out; auto gives way to them). auto takes it only
    where the input embedding goes to host memory (offload_embeddings), which pays for its higher
    backward peak: elsewhere (a tied embedding, as Qwen2.5's) it would raise the peak above TRL's."""
    setting = getattr(cfg, "compile_checkpoint", False)
    if setting is False or graphs or getattr(cfg, "offload_activations", False) or getattr(cfg, "liger_kernels", None):
        return False
    if setting is True:
        return True
    offloaded, _ = offload_decision(getattr(cfg, "offload_embeddings", False), model, device, sharded=False)
    return offloaded


def batch_width(model, cfg) -> int | None:
    """The width every packed training micro-batch is padded to when the layers are compiled or a
    document-masked attention runs (FlexAttention's kernel is compiled too; varlen's longest document
    is then the width, one constant for the whole run).

    Packed rows never exceed max_seq_length and nearly fill it, so padding them to it costs a few
    positions, and the compiled layers see one shape for the whole run. Otherwise the first batch
    of another length recompiles every layer with a symbolic sequence length (dynamo's automatic
    dynamic shapes), which took the first two packed steps to about a minute on an H200. The
    padding is a sample of its own with no targets (`data.batches.collate`): the loss is unchanged.
    Padded (unpacked) batches keep their own width: their rows are often much shorter."""
    if not getattr(cfg, "packing", False):
        return None
    compiled = [is_compiled(layer) for layer in decoder_layers(model)]
    return int(cfg.max_seq_length) if (compiled and all(compiled)) or attention.in_use(model) else None


# Dynamo's settings as the run found them, put back when it ends (restore_compiler_settings).
_compiler_settings = contextlib.ExitStack()
# Set by layers.compile_layers for a compiled checkpoint; put back with the rest.
_SIDE_EFFECTS = "skip_fwd_side_effects_in_bwd_under_checkpoint"


def configure_dynamo() -> None:
    """Bounded recompilation, logged; compile errors fall back to eager instead of raising. These are
    the process's settings (the calling thread's, in torch 2.13): the run puts them back as it ends, so
    a notebook's own torch.compile afterwards raises its errors and keeps torch's limits. The
    recompile logging stays on: torch has no way to read back the logging it replaces."""
    import torch._dynamo.config as dynamo

    _compiler_settings.close()  # a run that never ended (its Trainer never closed) found the originals
    changes = {"suppress_errors": True}
    changes.update({name: RECOMPILE_LIMIT for name in ("recompile_limit", "cache_size_limit")  # new name, old
                    if hasattr(dynamo, name)})
    if hasattr(dynamo, _SIDE_EFFECTS):
        changes[_SIDE_EFFECTS] = getattr(dynamo, _SIDE_EFFECTS)
    _compiler_settings.enter_context(dynamo.patch(changes))
    if "TORCH_LOGS" not in os.environ:  # the user's own logging setting wins
        try:
            torch._logging.set_logs(recompiles=True)
        except Exception:  # noqa: BLE001
            pass


def restore_compiler_settings() -> None:
    """Puts back the Dynamo settings configure_dynamo found (at the end of a run)."""
    _compiler_settings.close()
