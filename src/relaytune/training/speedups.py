"""GPU speed-ups applied once to a loaded model: regional compilation and document-masked attention.

`apply_speedups(model, cfg, precision)` runs at the end of `model.load_model` and returns what it
applied, in words. Both levers keep the maths (equal to eager SDPA within rounding) and both fail
safe: whatever cannot run here is left off with a notice, never a crash.

- torch_compile: every decoder layer's forward is compiled (regional compilation, as torchtune and
  the PyTorch recipe do), after PEFT wrapping and inside gradient checkpointing (relaytune.layers
  keeps the checkpoint outside the compiled region). Layers of one model share one graph, so
  warm-up is one layer's compile (printed after the first step). bitsandbytes' 4-bit linear layers
  in them run as torch ops when compiled (relaytune.linear4bit), so Inductor fuses dequantization.
  Recompilations are bounded (RECOMPILE_LIMIT) and logged; a compile error runs that code eagerly
  (`torch._dynamo.config.suppress_errors`). Where the host bounds the step, the compiled layers
  replay CUDA graphs (`cuda_graphs`; when: training/cuda_graphs.py, how: layers.RecomputedLayer).
- attention (packed batches; auto: on Hopper-class GPUs, see flex_decision): the model's attention
  becomes `relaytune_flex`, which runs FlexAttention when it is handed a BlockMask and SDPA
  otherwise. Packed micro-batches are padded to max_seq_length (`batch_width`). A forward pre-hook on the
  decoder builds one BlockMask per batch from the packed position_ids (causal AND same document,
  `training/document_mask.py`) and passes it as the attention mask, which transformers hands
  unchanged to every layer. Padded batches (they come with an attention_mask) keep SDPA and its
  fast path.

On the CPU both default to off. torch_compile: true works there (inductor C++); FlexAttention has
no backward on the CPU, so attention: flex falls back to SDPA for training there.
"""

from __future__ import annotations

import os
import shutil

import torch

from relaytune.embedding_offload import offload_decision
from relaytune.layers import checkpoints_inside, compile_layers, decoder_layers, is_compiled, uncompile_layers
from relaytune.linear4bit import fuse_4bit_linears, unfuse_4bit_linears, unfused_4bit_linears
from relaytune.log import info, notice, warn
from relaytune.training import document_mask
from relaytune.training.cuda_graphs import graphs_decision
from relaytune.training.warmup import WarmUpTimer

RECOMPILE_LIMIT = 16  # graphs per compiled code object: train/eval x a few shapes; beyond it, eager
ATTENTION_NAME = "relaytune_flex"
MIN_COMPILE_SM = (7, 0)  # Triton's floor
MIN_FLEX_SM = (7, 5)  # T4 and newer, as torchtune gates it
MIN_COMPILE_TORCH = (2, 6)
AUTO_FLEX_SHARED_MEMORY = 227 * 1024  # bytes a block may use on an H100/H200 (232,448)


def apply_speedups(model, cfg, precision) -> list[str]:
    """Regional compilation and flex attention as the config and hardware allow; what was applied."""
    applied: list[str] = []
    for lever in (_apply_attention, _apply_compile):
        try:
            applied += lever(model, cfg, precision)
        except Exception as e:  # noqa: BLE001  (a speed-up must never stop a run)
            warn(f"{lever.__name__[7:]}: could not be applied ({type(e).__name__}: {e}); continuing without it")
    if applied:
        info("speed-ups: " + "; ".join(applied))
    try:
        model.relaytune_speedups = list(applied)  # for the preflight table
    except Exception:  # noqa: BLE001
        pass
    return applied


# --- helpers ---------------------------------------------------------------------------------
def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def _capability(device) -> tuple[int, int] | None:
    if getattr(device, "type", None) != "cuda" or not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability(device))


def _has_triton() -> bool:
    try:
        from torch.utils._triton import has_triton

        return bool(has_triton())
    except Exception:  # noqa: BLE001
        return False


def _base(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


# --- regional compilation --------------------------------------------------------------------
def compile_decision(setting, device) -> tuple[bool, str | None]:
    """(compile?, why not, when the user asked for it or should know)."""
    if setting is False:
        return False, None
    asked = setting is True
    if _torch_version() < MIN_COMPILE_TORCH:
        return False, f"torch {torch.__version__} is older than 2.6" if asked else None
    cap = _capability(device)
    if cap is None:  # the CPU
        if not asked:
            return False, None  # auto: off, so CPU runs stay byte-identical
        if not (shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")):
            return False, "no C++ compiler for inductor on the CPU"
        return True, None
    if cap < MIN_COMPILE_SM:
        return False, f"compute capability {cap[0]}.{cap[1]} is below 7.0 (Triton)"
    if not _has_triton():
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
    WarmUpTimer.install(model)
    graphs, why = graphs_decision(cfg, precision.device, layers, bf16=precision.autocast == torch.bfloat16)
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
    if setting is False or graphs or getattr(cfg, "offload_activations", False):
        return False
    if setting is True:
        return True
    offloaded, _ = offload_decision(getattr(cfg, "offload_embeddings", False), model, device, sharded=False)
    return offloaded


def batch_width(model, cfg) -> int | None:
    """The width every packed training micro-batch is padded to when the layers are compiled or
    FlexAttention runs (its kernel is compiled too).

    Packed rows never exceed max_seq_length and nearly fill it, so padding them to it costs a few
    positions, and the compiled layers see one shape for the whole run. Otherwise the first batch
    of another length recompiles every layer with a symbolic sequence length (dynamo's automatic
    dynamic shapes), which took the first two packed steps to about a minute on an H200. The
    padding is a sample of its own with no targets (`data.batches.collate`): the loss is unchanged.
    Padded (unpacked) batches keep their own width: their rows are often much shorter."""
    if not getattr(cfg, "packing", False):
        return None
    compiled = [is_compiled(layer) for layer in decoder_layers(model)]
    flex = getattr(_base(model).config, "_attn_implementation", None) == ATTENTION_NAME
    return int(cfg.max_seq_length) if (compiled and all(compiled)) or flex else None


def configure_dynamo() -> None:
    """Bounded recompilation, logged; compile errors fall back to eager instead of raising."""
    import torch._dynamo.config as dynamo

    for name in ("recompile_limit", "cache_size_limit"):  # the new name (2.7+) and the old
        if hasattr(dynamo, name):
            setattr(dynamo, name, RECOMPILE_LIMIT)
    dynamo.suppress_errors = True
    if "TORCH_LOGS" not in os.environ:  # the user's own logging setting wins
        try:
            torch._logging.set_logs(recompiles=True)
        except Exception:  # noqa: BLE001
            pass


# --- document-masked attention -----------------------------------------------------------------
def flex_decision(setting: str, packing: bool, device) -> tuple[bool, str | None]:
    """(FlexAttention?, why not, when the user asked for it). auto takes it for packed batches on
    GPUs that give a block AUTO_FLEX_SHARED_MEMORY of shared memory (Hopper, datacenter Blackwell):
    there it was measured (bench/results/vs-trl-h200.md); on GPUs with less, its default Triton
    kernels have failed to compile for lack of it in reported cases (sm_86/89/120:
    pytorch/pytorch#133254, #180278), so auto keeps SDPA there and flex stays one setting away."""
    if setting == "sdpa":
        return False, None
    asked = setting == "flex"
    if not packing:
        return False, "only packed batches use it; padded batches keep SDPA" if asked else None
    cap = _capability(device)
    if cap is None:
        return False, "FlexAttention has no backward on the CPU; using SDPA" if asked else None
    if cap < MIN_FLEX_SM:
        return False, f"compute capability {cap[0]}.{cap[1]} is below 7.5" if asked else None
    if not asked and _shared_memory_per_block(device) < AUTO_FLEX_SHARED_MEMORY:
        return False, None
    if not _has_triton():
        return False, "Triton is not installed" if asked else None
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError:
        return False, f"torch {torch.__version__} has no FlexAttention"
    return True, None


def _shared_memory_per_block(device) -> int:
    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "shared_memory_per_block_optin", 0))


def flex_blocker(config) -> str | None:
    """Why this model's attention is not plain causal softmax attention (then SDPA stays)."""
    if float(getattr(config, "attention_dropout", 0.0) or 0.0) > 0:
        return "the model has attention dropout"
    if getattr(config, "attn_logit_softcapping", None):
        return "the model soft-caps attention logits"
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        if any(t != "full_attention" for t in layer_types):
            return "the model has sliding-window or other non-full attention layers"
    elif getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return "the model uses sliding-window attention"
    return None


def _apply_attention(model, cfg, precision) -> list[str]:
    want, why = flex_decision(getattr(cfg, "attention", "auto"), bool(getattr(cfg, "packing", False)),
                              precision.device)
    if not want:
        if why:
            notice(f"attention: flex off ({why})")
        return []
    blocker = flex_blocker(_base(model).config)
    if blocker:
        notice(f"attention: flex off ({blocker}); using SDPA")
        return []
    enable_flex(model)
    return ["FlexAttention with one document mask per packed batch"]


def enable_flex(model) -> None:
    """Switch the model's attention to `relaytune_flex` and build the document mask once per
    batch. Works on any device; on the CPU only without gradients (FlexAttention's CPU limit)."""
    register_attention()
    base = _base(model)
    if hasattr(base, "set_attn_implementation"):
        base.set_attn_implementation(ATTENTION_NAME)
    else:  # older transformers
        base.config._attn_implementation = ATTENTION_NAME
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else base.model
    if not getattr(decoder, "_relaytune_doc_mask", False):
        decoder.register_forward_pre_hook(_document_mask_hook, with_kwargs=True)
        decoder._relaytune_doc_mask = True


# Resolved once by register_attention, so that the attention function, traced by dynamo inside
# every compiled layer, does no imports.
_BlockMask = _flex_attention = _sdpa_attention = _compiled_flex = None


def register_attention() -> None:
    global _BlockMask, _flex_attention, _sdpa_attention
    if _BlockMask is not None:
        return
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    _flex_attention, _sdpa_attention = flex_attention, sdpa_attention_forward
    AttentionInterface.register(ATTENTION_NAME, flex_or_sdpa_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)  # padded batches: SDPA's own mask
    _BlockMask = BlockMask


def flex_or_sdpa_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """FlexAttention for a BlockMask (packed batch), SDPA for anything else. Shapes as transformers'
    attention functions: q (B, Hq, S, D), k/v (B, Hkv, S, D) -> (B, S, Hq, D), None."""
    if not isinstance(attention_mask, _BlockMask):
        return _sdpa_attention(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                               **kwargs)
    if dropout:
        raise ValueError("FlexAttention has no attention dropout; set attention: sdpa")
    out = _flex(query.is_cuda)(query, key, value, block_mask=attention_mask, scale=scaling,
                               enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


def _flex(cuda: bool):
    """flex_attention itself inside a compiled region (the layer's graph takes it in) or on the
    CPU; a compiled flex_attention otherwise (eager flex materialises the scores: slow, big)."""
    global _compiled_flex
    if torch.compiler.is_compiling() or not cuda:
        return _flex_attention
    if _compiled_flex is None:
        _compiled_flex = torch.compile(_flex_attention)
    return _compiled_flex


def _document_mask_hook(module, args, kwargs):
    """A packed batch (position_ids, no attention_mask, no cache) gets its document BlockMask."""
    if args or kwargs.get("attention_mask") is not None or kwargs.get("past_key_values") is not None:
        return None
    if getattr(getattr(module, "config", None), "_attn_implementation", None) != ATTENTION_NAME:
        return None  # switched back to another attention since
    pos = kwargs.get("position_ids")
    if pos is None or pos.dim() != 2:
        return None
    kwargs["attention_mask"] = document_mask.document_block_mask(pos)
    return args, kwargs
