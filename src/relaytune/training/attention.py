"""Document-masked attention for packed batches: FlexAttention, or FlashAttention's varlen kernel.

A packed row holds several samples, and each position may attend only to earlier positions of its
own sample. From the restarting position_ids, transformers builds SDPA a B x 1 x S x S mask for
that, which rules out SDPA's flash kernel. relaytune offers two kernels that take the documents
themselves. `apply_attention` switches the model to one of them once; a forward pre-hook on the
decoder then describes each batch's documents once, not once per layer:

- flex (`relaytune_flex`): FlexAttention with one BlockMask per batch (training/document_mask.py),
  which transformers hands unchanged to every layer as the attention mask. CUDA GPUs of compute
  capability 7.5+ (a T4 or newer); auto takes it on Hopper-class GPUs (see flex_decision).
- varlen (`relaytune_varlen`): torch's FlashAttention varlen kernel (torch.nn.attention.varlen) over
  the micro-batch laid end to end, each document given by where it starts (`document_starts`). The
  starts are found on the host from the batch's pinned copy, so nothing waits for the GPU, and reach
  every layer as the attention mask: an int32 (1, 1, 1, documents + 1) tensor, which transformers
  passes on unchanged as it does any 4-D mask, and which no real mask is (those are bool or float).
  CUDA GPUs of compute capability 8.0+, in bf16 or fp16; only when asked (`attention: varlen`).

Either function runs SDPA for anything else: a padded batch keeps SDPA's own mask and fast path,
and a row with no documents described is plain causal. On the CPU both stay off (FlexAttention has
no backward there, and the flash kernel is CUDA's).
"""

from __future__ import annotations

import inspect

import torch

from relaytune.data.batches import host_copy
from relaytune.log import notice
from relaytune.training import document_mask, hardware

FLEX_NAME = "relaytune_flex"
VARLEN_NAME = "relaytune_varlen"
MIN_FLEX_SM = (7, 5)  # T4 and newer, as torchtune gates it
MIN_VARLEN_SM = (8, 0)  # FlashAttention 2's floor
MAX_FLASH_HEAD_DIM = 256
AUTO_FLEX_SHARED_MEMORY = 227 * 1024  # bytes a block may use on an H100/H200 (232,448)


def apply_attention(model, cfg, precision) -> list[str]:
    """Switch a packed run's attention as the config, hardware and model allow; what was applied."""
    setting, packing = getattr(cfg, "attention", "auto"), bool(getattr(cfg, "packing", False))
    if setting == "varlen":
        want, why = varlen_decision(packing, precision.device, precision.autocast)
        kind = "varlen" if want else None
    else:
        want, why = flex_decision(setting, packing, precision.device)
        kind = "flex" if want else None
    if not want:
        if why:
            notice(f"attention: {setting} off ({why})")
        return []
    blocker = model_blocker(_base(model).config, kind)
    if blocker:
        notice(f"attention: {kind} off ({blocker}); using SDPA")
        return []
    if kind == "varlen":
        enable_varlen(model)
        return ["FlashAttention's varlen kernel over each packed batch's documents"]
    enable_flex(model)
    return ["FlexAttention with one document mask per packed batch"]


def in_use(model) -> str | None:
    """Which document-masked attention the model runs: "flex", "varlen" or None."""
    impl = getattr(_base(model).config, "_attn_implementation", None)
    return {FLEX_NAME: "flex", VARLEN_NAME: "varlen"}.get(impl)


# --- decisions -------------------------------------------------------------------------------------
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
    cap = hardware.capability(device)
    if cap is None:
        return False, "FlexAttention has no backward on the CPU; using SDPA" if asked else None
    if cap < MIN_FLEX_SM:
        return False, f"compute capability {cap[0]}.{cap[1]} is below 7.5" if asked else None
    if not asked and hardware.shared_memory_per_block(device) < AUTO_FLEX_SHARED_MEMORY:
        return False, None
    if not hardware.has_triton():
        return False, "Triton is not installed" if asked else None
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError:
        return False, f"torch {torch.__version__} has no FlexAttention"
    return True, None


def varlen_decision(packing: bool, device, compute_dtype) -> tuple[bool, str | None]:
    """(FlashAttention's varlen kernel?, why not). Asked for by the user, so every refusal says why."""
    if not packing:
        return False, "only packed batches use it; padded batches keep SDPA"
    cap = hardware.capability(device)
    if cap is None:
        return False, "FlashAttention's varlen kernel runs on CUDA GPUs only; using SDPA"
    if cap < MIN_VARLEN_SM:
        return False, f"compute capability {cap[0]}.{cap[1]} is below 8.0, FlashAttention's floor; using SDPA"
    if compute_dtype not in (torch.bfloat16, torch.float16):
        return False, "FlashAttention computes in bf16 or fp16, and this run computes in float32; using SDPA"
    if _varlen_kernel() is None:
        return False, (f"torch {torch.__version__} has no causal torch.nn.attention.varlen.varlen_attn; "
                       "using SDPA")
    return True, None


def model_blocker(config, kind: str = "flex") -> str | None:
    """Why this model's attention is not plain causal softmax attention the kernel can run (then SDPA)."""
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
    if kind == "varlen":
        heads = int(getattr(config, "num_attention_heads", 0) or 1)
        head_dim = int(getattr(config, "head_dim", None) or getattr(config, "hidden_size", 0) // heads)
        if head_dim > MAX_FLASH_HEAD_DIM or head_dim % 8:
            return (f"its heads are {head_dim} wide, and FlashAttention takes at most {MAX_FLASH_HEAD_DIM}, "
                    "in multiples of 8")
    return None


# --- switching a model -----------------------------------------------------------------------------
def enable_flex(model) -> None:
    """Switch the model's attention to `relaytune_flex` and build the document mask once per
    batch. Works on any device; on the CPU only without gradients (FlexAttention's CPU limit)."""
    _register()
    _switch(model, FLEX_NAME, _document_mask_hook)


def enable_varlen(model) -> None:
    """Switch the model's attention to `relaytune_varlen` and find the document starts once per batch.
    The kernel itself is CUDA's; tests on the CPU put a reference in `_varlen_attn` (tests/support)."""
    _register()
    _switch(model, VARLEN_NAME, _document_starts_hook)


def _switch(model, name: str, hook) -> None:
    base = _base(model)
    if hasattr(base, "set_attn_implementation"):
        base.set_attn_implementation(name)
    else:  # older transformers
        base.config._attn_implementation = name
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else base.model
    hooked = getattr(decoder, "_relaytune_attention_hooks", set())
    if name not in hooked:
        decoder.register_forward_pre_hook(hook, with_kwargs=True)
        decoder._relaytune_attention_hooks = hooked | {name}


# Inductor swaps in its flex decoding kernel for a forward without gradients over fewer than 128 queries
# (the no_grad forward under cuda_graphs, evaluation), and with a packed batch's document BlockMask that
# kernel was wrong: on an H100 (torch 2.11), a tiny llama's packed batches of width 32 came out up to
# 4.4e-4 off in loss and 5% in gradients in fp32, where the main kernel matched eager SDPA exactly
# (bench/results/flex-decoding-h100.md). So every flex call on a GPU takes the main kernel.
FLEX_KERNEL_OPTIONS = {"FORCE_USE_FLEX_ATTENTION": True}

# Resolved once by _register, so that the attention functions, traced by dynamo inside every
# compiled layer, do no imports.
_BlockMask = _flex_attention = _sdpa_attention = _compiled_flex = _varlen_attn = None
_VARLEN_OPTIONS: dict = {}  # the causal switch of this torch's varlen_attn, and whether it takes GQA


def _register() -> None:
    global _BlockMask, _flex_attention, _sdpa_attention, _varlen_attn
    if _sdpa_attention is not None:
        return
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    _sdpa_attention = sdpa_attention_forward
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention

        _BlockMask, _flex_attention = BlockMask, flex_attention
    except ImportError:  # a torch without FlexAttention can still run varlen
        _BlockMask = type("NoBlockMask", (), {})
    _varlen_attn = _varlen_kernel()
    AttentionInterface.register(FLEX_NAME, flex_or_sdpa_attention)
    AttentionInterface.register(VARLEN_NAME, varlen_or_sdpa_attention)
    # Padded batches get SDPA's own mask. A packed batch's BlockMask or document starts is 4-D, which
    # transformers passes on as it is, without building its own mask of the documents.
    AttentionMaskInterface.register(FLEX_NAME, sdpa_mask)
    AttentionMaskInterface.register(VARLEN_NAME, sdpa_mask)


def _varlen_kernel():
    """torch's varlen_attn where it can run causal attention (it has taken a `window_size` and, in
    other versions, an `is_causal` switch), else None; `_VARLEN_OPTIONS` records how to call it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "window_size" in params:
        causal = {"window_size": (-1, 0)}
    elif "is_causal" in params:
        causal = {"is_causal": True}
    else:
        return None
    _VARLEN_OPTIONS.update(causal=causal, gqa="enable_gqa" in params, scale="scale" in params)
    return varlen_attn


# --- the attention functions (transformers' signature) ---------------------------------------------
def flex_or_sdpa_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """FlexAttention for a BlockMask (packed batch), SDPA for anything else. Shapes as transformers'
    attention functions: q (B, Hq, S, D), k/v (B, Hkv, S, D) -> (B, S, Hq, D), None."""
    if not isinstance(attention_mask, _BlockMask):
        return _sdpa_attention(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                               **kwargs)
    if dropout:
        raise ValueError("FlexAttention has no attention dropout; set attention: sdpa")
    options = {"kernel_options": FLEX_KERNEL_OPTIONS} if query.is_cuda and FLEX_KERNEL_OPTIONS else {}
    out = _flex(query.is_cuda)(query, key, value, block_mask=attention_mask, scale=scaling,
                               enable_gqa=query.shape[1] != key.shape[1], **options)
    return out.transpose(1, 2).contiguous(), None


def varlen_or_sdpa_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """FlashAttention's varlen kernel when the mask is a packed batch's document starts, SDPA for
    anything else. The (B, H, S, D) views transformers hands over are (B, S, H, D) in memory, so
    laying them end to end as (B*S, H, D) copies nothing, and the output comes back as (B, S, Hq, D)."""
    if not is_document_starts(attention_mask):
        return _sdpa_attention(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                               **kwargs)
    starts = attention_mask.reshape(-1)
    if dropout:
        raise ValueError("FlashAttention's varlen kernel has no attention dropout here; set attention: sdpa")
    batch, heads, length, _ = query.shape

    def end_to_end(t):
        return t.transpose(1, 2).reshape(batch * length, t.shape[1], t.shape[3])

    q, k, v = end_to_end(query), end_to_end(key), end_to_end(value)
    if q.dtype == torch.float32 and torch.is_autocast_enabled(q.device.type):
        # FlashAttention takes bf16 or fp16 only; a float32 tensor here (an fp32 layer norm's output,
        # outside a matmul) goes in the run's compute dtype, as transformers' flash path does.
        q, k, v = (t.to(torch.get_autocast_dtype(q.device.type)) for t in (q, k, v))
    options = dict(_VARLEN_OPTIONS["causal"])
    if scaling is not None and _VARLEN_OPTIONS["scale"]:
        options["scale"] = scaling
    elif scaling is not None:  # a torch whose varlen_attn always scales by 1/sqrt(D): the rest goes on q
        q = q * (scaling * q.shape[-1] ** 0.5)
    if k.shape[1] != heads:
        if _VARLEN_OPTIONS["gqa"]:
            options["enable_gqa"] = True
        else:  # a torch whose varlen_attn wants as many key heads as query heads
            k, v = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (k, v))
    out = _varlen_attn(q, k, v, starts, starts, length, length, **options)
    return out.view(batch, length, heads, out.shape[-1]).to(query.dtype), None


def _flex(cuda: bool):
    """flex_attention itself inside a compiled region (the layer's graph takes it in) or on the
    CPU; a compiled flex_attention otherwise (eager flex materialises the scores: slow, big)."""
    global _compiled_flex
    if torch.compiler.is_compiling() or not cuda:
        return _flex_attention
    if _compiled_flex is None:
        _compiled_flex = torch.compile(_flex_attention)
    return _compiled_flex


# --- what each batch's documents are ---------------------------------------------------------------
def _packed_positions(module, args, kwargs, name: str):
    """The position_ids of a packed batch bound for attention `name` (no mask, no cache), else None."""
    if args or kwargs.get("attention_mask") is not None or kwargs.get("past_key_values") is not None:
        return None
    if getattr(getattr(module, "config", None), "_attn_implementation", None) != name:
        return None  # switched to another attention since
    pos = kwargs.get("position_ids")
    return pos if pos is not None and pos.dim() == 2 else None


def _document_mask_hook(module, args, kwargs):
    """A packed batch gets its document BlockMask as the attention mask."""
    pos = _packed_positions(module, args, kwargs, FLEX_NAME)
    if pos is None:
        return None
    kwargs["attention_mask"] = document_mask.document_block_mask(pos)
    return args, kwargs


def _document_starts_hook(module, args, kwargs):
    """A packed batch gets its document starts as the attention mask."""
    pos = _packed_positions(module, args, kwargs, VARLEN_NAME)
    if pos is None:
        return None
    mask = document_starts(pos).view(1, 1, 1, -1)
    torch._dynamo.maybe_mark_dynamic(mask, 3)  # the count of documents varies: one graph takes every count
    kwargs["attention_mask"] = mask
    return args, kwargs


def is_document_starts(mask) -> bool:
    """Whether an attention mask is `document_starts`' (as the hook above passes it), not a real mask."""
    return isinstance(mask, torch.Tensor) and mask.dtype == torch.int32 and mask.dim() == 4 \
        and mask.shape[:3] == (1, 1, 1)


def document_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """Where each document starts in the micro-batch laid end to end, then its length (B*S): the
    kernel's cu_seqlens, int32, on position_ids' device. A document starts where its positions
    restart at 0 (collate's padding is a document of its own, with no targets), and at every row.
    Found on the host from the batch's pinned copy where it has one (data/batches.to_device):
    `nonzero` on the GPU would make the host wait for the GPU."""
    host = host_copy(position_ids)
    source = position_ids if host is None else host
    rows, length = source.shape
    first = torch.arange(length, device=source.device) == 0
    flat = ((source == 0) | first).reshape(-1)
    ends = torch.tensor([rows * length], device=source.device)
    starts = torch.cat([flat.nonzero().flatten(), ends]).to(torch.int32)
    if host is not None and position_ids.is_cuda:
        starts = starts.pin_memory().to(position_ids.device, non_blocking=True)
    else:
        starts = starts.to(position_ids.device)
    return starts


def _base(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model
