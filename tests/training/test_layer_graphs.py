"""Layers that replay CUDA graphs (relaytune/layers.py, `cuda_graphs`): RecomputedLayer, the checkpoint
that graph replays can sit under, its gradients, autocast and RNG against the ordinary checkpoint, what
it keeps alive, and how the layers compile for graphs and give them up after an OOM (on the CPU, where
Inductor compiles for graphs but skips recording them)."""

from __future__ import annotations

import pytest
import torch
from support.layer_cases import BATCH, SEQ, layer_batch, layer_model, loss_and_grads

from relaytune.layers import (
    decoder_layers,
    is_compiled,
    layer_forward,
)
from relaytune.training.loss import causal_lm_loss


def _graphed(model) -> list:
    """Every layer checkpointed by RecomputedLayer, its forwards recorded: (layer, grad enabled, output)."""
    calls = []
    for i, layer in enumerate(decoder_layers(model)):
        current = layer_forward(layer)
        current.graphed = True

        def run(*a, _run=current.run, _i=i, **kw):
            out = _run(*a, **kw)
            calls.append((_i, torch.is_grad_enabled(), out))
            return out
        current.run = run
    return calls


def test_the_graph_checkpoint_gives_the_ordinary_checkpoints_gradients_with_dropout(tiny_model, tmp_path,
                                                                                    one_thread):
    """RecomputedLayer (the checkpoint for CUDA-graphed layers) draws the same dropout masks in its
    recompute, so its loss and gradients are the ordinary checkpoint's bit for bit; accumulation adds."""
    def run(graphed: bool, backwards: int = 1):
        model = layer_model(tiny_model, tmp_path, gradient_checkpointing=True, lora_dropout=0.3)
        calls = _graphed(model) if graphed else []
        torch.manual_seed(5)
        for _ in range(backwards):
            loss, grads = loss_and_grads(model)
        return loss, grads, calls

    loss, grads, _ = run(False)
    graphed_loss, graphed_grads, calls = run(True)
    assert torch.equal(loss, graphed_loss)
    assert grads.keys() == graphed_grads.keys() and len(grads) > 0
    for name, grad in grads.items():
        assert torch.equal(grad, graphed_grads[name]), name
    assert [(i, grad) for i, grad, _ in calls] == [(0, False), (1, False), (1, True), (0, True)], \
        "the forward under no_grad, then each layer's recompute with gradients in backward"
    no_dropout = layer_model(tiny_model, tmp_path, gradient_checkpointing=True)
    _graphed(no_dropout)
    torch.manual_seed(5)
    plain = loss_and_grads(no_dropout)[1]
    # LoRA's B starts at zero, so dropout changes no loss yet, but it changes B's gradients.
    assert any(not torch.equal(plain[n], g) for n, g in grads.items() if "lora_B" in n), "dropout acted"

    _, twice, _ = run(False, backwards=2)  # the second backward adds into the gradients of the first
    _, graphed_twice, _ = run(True, backwards=2)
    for name, grad in twice.items():
        assert torch.equal(grad, graphed_twice[name]), name
        assert "lora_A" in name or not torch.equal(grad, grads[name]), name  # A's gradients are 0 while B is


def test_the_graph_checkpoint_recomputes_under_the_forwards_autocast(tiny_model, tmp_path, one_thread):
    """Backward runs outside the caller's autocast; the recompute must not fall back to fp32."""
    def run(graphed: bool):
        model = layer_model(tiny_model, tmp_path, gradient_checkpointing=True, lora_dropout=0.3)
        calls = _graphed(model) if graphed else []
        torch.manual_seed(5)
        batch = layer_batch(model.config.vocab_size)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = causal_lm_loss(model, batch, BATCH * (SEQ - 1))
        loss.backward()
        return loss, {n: p.grad for n, p in model.named_parameters() if p.requires_grad}, calls

    loss, grads, _ = run(False)
    graphed_loss, graphed_grads, calls = run(True)
    assert torch.equal(loss, graphed_loss)
    for name, grad in grads.items():
        assert torch.equal(grad, graphed_grads[name]), name
    assert len(calls) == 4  # each layer's no_grad forward and its recompute


def test_the_graph_checkpoint_hands_out_no_tensor_a_replay_would_overwrite(tiny_model, tmp_path, one_thread):
    model = layer_model(tiny_model, tmp_path, gradient_checkpointing=True)
    calls = _graphed(model)
    kept = []
    base = model.get_base_model().model
    handle = base.layers[1].register_forward_hook(lambda mod, args, kwargs, out: kept.append((args[0], out)),
                                                  with_kwargs=True)
    grads_in = []
    hook = base.layers[1].register_full_backward_hook(lambda mod, gin, gout: grads_in.append(gin[0]))
    loss_and_grads(model)
    handle.remove()
    hook.remove()
    first_forward_outputs = {i: out for i, grad, out in calls if not grad}
    layer1_input, layer1_output = kept[0]
    assert layer1_output.data_ptr() != first_forward_outputs[1].data_ptr(), "the output is a clone"
    assert layer1_input.data_ptr() != first_forward_outputs[0].data_ptr(), "so is the next layer's input"
    recompute_outputs = [out for _, grad, out in calls if grad]
    assert all(g is None or g.data_ptr() != o.data_ptr() for g in grads_in for o in recompute_outputs)


def test_the_graph_checkpoint_leaves_a_layer_with_another_gradient_input_to_the_ordinary_one():
    from relaytune.layers import RecomputedLayer

    hidden = torch.ones(2, 3, requires_grad=True)
    assert RecomputedLayer.can_run((hidden,), {"position_embeddings": (torch.ones(3), torch.ones(3))})
    assert not RecomputedLayer.can_run((hidden,), {"encoder_states": torch.ones(3, requires_grad=True)})
    assert not RecomputedLayer.can_run((hidden,), {"pair": (torch.ones(3, requires_grad=True), None)})
    assert not RecomputedLayer.can_run((hidden, torch.ones(3)), {})


@pytest.mark.slow  # inductor's C++ compile of a no_grad and a training graph: ~30 s on a 2-core machine
@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["compiled", "compiled-for-graphs"])
def test_compiled_layers_draw_eagers_dropout_masks(tiny_model, tmp_path, one_thread, cuda_graphs):
    """Compiled layers draw random numbers with ATen's generator (`fallback_random`), so their dropout
    masks are eager's and the gradients are eager's up to rounding. For CUDA graphs (compiled on the
    CPU, where Inductor skips the graphs themselves) the no_grad forward and the recompute are two
    compiled graphs, and both draw eager's masks. (With Inductor's own random numbers the two graphs
    drew different masks here: 0.048 apart.)"""
    from relaytune.layers import compile_layers

    def run(compiled: bool):
        model = layer_model(tiny_model, tmp_path, gradient_checkpointing=True, lora_dropout=0.3)
        if compiled:
            compile_layers(decoder_layers(model), cuda_graphs=cuda_graphs)
            assert all(is_compiled(layer) and layer_forward(layer).graphed == cuda_graphs
                       for layer in decoder_layers(model))
        torch.manual_seed(5)
        return loss_and_grads(model)

    loss, grads = run(False)
    compiled_loss, compiled_grads = run(True)
    torch.testing.assert_close(compiled_loss, loss, rtol=1e-6, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(compiled_grads[name], grad, rtol=1e-4, atol=1e-7, msg=name)
    assert any(grad.abs().max() > 1e-4 for name, grad in grads.items() if "lora_B" in name)


@pytest.mark.slow  # inductor's C++ compile of a no_grad and a training graph: ~30 s on a 2-core machine
def test_a_recompute_output_the_graphs_keep_does_not_keep_the_layers_input(tiny_model, tmp_path, one_thread):
    """cudagraph trees hand back the same output tensor at every replay, so the recompute's output
    outlives the backward. Once the gradients are taken, that output must not keep the compiled
    graph's context, which refers to the layer's input (a step's checkpointed clone): on an H200 that
    kept 35 clones of 8 MiB one step too long. Here the trees' cache is a list that keeps the outputs."""
    import gc

    from torch.multiprocessing.reductions import StorageWeakRef

    from relaytune.layers import compile_layers

    model = layer_model(tiny_model, tmp_path, gradient_checkpointing=True, lora_dropout=0.3)
    compile_layers(decoder_layers(model), cuda_graphs=True)  # no graphs on the CPU: the checkpoint is the same
    kept, recompute_inputs = [], []
    for layer in decoder_layers(model):
        current = layer_forward(layer)

        def run(layer, hidden, *a, _run=current.run, **kw):
            out = _run(layer, hidden, *a, **kw)
            if torch.is_grad_enabled():
                recompute_inputs.append(StorageWeakRef(hidden.untyped_storage()))
                kept.append(out)  # as the trees' cached output tensor
            return out
        current.run = run
    loss_and_grads(model)
    gc.collect()
    assert len(recompute_inputs) == len(decoder_layers(model))
    assert [ref.expired() for ref in recompute_inputs] == [True] * len(recompute_inputs), \
        "each layer's checkpointed input is freed by the step's backward"
    assert all(out.grad_fn is None for out in kept)


def test_a_graphed_layer_hands_out_a_copy_in_evaluation_too(tiny_model, tmp_path):
    model = layer_model(tiny_model, tmp_path, gradient_checkpointing=True)
    calls = _graphed(model)
    model.eval()
    kept = []
    handle = decoder_layers(model)[0].register_forward_hook(lambda mod, args, out: kept.append(out))
    with torch.no_grad():
        model(**layer_batch(model.config.vocab_size))
    handle.remove()
    assert [(i, grad) for i, grad, _ in calls] == [(0, False), (1, False)]
    assert kept[0].data_ptr() != calls[0][2].data_ptr() and torch.equal(kept[0], calls[0][2])


def test_a_graphed_layer_the_graph_checkpoint_cannot_take_runs_eagerly_under_the_ordinary_one():
    import functools

    class Double(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(3))

        def forward(self, x, **kwargs):
            return x * self.w * 2

    def replay(*args, **kwargs):
        raise AssertionError("a graph replayed under torch.utils.checkpoint")

    layer = Double()
    current = layer_forward(layer)
    current.checkpoint = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
    current.run, current.graphed = replay, True
    hidden = torch.full((3,), 3.0, requires_grad=True)
    layer(hidden, other=torch.ones(1, requires_grad=True)).sum().backward()  # `other` needs a gradient too
    assert layer.w.grad.tolist() == [6.0, 6.0, 6.0] and hidden.grad.tolist() == [2.0, 2.0, 2.0]


def test_graphed_layers_compile_without_pointwise_autotuning(tiny_model, tmp_path, monkeypatch):
    """Under CUDA graphs Inductor's first-run benchmark of a pointwise kernel ran inside the graphs'
    memory pool, which kept its buffers (+0.10 GiB on an H200, bench/results/cuda-graphs-h200.md,
    section 5): graphed layers turn that autotuning off, other compiled layers keep it."""
    from torch._inductor import config as inductor_config

    from relaytune.layers import compile_layers

    layers = decoder_layers(layer_model(tiny_model, tmp_path, gradient_checkpointing=True))
    asked = []
    monkeypatch.setattr(torch, "compile", lambda fn, options=None: asked.append(options) or fn)
    compile_layers(layers, cuda_graphs=False)
    compile_layers(layers, cuda_graphs=True)
    assert asked == [{"fallback_random": True},
                     {"fallback_random": True, "triton.cudagraphs": True, "triton.autotune_pointwise": False}]
    assert set(asked[1]) <= set(inductor_config.get_config_copy())  # names Inductor knows


def test_after_an_oom_graphed_layers_compile_again_without_graphs_and_the_graphs_are_freed(
        tiny_model, tmp_path, monkeypatch, capsys):
    from relaytune.layers import compile_layers, drop_cuda_graphs
    from relaytune.training.recovery import free_memory

    model = layer_model(tiny_model, tmp_path, gradient_checkpointing=True)
    layers = decoder_layers(model)
    compile_layers(layers, cuda_graphs=True)  # torch.compile is lazy: nothing compiles until a call
    resets = []
    monkeypatch.setattr("torch._inductor.cudagraph_trees.reset_cudagraph_trees", lambda: resets.append(1))
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    free_memory(optimizer, model)
    assert all(is_compiled(layer) and not layer_forward(layer).graphed for layer in layers)
    assert resets == [1]
    assert "out of memory with CUDA graphs on: the layers run without them" in capsys.readouterr().err
    assert drop_cuda_graphs(layers) is False and resets == [1]  # nothing left to drop
    free_memory(optimizer, model)
    assert "CUDA graphs" not in capsys.readouterr().err

