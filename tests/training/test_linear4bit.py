"""bitsandbytes' 4-bit linear layers as torch ops inside compiled layers (relaytune/linear4bit.py): the
same weights bit for bit as bitsandbytes' dequantization, bitsandbytes' own forward outside a compiled
region, and, compiled, no bitsandbytes op in the graph and no dequantized weight kept for backward."""

from __future__ import annotations

import re

import pytest
import torch

bnb = pytest.importorskip("bitsandbytes")

from relaytune.linear4bit import (  # noqa: E402
    code_table,
    dequantize,
    fusable,
    fuse_4bit_linears,
    unfuse_4bit_linears,
)

BF16 = torch.bfloat16


def _linear4bit(rows=96, cols=128, bias=True, quant_type="nf4", nested=True, compute=BF16, seed=0,
                device="cpu", storage=torch.uint8):
    torch.manual_seed(seed)
    plain = torch.nn.Linear(cols, rows, bias=bias, dtype=BF16)
    layer = bnb.nn.Linear4bit(cols, rows, bias=bias, compute_dtype=compute, quant_type=quant_type,
                              compress_statistics=nested, quant_storage=storage)
    layer.weight = bnb.nn.Params4bit(plain.weight.data.clone(), requires_grad=False,
                                     quant_type=quant_type, compress_statistics=nested, quant_storage=storage)
    if bias:
        layer.bias = torch.nn.Parameter(plain.bias.data.clone(), requires_grad=False)
    return layer.to(device)  # quantizes


class Block(torch.nn.Module):
    """Two 4-bit projections of one input between trainable layers, as a QLoRA decoder layer's MLP."""

    def __init__(self, device="cpu", **kw):
        super().__init__()
        self.proj = _linear4bit(**kw, device=device)
        self.gate = _linear4bit(**kw, seed=2, device=device)
        self.head = torch.nn.Linear(self.proj.out_features, 8, dtype=BF16, device=device)

    def forward(self, x):
        return self.head(torch.relu(self.proj(x)) * self.gate(x))


def _input(cols=128, seed=1, device="cpu"):
    x = torch.randn(2, 5, cols, dtype=BF16, generator=torch.Generator().manual_seed(seed))
    return x.to(device).requires_grad_()


def _run(module, x):
    out = module(x)
    out.float().square().sum().backward()
    grads = (x.grad.clone(), module.head.weight.grad.clone())
    x.grad = None
    module.zero_grad(set_to_none=True)
    return out.detach(), grads


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("nested", [True, False])
@pytest.mark.parametrize("shape", [(96, 128), (320, 192)])  # 192 blocks; 960: a partial nested block
def test_dequantize_is_bitsandbytes_bit_for_bit(quant_type, nested, shape):
    layer = _linear4bit(*shape, quant_type=quant_type, nested=nested)
    state = layer.weight.quant_state
    expected = bnb.functional.dequantize_4bit(layer.weight, state)
    inner = (state.state2.code, state.state2.absmax, state.offset) if nested else None
    table = code_table(quant_type, torch.device("cpu"))
    got = dequantize(layer.weight, state.absmax, table, state.blocksize, tuple(state.shape), BF16, inner)
    assert got.shape == expected.shape == shape and got.dtype == BF16
    torch.testing.assert_close(got, expected, rtol=0.02, atol=5e-3)  # a misread layout is far off
    assert torch.equal(table, state.code.float()), "the table is the code bitsandbytes stores"


def test_outside_a_compiled_region_the_fused_layer_is_bitsandbytes(one_thread):
    block, x = Block(), _input()
    before = _run(block, x)
    assert fuse_4bit_linears([block], BF16) == 2
    assert type(block.proj).__name__ == "FusedLinear4bit" and isinstance(block.proj, bnb.nn.Linear4bit)
    after = _run(block, x)
    assert torch.equal(after[0], before[0]) and all(map(torch.equal, after[1], before[1]))
    assert fuse_4bit_linears([block], BF16) == 0, "already fused"
    unfuse_4bit_linears([block])
    assert type(block.proj) is bnb.nn.Linear4bit and not hasattr(block.proj, "relaytune_code_table")


def test_whole_weights_in_the_autocast_dtype_are_fused_whatever_their_storage():
    assert fusable(_linear4bit(), BF16) and fusable(_linear4bit(), None)
    assert not fusable(_linear4bit(compute=torch.float32), BF16), "autocast would change its matmul's dtype"
    assert not fusable(torch.nn.Linear(4, 4), BF16)
    for storage in (BF16, torch.float16, torch.float32):
        assert fusable(_linear4bit(storage=storage), BF16), storage
    sharded = _linear4bit(storage=BF16)
    # FSDP replaces each Params4bit with a plain parameter holding its shard (a DTensor).
    sharded.weight = torch.nn.Parameter(sharded.weight.data.clone(), requires_grad=False)
    assert not fusable(sharded, BF16), "a sharded 4-bit weight keeps bitsandbytes' matmul"


@pytest.mark.parametrize("storage", [BF16, torch.float16, torch.float32])
def test_a_float_quant_storage_dequantizes_to_the_same_weight_as_uint8(storage):
    """bnb_4bit_quant_storage only reinterprets the packed bytes: read back as bytes, the fused layer
    dequantizes exactly what bitsandbytes does from the same storage."""
    layer, plain = _linear4bit(storage=storage), _linear4bit()
    state = layer.weight.quant_state
    assert layer.weight.dtype == storage and torch.equal(layer.weight.view(torch.uint8).view(-1), plain.weight.view(-1))
    table = code_table("nf4", torch.device("cpu"))
    nested = (state.state2.code, state.state2.absmax, state.offset)
    got = dequantize(layer.weight.view(torch.uint8), state.absmax, table, state.blocksize, tuple(state.shape),
                     BF16, nested)
    assert torch.equal(got, dequantize(plain.weight, state.absmax, table, state.blocksize, tuple(state.shape),
                                       BF16, nested))
    torch.testing.assert_close(got, bnb.functional.dequantize_4bit(layer.weight, state), rtol=0.02, atol=5e-3)


def test_a_compiled_checkpoint_gives_way_to_4bit_matmuls_that_stay_bitsandbytes(tiny_model, tmp_path,
                                                                                  monkeypatch, capsys):
    """On an H200, Llama-3-8B with a float quant storage (then not fused) and its checkpoint compiled
    inside peaked at 16.7 GiB against 7.5; the inferred cause is the compiled checkpoint keeping each
    dequantized weight for backward, so it stays outside wherever a 4-bit layer was not fused."""
    from relaytune import linear4bit
    from relaytune.config.schema import TrainConfig
    from relaytune.layers import checkpoints_inside, decoder_layers
    from relaytune.model import choose_precision, load_model

    def load(**kw):
        cfg = TrainConfig(model=str(tiny_model), dataset="unused.jsonl", output_dir=str(tmp_path / "run"),
                          load_in_4bit=True, torch_compile=True, gradient_checkpointing=True,
                          compile_checkpoint=True, **kw)
        return decoder_layers(load_model(cfg, choose_precision(cfg)))

    layers = load(bnb_4bit_quant_storage="bfloat16")
    assert all(map(checkpoints_inside, layers)) and linear4bit.unfused_4bit_linears(layers) == 0
    assert "4-bit matmuls as torch ops), checkpoint compiled inside" in capsys.readouterr().err
    monkeypatch.setattr(linear4bit, "fusable", lambda module, autocast: False)
    layers = load()
    assert not any(map(checkpoints_inside, layers))
    err = capsys.readouterr().err
    count = 7 * len(layers)  # q, k, v, o, gate, up, down
    assert linear4bit.unfused_4bit_linears(layers) == count
    assert (f"compile_checkpoint: off ({count} 4-bit matmuls stay bitsandbytes' own ops, and a compiled "
            "checkpoint would keep each one's dequantized weight for backward)") in err
    assert "not yet" not in err


@pytest.mark.slow
@pytest.mark.parametrize("storage", [torch.uint8, BF16])
def test_compiled_the_graph_has_no_bitsandbytes_op_and_keeps_no_dequantized_weight(one_thread, storage):
    """Each weight is dequantized by a kernel of its own, just before its matmul, in forward and again
    in backward; a kernel that dequantized both (Inductor fuses kernels that share a read) would keep
    both weights alive at once."""
    from torch._inductor.utils import run_and_get_code

    block, x = Block(rows=96, cols=128, storage=storage), _input()
    expected = _run(block, x)
    fuse_4bit_linears([block], BF16)
    compiled = torch.compile(block)
    kept: list[tuple[tuple[int, ...], torch.dtype]] = []

    def step():
        with torch.autograd.graph.saved_tensors_hooks(
                lambda t: (kept.append((tuple(t.shape), t.dtype)), t)[1], lambda t: t):
            return _run(compiled, x)

    got, code = run_and_get_code(step)
    assert torch.equal(got[0], expected[0]) and all(map(torch.equal, got[1], expected[1]))
    source = "\n".join(code)
    assert "bitsandbytes" not in source
    calls = re.findall(r"(cpp_fused_\w*bitwise_and\w*)\(", source)
    assert len(calls) == 4, f"one kernel per weight, forward and backward: {calls}"
    assert ((96, 128), BF16) not in kept, f"the dequantized weight was kept for backward: {kept}"
    packed = (block.proj.weight.shape[0], 1), storage  # as stored: 6,144 bytes, as uint8 or as 3,072 bf16
    assert packed in kept, f"backward dequantizes the packed weight again: {kept}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bitsandbytes' CUDA kernels")
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_on_cuda_compiled_dequantization_and_forward_are_bitsandbytes(quant_type):
    """Inductor's generated kernel against bitsandbytes' CUDA kernel (not its CPU code), and a compiled
    block against bitsandbytes' eager forward (run on an H200, seventh session)."""
    layer = _linear4bit(256, 2048, quant_type=quant_type, device="cuda")
    state = layer.weight.quant_state
    inner = (state.state2.code, state.state2.absmax, state.offset)
    table = code_table(quant_type, layer.weight.device)
    got = torch.compile(dequantize)(layer.weight, state.absmax, table, state.blocksize,
                                    tuple(state.shape), BF16, inner)
    assert torch.equal(got, bnb.functional.dequantize_4bit(layer.weight, state))

    block, x = Block(rows=256, cols=2048, quant_type=quant_type, device="cuda"), _input(2048, device="cuda")
    expected = _run(block, x)
    fuse_4bit_linears([block], BF16)
    got = _run(torch.compile(block), x)
    # Inductor computes relu(proj) * gate in fp32 and rounds once, eager rounds each to bf16 (on the H200
    # outputs near zero differed by more than bf16's default atol of 1e-5); a misread weight is far off.
    torch.testing.assert_close(got[0], expected[0], rtol=0.02, atol=2e-3)
    torch.testing.assert_close(got[1][0], expected[1][0], rtol=0.02, atol=2e-3)


@pytest.mark.slow
def test_a_weight_bitsandbytes_repacked_for_cpu_inference_stays_with_bitsandbytes(one_thread):
    """On CPUs with AVX512-BF16, bitsandbytes repacks a 4-bit weight in place the first time it runs
    in eval mode without gradients; the fused layer's dequantization would misread that layout."""
    block = Block().eval()
    fuse_4bit_linears([block], BF16)
    x = _input().detach()
    with torch.no_grad():
        expected = block(x)
        if not getattr(block.proj.weight.quant_state, "packing_format_for_cpu", False):
            pytest.skip("bitsandbytes did not repack on this CPU")
        got = torch.compile(block)(x)
    torch.testing.assert_close(got, expected, rtol=0.02, atol=5e-3)  # a misread layout is far off
