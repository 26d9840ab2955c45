"""How a decoder layer runs (relaytune/layers.py): gradient checkpointing wraps the layer's forward from
outside, so a compiled forward does not get transformers' checkpoint inside its graph (transformers 5.2x
put it in `forward`, and the compiled QLoRA layers of Qwen2.5-3B then kept 4x the memory on an H200),
unless compile_checkpoint compiles checkpoint(forward) as one region on purpose. Layers that replay CUDA
graphs: test_layer_graphs.py."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from support.layer_cases import BATCH, SEQ, layer_batch, layer_model, loss_and_grads

from relaytune.layers import (
    LayerForward,
    checkpoints_inside,
    decoder_layers,
    is_compiled,
    layer_forward,
    move_checkpoints_outside,
)
from relaytune.training.loss import causal_lm_loss


def test_checkpointing_runs_each_layer_forward_twice_from_outside(tiny_model, tmp_path, one_thread):
    model = layer_model(tiny_model, tmp_path, gradient_checkpointing=True)
    layers = decoder_layers(model)
    calls = []
    for i, layer in enumerate(layers):
        current = layer.__dict__["forward"]
        assert isinstance(current, LayerForward) and current.checkpoint is not None
        assert layer.gradient_checkpointing is False, "transformers' own checkpoint is off: no nesting"
        current.run = lambda *a, _run=current.run, _i=i, **kw: (calls.append(_i), _run(*a, **kw))[1]
    loss, grads = loss_and_grads(model)
    assert sorted(calls) == [0, 0, 1, 1], "the forward, then its recompute in backward: checkpoint outside run"

    plain_loss, plain_grads = loss_and_grads(layer_model(tiny_model, tmp_path, gradient_checkpointing=False))
    assert torch.equal(loss, plain_loss)
    assert grads.keys() == plain_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, plain_grads[name], rtol=1e-5, atol=1e-7, msg=name)


def test_without_checkpointing_or_compile_the_layers_run_as_the_class_defines(tiny_model, tmp_path):
    model = layer_model(tiny_model, tmp_path, gradient_checkpointing=False)
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
        model = layer_model(tiny_model, tmp_path, gradient_checkpointing=True, torch_compile=compile_setting,
                       compile_checkpoint=False)
        assert all(is_compiled(layer) for layer in decoder_layers(model)) is compile_setting
        saved = []

        def keep(tensor):
            saved.append((tuple(tensor.shape), tensor.dtype))
            return tensor

        batch = layer_batch(model.config.vocab_size)
        for _ in range(2):  # the second step runs the compiled graphs, the first compiles them
            saved.clear()
            with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
                loss = causal_lm_loss(model, batch, BATCH * (SEQ - 1))
            loss.backward()
        return sorted(saved, key=str)

    assert saved_shapes(True) == saved_shapes(False)


@pytest.mark.slow  # inductor's C++ compile of the checkpointed training graph: ~20 s on a 2-core machine
def test_a_checkpoint_compiled_with_the_layer_gives_eagers_loss_and_gradients_and_keeps_its_inputs(
        tiny_model, tmp_path, one_thread):
    """compile_checkpoint: the forward keeps what the eager checkpoint keeps (the layer inputs), besides
    references to the weights, the random states of the dropouts it replays in the recompute and the
    decoder's rotary cos/sin, which exist anyway; no activation inside a layer. With dropout the loss is
    eager's bit for bit."""
    def run(**kw):
        model = layer_model(tiny_model, tmp_path, gradient_checkpointing=True, lora_dropout=0.3, **kw)
        weights = {p.data_ptr() for p in model.parameters()}
        saved, references = [], Counter()

        def keep(tensor):
            if tensor.data_ptr() in weights:
                references["weight"] += 1
            elif tensor.dtype == torch.uint8:
                references["random state"] += 1
            else:
                saved.append((tuple(tensor.shape), tensor.dtype))
            return tensor

        batch = layer_batch(model.config.vocab_size)
        for _ in range(2):  # the first step compiles
            saved.clear()
            references.clear()
            model.zero_grad(set_to_none=True)
            torch.manual_seed(5)  # the same dropout masks in both runs
            with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
                loss = causal_lm_loss(model, batch, BATCH * (SEQ - 1))
            loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        return model, loss.detach(), grads, Counter(saved), references

    model, loss, grads, saved, references = run(torch_compile=True, compile_checkpoint=True)
    assert all(checkpoints_inside(layer) for layer in decoder_layers(model))
    _, eager_loss, eager_grads, eager_saved, _ = run(torch_compile=False)
    layers = len(decoder_layers(model))
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    assert saved - eager_saved == Counter({((1, SEQ, head_dim), torch.float32): 2 * layers})  # cos, sin
    assert eager_saved - saved == Counter()
    # At least one random state per LoRA dropout (q, k, v, o, gate, up, down), replayed in the recompute.
    assert references["random state"] >= 7 * layers and references["weight"] > 0
    assert torch.equal(loss, eager_loss)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, eager_grads[name], rtol=1e-5, atol=1e-7, msg=name)


def test_a_checkpoint_compiled_inside_runs_only_in_training_with_gradients(tiny_model, tmp_path):
    from relaytune.layers import compile_layers

    model = layer_model(tiny_model, tmp_path, gradient_checkpointing=True)
    layers = decoder_layers(model)
    compile_layers(layers, checkpoint_inside=True)  # lazy: nothing compiles until a call
    calls = []
    for layer in layers:
        current = layer_forward(layer)
        assert current.run_checkpointed is not None and is_compiled(layer)
        current.run_checkpointed = lambda *a, **kw: calls.append("inside")
        current.run = lambda *a, **kw: calls.append("plain")
    hidden = torch.zeros(1, 3, model.config.hidden_size)
    layers[0](hidden)
    with torch.no_grad():
        layers[0](hidden)
    layers[0].eval()
    layers[0](hidden)
    assert calls == ["inside", "plain", "plain"]
    compile_layers(layers, cuda_graphs=True, checkpoint_inside=True)
    assert not any(checkpoints_inside(layer) for layer in layers), "graphed layers use RecomputedLayer"
    plain = layer_model(tiny_model, tmp_path, gradient_checkpointing=False)
    compile_layers(decoder_layers(plain), checkpoint_inside=True)
    assert not any(checkpoints_inside(layer) for layer in decoder_layers(plain)), "nothing to compile inside"


def test_after_an_oom_a_checkpoint_compiled_inside_moves_outside(tiny_model, tmp_path, capsys):
    from relaytune.layers import compile_layers
    from relaytune.training.recovery import free_memory

    model = layer_model(tiny_model, tmp_path, gradient_checkpointing=True)
    layers = decoder_layers(model)
    compile_layers(layers, checkpoint_inside=True)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    free_memory(optimizer, model)
    assert all(is_compiled(layer) and not checkpoints_inside(layer) for layer in layers)
    assert ("out of memory with the checkpoint compiled inside the layers: it stays outside them for the rest "
            "of this session (compile_checkpoint), which lowers the backward's peak") in capsys.readouterr().err
    free_memory(optimizer, model)
    assert "compile_checkpoint" not in capsys.readouterr().err


def test_compile_checkpoint_waits_for_checkpointing_that_turns_on_after_the_model_loads(tiny_model, tmp_path,
                                                                                       capsys):
    """gradient_checkpointing: auto may turn on only after the model loads (a trial step ran out of
    memory without it). Until then there is no checkpoint to compile with the layer, which an explicit
    `true` is told; once it turns on, the checkpoint is compiled inside, as the planner counts it."""
    from relaytune.model import enable_checkpointing

    model = layer_model(tiny_model, tmp_path, torch_compile=True, gradient_checkpointing="auto",
                        compile_checkpoint=True)
    assert all(is_compiled(layer) and not checkpoints_inside(layer) for layer in decoder_layers(model))
    assert ("compile_checkpoint: not yet (gradient checkpointing is off as the model loads; the checkpoint is "
            "compiled with each layer if the trial step turns it on)") in capsys.readouterr().err
    enable_checkpointing(model)
    layers = decoder_layers(model)
    assert all(checkpoints_inside(layer) for layer in layers)
    assert len({id(layer_forward(layer).run_checkpointed) for layer in layers}) == 1, "one graph for all"


def test_a_checkpoint_moved_outside_after_an_oom_stays_outside_when_checkpointing_is_enabled_again(
        tiny_model, tmp_path):
    from relaytune.model import enable_checkpointing

    model = layer_model(tiny_model, tmp_path, torch_compile=True, gradient_checkpointing=True, compile_checkpoint=True)
    layers = decoder_layers(model)
    assert all(checkpoints_inside(layer) for layer in layers)
    assert move_checkpoints_outside(layers)
    enable_checkpointing(model)
    assert not any(checkpoints_inside(layer) for layer in layers)
