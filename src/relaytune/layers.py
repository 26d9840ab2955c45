"""The decoder layers of a model and how each one runs: compiled or eager, checkpointed or not.

Gradient checkpointing always wraps the layer's forward from outside any compiled region. transformers
applies its own checkpointing inside `forward` since 5.2x (before, around `__call__`), so compiling the
layer put the checkpoint inside the compiled graph, where AOTAutograd chose what to keep for backward:
on an H200, Qwen2.5-3B QLoRA at 8,192 tokens per step peaked at 20.1 GiB instead of 4.95 GiB
(bench/results/vs-trl-h200.md). Here transformers still provides the checkpoint function (with
`use_reentrant=False` and, when asked, the offloading of the saved inputs), but relaytune decides where
it goes: `LayerForward` becomes the layer's `forward` and calls checkpoint(compiled forward, ...). The
module's hooks (FSDP2's) stay outside the checkpoint, as transformers keeps them.
"""

from __future__ import annotations

import torch


def decoder_layers(model) -> list[torch.nn.Module]:
    """The repeated decoder blocks (model.get_base_model().model.layers for HF causal LMs)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else getattr(base, "model", None)
    layers = getattr(decoder, "layers", None)
    return list(layers) if isinstance(layers, torch.nn.ModuleList) else []


class LayerForward:
    """A decoder layer's forward as relaytune runs it: `run` (the class's forward, or its compiled
    form) under `checkpoint` when one is set and the layer trains with gradients."""

    def __init__(self, layer: torch.nn.Module):
        self.layer = layer
        self.eager = type(layer).forward  # unbound: the layer is its first argument, as in the class
        self.run = self.eager
        self.checkpoint = None

    def __call__(self, *args, **kwargs):
        layer = self.layer
        if self.checkpoint is not None and layer.training and torch.is_grad_enabled():
            return self.checkpoint(self.run, layer, *args, **kwargs)
        return self.run(layer, *args, **kwargs)

    @property
    def compiled(self) -> bool:
        return self.run is not self.eager


def layer_forward(layer: torch.nn.Module) -> LayerForward:
    """The layer's LayerForward, installed as its `forward` on first use."""
    current = layer.__dict__.get("forward")
    if not isinstance(current, LayerForward):
        current = LayerForward(layer)
        layer.forward = current  # an instance attribute: the class's forward stays as it is
    return current


def take_over_checkpointing(model) -> None:
    """Moves transformers' gradient checkpointing of each decoder layer out of the layer's forward
    and into its LayerForward. Call after transformers enabled it."""
    for layer in decoder_layers(model):
        checkpoint = getattr(layer, "_gradient_checkpointing_func", None)
        if getattr(layer, "gradient_checkpointing", False) and checkpoint is not None:
            layer_forward(layer).checkpoint = checkpoint
            layer.gradient_checkpointing = False  # transformers' own check: it no longer checkpoints


def compile_layers(layers: list[torch.nn.Module]) -> None:
    """Compiles each layer's forward (regional compilation); the checkpoint stays outside. Layers of
    one class share one compiled function and so one graph: the layer is an input, not a constant."""
    compiled: dict[object, object] = {}
    for layer in layers:
        current = layer_forward(layer)
        if current.eager not in compiled:
            compiled[current.eager] = torch.compile(current.eager)
        current.run = compiled[current.eager]


def uncompile_layers(layers: list[torch.nn.Module]) -> None:
    for layer in layers:
        current = layer_forward(layer)
        current.run = current.eager


def is_compiled(layer: torch.nn.Module) -> bool:
    current = layer.__dict__.get("forward")
    return isinstance(current, LayerForward) and current.compiled
