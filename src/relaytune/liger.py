"""Liger's Triton kernels for the decoder layers' RMSNorm and SwiGLU MLP (`liger_kernels`), put on the
modules of one loaded model.

Liger's MLP forward still calls the gate, up and down Linear layers, so LoRA adapts them as before;
its fused SiLU-times-up kernel keeps only the gate and up outputs for backward and recomputes
silu(gate) there, which is part of the memory it saves. Liger's RoPE is left out: it breaks the
compiled graph (18% slower; bench/results/vs-trl-h200.md, twenty-second session), and so is its fused
linear cross-entropy, because relaytune's head computes the loss itself.

Liger's `apply_liger_kernel_to_<model>` also swaps the classes in transformers' modeling module for the
whole process. relaytune undoes that at once, so a model loaded later (another run in the same
notebook, an evaluation without liger_kernels) gets transformers' own layers."""

from __future__ import annotations

import importlib
import logging
import warnings
from contextlib import contextmanager

from relaytune.errors import UserError
from relaytune.log import info, notice

KERNELS = ("rms_norm", "swiglu")
# Model types whose norm is Llama's RMSNorm (no offset, fp32 variance) and whose MLP is
# down(silu(gate(x)) * up(x)): Liger's patch for each keeps their maths.
PATCHES = {
    "llama": "apply_liger_kernel_to_llama",
    "mistral": "apply_liger_kernel_to_mistral",
    "qwen2": "apply_liger_kernel_to_qwen2",
    "qwen3": "apply_liger_kernel_to_qwen3",
}


def load_liger(kernels, device):
    """Liger's `liger_kernel.transformers` where `kernels` will run, imported before the model loads so
    that a missing package costs nothing (UserError, exit 2); None without kernels or a CUDA GPU (a
    notice says the run keeps transformers' layers: Liger's kernels are Triton's)."""
    if not kernels:
        return None
    if device.type != "cuda":
        notice("liger_kernels: Liger's kernels run on CUDA GPUs only; this run keeps transformers' layers")
        return None
    try:
        return importlib.import_module("liger_kernel.transformers")
    except ImportError as e:
        raise UserError(f"`liger_kernels` needs the liger-kernel package, which did not import ({e}); "
                        "install it with `pip install liger-kernel`, or remove liger_kernels from the config") from None


def apply_liger_kernels(model, kernels, liger) -> bool:
    """Liger's `kernels` on `model`'s decoder layers (before PEFT wraps them), through `liger` (from
    load_liger; None: nothing to apply); whether they now run. A model that Liger's patch does not fit
    is refused (UserError) on every machine, so a config that fails on the GPU fails on the CPU too."""
    if not kernels:
        return False
    model_type = getattr(model.config, "model_type", None)
    if model_type not in PATCHES:
        raise UserError(f"`liger_kernels`: relaytune puts Liger's kernels on {', '.join(PATCHES)} models, and "
                        f"this model is {model_type!r}; remove liger_kernels from the config")
    act = getattr(model.config, "hidden_act", "silu")
    if "swiglu" in kernels and act not in ("silu", "swish"):  # Liger's patch of a loaded MLP does not check
        raise UserError(f"`liger_kernels`: Liger's SwiGLU computes silu(gate) * up, and this model's MLP uses "
                        f"{act!r}; remove swiglu from liger_kernels")
    if liger is None:
        return False
    with module_restored(f"transformers.models.{model_type}.modeling_{model_type}"):
        getattr(liger, PATCHES[model_type])(model=model, rope=False, cross_entropy=False,
                                            fused_linear_cross_entropy=False,
                                            **{name: name in kernels for name in KERNELS})
    quiet_dynamo_about_liger()
    names = {"rms_norm": "RMSNorm", "swiglu": "SwiGLU MLP"}
    applied = " and ".join(names[k] for k in KERNELS if k in kernels)
    info(f"liger_kernels: Liger's {applied} in every decoder layer")
    return True


@contextmanager
def module_restored(name: str):
    """Every global of module `name` as it was before the block: names rebound inside are bound back,
    names added are removed."""
    module = importlib.import_module(name)
    before = dict(vars(module))
    try:
        yield module
    finally:
        for key in [k for k in vars(module) if k not in before]:
            delattr(module, key)
        for key, value in before.items():
            if vars(module).get(key) is not value:
                setattr(module, key, value)


class _LigerKernelReadFailure(logging.Filter):
    """Drops torch's warning that it could not read which tensors one of Liger's SwiGLU kernels writes.

    The traceback's frames are torch's and Triton's; only the error names the kernel: Triton's
    CompilationError carries the kernel's source (`src`)."""

    KERNELS = ("def _swiglu_forward_kernel(", "def _swiglu_backward_kernel(")  # liger_kernel/ops/swiglu.py

    def filter(self, record: logging.LogRecord) -> bool:
        if "assuming every input is mutated" not in record.getMessage() or not record.exc_info:
            return True
        source = getattr(record.exc_info[1], "src", None)
        return not (isinstance(source, str) and any(kernel in source for kernel in self.KERNELS))


def quiet_dynamo_about_liger() -> None:
    """Keep compiled layers' first step from printing torch's notes on Liger's kernels.

    Dynamo reads a Triton kernel's IR to learn which tensors it writes. For Liger's SwiGLU kernels
    that read fails (torch 2.11, liger-kernel 0.8.5), so Dynamo assumes every input is written and
    logs a ~100-line traceback per kernel and compile. The cost was measured: running Liger's function
    outside Dynamo altogether changed tokens/s by under 1% (bench/results/vs-trl-h200.md, 2026-12-06
    tenth session). Dynamo also warns that it traces through Liger's `functools.lru_cache`'d device
    lookup, which returns the same device string every call.
    """
    dynamo_log = logging.getLogger("torch._dynamo")  # triton_kernel_wrap.py logs through Dynamo's logger
    if not any(isinstance(f, _LigerKernelReadFailure) for f in dynamo_log.filters):
        dynamo_log.addFilter(_LigerKernelReadFailure())
    warnings.filterwarnings("ignore", message=r"Dynamo detected a call to a `functools.lru_cache`-wrapped function "
                            r"at 'swiglu.py")
