"""Load the base model and tokenizer and wrap the model with a LoRA adapter.

One job: from a TrainConfig and the hardware, produce (model, tokenizer) ready
to train. Precision, quantization, LoRA, gradient checkpointing and the pad
token are decided here and nowhere else.
"""

from __future__ import annotations

import contextlib
import functools
import os
import pickle
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from relaytune import builtin
from relaytune.activation_offload import offloaded_checkpoint
from relaytune.config.schema import TrainConfig
from relaytune.errors import UserError
from relaytune.layers import take_over_checkpointing
from relaytune.liger import apply_liger_kernels, load_liger
from relaytune.log import notice

# peft's PeftModel.__init__ reads transformers' deprecated `is_gradient_checkpointing` property (our
# own code calls the new names), so its FutureWarning is library-internal noise: this one message only.
IS_GC_DEPRECATED = r"`is_gradient_checkpointing` is deprecated"
warnings.filterwarnings("ignore", message=IS_GC_DEPRECATED, category=FutureWarning)


@contextlib.contextmanager
def quiet_peft():
    """The same filter, for a block (it also holds where something, e.g. pytest, reset the filters)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=IS_GC_DEPRECATED, category=FutureWarning)
        yield


@dataclass(frozen=True)
class Precision:
    """What the hardware and config settled on."""

    device: torch.device
    dtype: torch.dtype  # dtype of the frozen base weights
    autocast: torch.dtype | None  # mixed-precision compute dtype, None for fp32
    use_grad_scaler: bool  # fp16 needs loss scaling; bf16 and fp32 do not


def choose_precision(cfg: TrainConfig) -> Precision:
    """bf16 where supported, fp16 on GPUs without bf16 (a T4), fp32 on CPU."""
    if not torch.cuda.is_available():
        if cfg.bf16 or cfg.fp16:
            notice("no GPU: training in float32 on the CPU (bf16/fp16 apply to GPUs only)")
        return Precision(torch.device("cpu"), torch.float32, None, False)
    device = torch.device("cuda", torch.cuda.current_device())
    has_bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
    if cfg.bf16 and not has_bf16:
        notice(f"{torch.cuda.get_device_name(device)} has no bfloat16; using fp16 with a gradient scaler")
        return Precision(device, torch.float16, torch.float16, True)
    if cfg.fp16:
        return Precision(device, torch.float16, torch.float16, True)
    if cfg.bf16 is False:
        return Precision(device, torch.float32, None, False)
    if has_bf16:
        return Precision(device, torch.bfloat16, torch.bfloat16, False)
    return Precision(device, torch.float16, torch.float16, True)


@dataclass(frozen=True)
class ModelSource:
    """Where from_pretrained reads: a folder or Hub id, plus a GGUF file name if any."""

    path: str
    gguf_file: str | None = None
    label: str = ""


def resolve_source(cfg: TrainConfig) -> ModelSource:
    name = cfg.model
    if name.startswith("builtin:"):
        return ModelSource(str(builtin.cached_model_dir(name)), None, name)
    p = Path(os.path.expanduser(name))
    if p.suffix == ".gguf":
        if not p.is_file():
            raise UserError(f"`model`: GGUF file {where(name)} not found")
        return ModelSource(str(p.parent), p.name, name)
    if p.exists():
        if not p.is_dir() or not (p / "config.json").is_file():
            raise UserError(f"`model`: {p} is not a model folder (it has no config.json)")
        return ModelSource(str(p), None, name)
    if name.startswith((".", "/", "~")):
        raise UserError(f"`model`: {where(name)} does not exist")
    return ModelSource(name, None, name)  # a Hub id


def where(path: str) -> str:
    """A path as the message about it should name it: absolute, and for a relative one, the folder
    it was resolved against (the working directory, at this point)."""
    p = Path(os.path.expanduser(path))
    if p.is_absolute():
        return str(p)
    return f"{Path.cwd() / p} ({path!r} is relative: resolved against the working directory {Path.cwd()})"


def load_tokenizer(cfg: TrainConfig, src: ModelSource | None = None):
    from transformers import AutoTokenizer

    src = src or resolve_source(cfg)
    tok = load_pretrained(AutoTokenizer, src, cfg)
    if tok.pad_token is None:
        # Pad positions carry no loss and no attention, so any id works; eos is always there.
        tok.pad_token = tok.eos_token if tok.eos_token is not None else tok.unk_token
        if tok.pad_token is None:
            raise UserError(f"`model`: the tokenizer of {src.label} has no eos, unk or pad token to pad with")
    tok.padding_side = "right"
    return tok


def import_bitsandbytes():
    """Import bitsandbytes before any model exists, and quietly.

    peft imports it lazily inside get_peft_model; on CPU its import logs a warning
    about optional kernels and keeps that failure's traceback, whose frames would
    then pin the model in memory across notebook runs.
    """
    import logging

    logger = logging.getLogger("bitsandbytes")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        return None
    finally:
        logger.setLevel(level)
    return bitsandbytes


def check_trainable(cfg: TrainConfig, precision: Precision) -> None:
    """Refuse adapters this precision cannot train: the gradient scaler's CUDA unscale kernels have
    taken fp32 and fp16 gradients, not bf16. (Evaluating such adapters in fp16 is fine.)"""
    if cfg.adapter_dtype == "bfloat16" and precision.use_grad_scaler:
        raise UserError("`adapter_dtype`: bfloat16 adapters need bf16 (or fp32) training, and this run trains in "
                        "fp16 with a gradient scaler (a GPU without bf16, such as a T4, or fp16: true); "
                        "set adapter_dtype: float32")


def load_model(cfg: TrainConfig, precision: Precision, src: ModelSource | None = None, to_shard: bool = False):
    """The base model with a fresh LoRA adapter on it, ready for training.

    `to_shard`: FSDP will shard it (distributed/fsdp.py), so an unquantized base stays on the CPU
    and reaches the GPU shard by shard; a 4-bit base is quantized on the GPU as it loads."""
    import_bitsandbytes()
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    src = src or resolve_source(cfg)
    kwargs: dict = {"dtype": precision.dtype}
    quantized = cfg.load_in_4bit or cfg.load_in_8bit
    if quantized:
        kwargs["quantization_config"] = _bnb_config(cfg, precision)
        kwargs["device_map"] = {"": precision.device.index if precision.device.type == "cuda" else "cpu"}
    liger = load_liger(cfg.liger_kernels, precision.device)
    model = load_pretrained(AutoModelForCausalLM, src, cfg, **kwargs)
    if not quantized and not to_shard:
        model.to(precision.device)
    model.config.use_cache = False  # the KV cache is useless in training and conflicts with checkpointing
    apply_liger_kernels(model, cfg.liger_kernels, liger)  # on the base layers, before PEFT wraps them
    # No prepare_model_for_kbit_training: it upcasts every non-quantized weight to fp32, which
    # for Llama-3-8B's untied 128k-vocab embedding and head alone is 8.4 GB instead of 2.1 GB,
    # and mixed precision does not need it. get_peft_model freezes the base weights.
    # `auto` is resolved by the trainer before the model loads (training/autobatch.py); left as auto here
    # (evaluation, export: no backward) it means off.
    if cfg.gradient_checkpointing is True:
        enable_checkpointing(model, offload=cfg.offload_activations)
    elif cfg.offload_activations:
        notice("offload_activations: nothing to offload while gradient checkpointing is off")
    lora = LoraConfig(
        r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
        target_modules=cfg.lora_target_modules, bias="none", task_type="CAUSAL_LM",
    )
    try:
        with quiet_peft():
            model = get_peft_model(model, lora)
    except ValueError as e:
        raise UserError(f"`lora_target_modules`: {e}") from None
    if cfg.adapter_dtype == "bfloat16":  # PEFT made them fp32; the optimizer state follows the parameters
        for param in model.parameters():
            if param.requires_grad:
                param.data = param.data.to(torch.bfloat16)
    inputs_require_grad(model)
    from relaytune.training.speedups import apply_speedups  # compile, flex attention: off on the CPU by default

    apply_speedups(model, cfg, precision)
    return model


def enable_checkpointing(model, offload: bool = False) -> None:
    """Gradient checkpointing on a transformers model (or a PEFT model around one), non-reentrant;
    `offload`: each checkpointed layer keeps its input in pinned CPU memory (offload_activations)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    gc_kwargs = {"use_reentrant": False}  # reentrant checkpointing breaks when the inputs do not require grad
    if hasattr(base, "activation_checkpointing_enable"):  # transformers >= 5.2x: the old name warns
        base.activation_checkpointing_enable(activation_checkpointing_kwargs=gc_kwargs)
    else:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=gc_kwargs)
    inputs_require_grad(base)
    if offload:
        checkpointed = [m for m in base.modules() if getattr(m, "_gradient_checkpointing_func", None) is not None]
        for i, module in enumerate(checkpointed):  # in call order: the first one starts each forward pass
            module._gradient_checkpointing_func = functools.partial(
                offloaded_checkpoint, module._gradient_checkpointing_func, i == 0)
    take_over_checkpointing(base)  # outside the compiled region of a compiled layer


def inputs_require_grad(model) -> None:
    """The input embedding's output requires grad in training, so that checkpointed layers and the
    adapters before the first one get gradients; under no_grad (evaluation) it stays a plain tensor.
    transformers' and PEFT's hooks for this (`make_inputs_require_grads`, one per call, added again
    by get_peft_model) set it under no_grad too, and then a compiled layer sees an input that requires
    grad at the first layer only: evaluation compiled each layer's graph twice over. Theirs are
    replaced by one that asks torch whether grad is on."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    try:
        embedding = base.get_input_embeddings()
    except NotImplementedError:  # no input embedding exposed: transformers warned already
        return
    for key, hook in list(embedding._forward_hooks.items()):
        if getattr(hook, "__name__", "") in ("make_inputs_require_grads", "make_inputs_require_grad"):
            del embedding._forward_hooks[key]
    if not getattr(embedding, "_relaytune_inputs_require_grad", False):
        embedding.register_forward_hook(_require_grad_with_grad_on)
        embedding._relaytune_inputs_require_grad = True


def _require_grad_with_grad_on(module, args, output):
    if torch.is_grad_enabled():
        output.requires_grad_(True)


def _bnb_config(cfg: TrainConfig, precision: Precision):
    from transformers import BitsAndBytesConfig

    if cfg.load_in_8bit:
        return BitsAndBytesConfig(load_in_8bit=True)
    compute = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
               "auto": precision.autocast or torch.float32}[cfg.bnb_4bit_compute_dtype]
    storage = "uint8" if cfg.bnb_4bit_quant_storage == "auto" else cfg.bnb_4bit_quant_storage
    return BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type=cfg.bnb_4bit_quant_type,
        bnb_4bit_use_double_quant=cfg.bnb_4bit_use_double_quant, bnb_4bit_compute_dtype=compute,
        bnb_4bit_quant_storage=getattr(torch, storage),
    )


def load_pretrained(cls, src: ModelSource, cfg: TrainConfig, **kwargs):
    """`cls.from_pretrained` for a resolved source, with actionable errors and no remote code unless asked."""
    if src.gguf_file:
        kwargs["gguf_file"] = src.gguf_file
    from transformers import AutoTokenizer

    if cls is not AutoTokenizer:
        # transformers 5.25 swaps layers for Hub kernels wherever the `kernels` package is installed, and on a
        # GPU again at every model.train(): that fetches code from the Hub, and offline it raises (seen on an
        # H100). relaytune's own kernels are its compiled layers.
        kwargs.setdefault("use_kernels", False)
    try:
        return cls.from_pretrained(src.path, trust_remote_code=cfg.trust_remote_code, **kwargs)
    except ValueError as e:
        if "trust_remote_code" in str(e) and not cfg.trust_remote_code:
            raise UserError(
                f"`model`: {src.label} ships its own Python code, and relaytune does not run "
                "downloaded code unless you say so. If you trust its authors, set "
                "`trust_remote_code: true`; otherwise pick a model that transformers supports natively."
            ) from None
        raise
    except OSError as e:
        raise UserError(f"`model`: cannot load {src.label}: {str(e).splitlines()[0]}") from None
    except pickle.UnpicklingError as e:  # torch's weights_only loader refused a pickle: nothing ran
        first = (str(e).split("WeightsUnpickler error:")[-1].strip().splitlines() or [""])[0][:160]
        raise UserError(
            f"`model`: the weights of {src.label} are a pickle file (pytorch_model.bin) that holds more "
            f"than tensors ({first or 'refused by torch'}), so relaytune refused to load it: loading it "
            "could run code hidden in the file, and none was run. Convert the weights to safetensors "
            "(model.safetensors) on a machine you trust, or use a copy of the model that ships "
            "safetensors.") from None
