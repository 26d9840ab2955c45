"""offload_activations' copies (relaytune/activation_offload.py).

On the CPU, with the four copy steps replaced by recorders: exactly the checkpointed layer inputs go
to the host, in forward order, and each leaves the GPU as the next layer starts; backward takes the last
layer's input from the GPU and each other one back from the host, and taking layer i's starts layer
i-1's copy (one prefetch, never an input of an earlier step); the loss and every gradient are bit for
bit those of plain checkpointing. On a GPU (fp32): the real side-stream copies give the same loss and
gradients bit for bit over several steps, and after a backward that raised with a prefetch in flight,
and leave no GPU memory behind.
"""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
import torch.utils.checkpoint

from relaytune import activation_offload
from relaytune.config.schema import TrainConfig
from relaytune.errors import UserError
from relaytune.layers import decoder_layers
from relaytune.model import choose_precision, load_model
from relaytune.tiny import make_tiny_model
from relaytune.training.loss import causal_lm_loss

LAYERS = 4


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny4") / "model", layers=LAYERS)


def _model(folder, tmp_path, **kw):
    cfg = TrainConfig(model=str(folder), dataset="unused.jsonl", output_dir=str(tmp_path / "run"),
                      lora_dropout=0.0, gradient_checkpointing=True, torch_compile=False, **kw)
    precision = choose_precision(cfg)
    torch.manual_seed(0)
    model = load_model(cfg, precision)
    with torch.no_grad():  # a nonzero adapter, so that its gradients flow through every layer
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    model.train()
    return model, precision.device


def _loss_and_grads(model, device, seed: int, rows: int = 3, seq: int = 17):
    ids = torch.randint(10, model.config.vocab_size, (rows, seq), generator=torch.Generator().manual_seed(seed))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    batch = {k: v.to(device) for k, v in batch.items()}
    model.zero_grad(set_to_none=True)
    loss = causal_lm_loss(model, batch, rows * (seq - 1))
    loss.backward()
    return loss.detach().cpu(), {n: p.grad.cpu() for n, p in model.named_parameters() if p.requires_grad}


@pytest.fixture
def recorded_copies(monkeypatch):
    """The copy steps on the CPU, recorded: ("host", n) for the n-th input offloaded, ("release", n) for its
    GPU tensor let go, ("back", n) for a copy back started, ("use", n) for a copy back handed to backward."""
    events, index, numbers = [], {}, itertools.count()

    def copy_to_host(tensor):
        host = tensor.detach().clone()
        index[id(host)] = next(numbers)  # not len(index): a dead host tensor's id can come back
        events.append(("host", index[id(host)], tuple(tensor.shape)))
        return host, "copied"

    def release_source(item):
        assert item.copied == "copied"
        events.append(("release", index[id(item.host)]))
        tensor, item.source = item.source, None
        return tensor

    def start_copy_back(item):
        events.append(("back", index[id(item.host)]))
        item.reloaded, item.ready = item.host.clone(), "copied"

    def wait_for_copy_back(item):
        assert item.ready == "copied"
        events.append(("use", index[id(item.host)]))
        tensor, item.reloaded = item.reloaded, None
        return tensor

    monkeypatch.setattr(activation_offload, "OFFLOADED_DEVICE_TYPES", ("cpu",))
    for step in (copy_to_host, release_source, start_copy_back, wait_for_copy_back):
        monkeypatch.setattr(activation_offload, step.__name__, step)
    return events


def test_backward_takes_each_layer_input_back_and_starts_the_one_before_it(
        four_layers, tmp_path, one_thread, recorded_copies):
    model, device = _model(four_layers, tmp_path, offload_activations=True)
    layers = decoder_layers(model)
    assert len(layers) == LAYERS
    for i, layer in enumerate(layers):  # the layer's first module: it runs in forward and in the recompute
        layer.input_layernorm.register_forward_pre_hook(lambda module, args, i=i: recorded_copies.append(("run", i)))
    shape = (3, 17, model.config.hidden_size)
    for step in range(2):
        recorded_copies.clear()
        _loss_and_grads(model, device, seed=step)
        first = step * LAYERS  # the inputs offloaded in this step are numbered from here
        # Each layer's input leaves the GPU as the next layer starts, after its copy to the host.
        forward = [("host", first, shape), ("run", 0)]
        for i in range(1, LAYERS):
            forward += [("release", first + i - 1), ("host", first + i, shape), ("run", i)]
        assert recorded_copies[:len(forward)] == forward
        # Backward takes the last layer's input from the GPU, and fetches each other one a layer ahead: its
        # copy starts before the layer after it is recomputed. The first step's inputs are not fetched again.
        backward = []
        for i in reversed(range(LAYERS)):
            take = ("release", first + i) if i == LAYERS - 1 else ("use", first + i)
            backward += [take] + ([("back", first + i - 1)] if i else []) + [("run", i)]
        assert recorded_copies[len(forward):] == backward


def _toy_pass(weights, x, extra):
    """A stack of checkpointed toy layers that each take two tensors (as Gemma3n's layers take a per-layer
    input besides the hidden states), through relaytune's offloaded checkpoint."""
    checkpoint = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
    h = x
    for i, w in enumerate(weights):
        layer = functools.partial(lambda a, b, w: torch.tanh(a * w + b), w=w)
        h = activation_offload.offloaded_checkpoint(checkpoint, i == 0, layer, h, extra)
    return h.sum()


def test_a_layer_with_two_inputs_gets_both_prefetched_and_none_copied_twice(recorded_copies):
    weights = [torch.full((4,), 0.5 + i, requires_grad=True) for i in range(3)]
    x, extra = torch.randn(2, 4, requires_grad=True), torch.randn(2, 4, requires_grad=True)
    _toy_pass(weights, x, extra).backward()
    end = max(i for i, e in enumerate(recorded_copies) if e[0] == "host") + 1
    forward, events = recorded_copies[:end], recorded_copies[end:]
    assert [e[1] for e in forward if e[0] == "host"] == list(range(6))  # layer k: inputs 2k, 2k+1
    assert [e[1] for e in forward if e[0] == "release"] == list(range(4)), "layers 0 and 1 left the GPU"
    assert sorted(e[1] for e in events if e[0] == "back") == list(range(4)), "each input copied back once"
    assert sorted(e[1] for e in events if e[0] == "release") == [4, 5], "the last layer's, from the GPU"
    for layer in (0, 1):
        # Taking the first input of the layer after it starts both of its copies, before the next one is taken.
        taken = [i for i, e in enumerate(events) if e[0] in ("use", "release")]
        first = next(i for i in taken if events[i][1] // 2 == layer + 1)
        until = next(i for i in taken if i > first)
        assert {("back", 2 * layer), ("back", 2 * layer + 1)} <= set(events[first + 1:until]), events


def test_a_new_forward_pass_never_prefetches_an_older_graphs_inputs(recorded_copies):
    weights = [torch.full((4,), 0.5 + i, requires_grad=True) for i in range(2)]
    x, extra = torch.randn(2, 4, requires_grad=True), torch.randn(2, 4, requires_grad=True)
    older = _toy_pass(weights, x, extra)  # its graph stays alive while the next pass runs
    recorded_copies.clear()
    _toy_pass(weights, x, extra).backward()
    newer = {e[1] for e in recorded_copies if e[0] == "host"}
    assert {e[1] for e in recorded_copies if e[0] in ("back", "release")} == newer
    older.backward()


def test_a_layer_that_writes_its_input_in_place_is_refused_by_name(recorded_copies):
    checkpoint = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
    h = torch.randn(2, 4, requires_grad=True) * 1.0
    with pytest.raises(UserError) as e:
        activation_offload.offloaded_checkpoint(checkpoint, True, lambda a: a.mul_(2).sum(), h)
    assert str(e.value) == ("offload_activations: this model's decoder layer writes its input in place, which "
                            "would race the input's copy to host memory; set offload_activations: false")


def test_offloaded_inputs_keep_the_loss_and_every_gradient_bit_for_bit(
        four_layers, tmp_path, one_thread, recorded_copies):
    results = {}
    for offload in (False, True):
        recorded_copies.clear()
        model, device = _model(four_layers, tmp_path, offload_activations=offload)
        results[offload] = _loss_and_grads(model, device, seed=7)
        # Each to the host and let go on the GPU; all but the last layer's back and used.
        assert len(recorded_copies) == (4 * LAYERS - 2 if offload else 0)
    (loss0, grads0), (loss1, grads1) = results[False], results[True]
    assert torch.equal(loss0, loss1)
    assert grads0.keys() == grads1.keys() and len(grads0) > 0
    for name, grad in grads0.items():
        assert torch.equal(grad, grads1[name]), name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the side-stream copies to pinned memory need CUDA")
def test_cuda_side_stream_copies_keep_every_gradient_bit_for_bit_and_free_their_memory(tmp_path, monkeypatch):
    """fp32 and SDPA's math kernel (deterministic), so both runs are the same kernels on the same values;
    rows long enough that each layer's copy takes longer than a few of its kernels, so a missing wait
    would show as a wrong gradient."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    folder = make_tiny_model(tmp_path / "model", layers=LAYERS, hidden=256, intermediate=512, heads=4, kv_heads=2)
    monkeypatch.setattr(activation_offload, "_side_streams", {})
    results = {}
    for offload in (False, True):
        model, device = _model(folder, tmp_path, offload_activations=offload, bf16=False)
        assert device.type == "cuda" and next(model.parameters()).dtype == torch.float32
        with sdpa_kernel(SDPBackend.MATH):
            runs = [_loss_and_grads(model, device, seed=step, rows=8, seq=1024) for step in range(3)]
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            runs.append(_loss_and_grads(model, device, seed=3, rows=8, seq=1024))
            torch.cuda.synchronize()
        results[offload] = runs
        assert torch.cuda.memory_allocated() == before, "a step left GPU memory behind"
        assert bool(activation_offload._side_streams) == offload
    for (loss0, grads0), (loss1, grads1) in zip(results[False], results[True]):
        assert torch.equal(loss0, loss1)
        for name, grad in grads0.items():
            assert torch.equal(grad, grads1[name]), name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the side-stream copies to pinned memory need CUDA")
def test_cuda_a_backward_that_raises_with_a_prefetch_in_flight_leaves_the_next_step_exact(tmp_path, monkeypatch):
    """A prefetch that backward never takes goes back to the pool after its copy: the step after a raised
    backward gives plain checkpointing's loss and gradients bit for bit, and no GPU memory stays behind."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    folder = make_tiny_model(tmp_path / "model", layers=LAYERS, hidden=256, intermediate=512, heads=4, kv_heads=2)
    monkeypatch.setattr(activation_offload, "_side_streams", {})
    plain, device = _model(folder, tmp_path, offload_activations=False, bf16=False)
    with sdpa_kernel(SDPBackend.MATH):
        expected = _loss_and_grads(plain, device, seed=5, rows=8, seq=1024)
        model, _ = _model(folder, tmp_path, offload_activations=True, bf16=False)
        _loss_and_grads(model, device, seed=4, rows=8, seq=1024)  # the first step's allocations
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        def stop(grad):
            raise RuntimeError("stop in layer 2")

        weight = next(p for n, p in model.named_parameters() if "layers.2." in n and "lora_A" in n)
        handle = weight.register_hook(stop)
        try:  # layer 2's backward has started layer 1's prefetch when the hook raises
            _loss_and_grads(model, device, seed=6, rows=8, seq=1024)
        except RuntimeError as error:
            assert str(error) == "stop in layer 2"
        handle.remove()
        got = _loss_and_grads(model, device, seed=5, rows=8, seq=1024)
        torch.cuda.synchronize()
    assert torch.equal(expected[0], got[0])
    for name, grad in expected[1].items():
        assert torch.equal(grad, got[1][name]), name
    assert torch.cuda.memory_allocated() == before, "the raised step left GPU memory behind"
