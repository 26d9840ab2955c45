"""How a decoder layer runs (relaytune/layers.py): gradient checkpointing wraps the layer's forward from
outside, so a compiled forward never has the checkpoint inside its graph (transformers 5.2x put it in
`forward`, and the compiled QLoRA layers of Qwen2.5-3B then kept 4x the memory on an H200)."""

from __future__ import annotations

import pytest
import torch

from relaytune.config.schema import TrainConfig
from relaytune.layers import LayerForward, decoder_layers, is_compiled, layer_forward
from relaytune.model import choose_precision, load_model
from relaytune.training.loss import causal_lm_loss

BATCH, SEQ = 2, 24


def _model(tiny_model, tmp_path, **kw):
    cfg = TrainConfig(model=str(tiny_model), dataset="unused.jsonl", output_dir=str(tmp_path / "run"),
                      lora_dropout=0.0, **kw)
    torch.manual_seed(0)
    model = load_model(cfg, choose_precision(cfg))
    model.train()
    return model


def _batch(vocab: int) -> dict:
    ids = torch.randint(10, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids.clone()}


def _loss_and_grads(model):
    batch = _batch(model.config.vocab_size)
    loss = causal_lm_loss(model, batch, BATCH * (SEQ - 1))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def test_checkpointing_runs_each_layer_forward_twice_from_outside(tiny_model, tmp_path, one_thread):
    model = _model(tiny_model, tmp_path, gradient_checkpointing=True)
    layers = decoder_layers(model)
    calls = []
    for i, layer in enumerate(layers):
        current = layer.__dict__["forward"]
        assert isinstance(current, LayerForward) and current.checkpoint is not None
        assert layer.gradient_checkpointing is False, "transformers' own checkpoint is off: no nesting"
        current.run = lambda *a, _run=current.run, _i=i, **kw: (calls.append(_i), _run(*a, **kw))[1]
    loss, grads = _loss_and_grads(model)
    assert sorted(calls) == [0, 0, 1, 1], "the forward, then its recompute in backward: checkpoint outside run"

    plain_loss, plain_grads = _loss_and_grads(_model(tiny_model, tmp_path, gradient_checkpointing=False))
    assert torch.equal(loss, plain_loss)
    assert grads.keys() == plain_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, plain_grads[name], rtol=1e-5, atol=1e-7, msg=name)


def test_without_checkpointing_or_compile_the_layers_run_as_the_class_defines(tiny_model, tmp_path):
    model = _model(tiny_model, tmp_path, gradient_checkpointing=False)
    assert all("forward" not in layer.__dict__ for layer in decoder_layers(model))
    assert not any(is_compiled(layer) for layer in decoder_layers(model))
    layer = decoder_layers(model)[0]
    assert layer_forward(layer) is layer_forward(layer), "installed once"
    assert layer_forward(layer).checkpoint is None and not is_compiled(layer)


@pytest.mark.slow  # inductor's C++ compile: ~25 s on a 2-core machine
def test_a_compiled_checkpointed_layer_saves_only_its_inputs(tiny_model, tmp_path, one_thread):
    """The tensors kept for backward are the eager checkpoint's (the layer inputs), not what AOTAutograd
    would choose inside a compiled checkpoint (with transformers 5.24 there: 6x as many on this model)."""
    def saved_shapes(compile_setting):
        model = _model(tiny_model, tmp_path, gradient_checkpointing=True, torch_compile=compile_setting)
        assert all(is_compiled(layer) for layer in decoder_layers(model)) is compile_setting
        saved = []

        def keep(tensor):
            saved.append((tuple(tensor.shape), tensor.dtype))
            return tensor

        batch = _batch(model.config.vocab_size)
        for _ in range(2):  # the second step runs the compiled graphs, the first compiles them
            saved.clear()
            with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
                loss = causal_lm_loss(model, batch, BATCH * (SEQ - 1))
            loss.backward()
        return sorted(saved, key=str)

    assert saved_shapes(True) == saved_shapes(False)
