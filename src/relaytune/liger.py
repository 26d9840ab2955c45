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
