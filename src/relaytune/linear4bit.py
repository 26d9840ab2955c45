"""bitsandbytes' 4-bit linear layers as plain torch ops inside compiled decoder layers.

bitsandbytes runs a 4-bit matmul as an opaque custom op: past 1,536 rows (every training micro-batch
of a few sequences) it dequantizes the nested absmax, adds its offset, dequantizes the weight and
calls `linear`, each step a Python call through the dispatcher. In a compiled layer Inductor can only
call that op as it is: on an H200 it took ~256 us of host time per call under the profiler, 504
calls per step of Qwen2.5-3B QLoRA, and short steps waited on the host
(bench/results/vs-trl-h200.md). Written as torch ops, the whole dequantization is one generated
kernel feeding the matmul, and backward dequantizes again instead of keeping the dequantized weight,
as bitsandbytes' own MatMul4Bit does.

The dequantization reproduces bitsandbytes' bit for bit: the 16-entry code table is read from
bitsandbytes' own kernel, each weight is code[nibble] * absmax in fp32 rounded once to the compute
dtype (tests/training/test_linear4bit.py compares them). Outside a compiled region the layer runs
bitsandbytes' forward unchanged.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

TABLE_BLOCK = 64  # a block size every bitsandbytes backend accepts, to read its code table
STORAGE_DTYPES = (torch.uint8, torch.bfloat16, torch.float16, torch.float32)  # bnb_4bit_quant_storage's


def dequantize(packed, absmax, table, blocksize: int, shape, dtype, nested=None) -> torch.Tensor:
    """The [N, K] weight from its packed nibbles (two per byte, the high one first), one fp32 absmax
    per `blocksize` values (`nested`: (code, absmax, offset) when the absmax are themselves 8-bit
    quantized in blocks of 256), and the 16 values of the 4-bit code. Broadcasts only, so that
    Inductor generates one kernel for all of it."""
    if nested is not None:
        code, absmax2, offset = nested
        per_block = absmax2.view(-1, 1).expand(-1, 256).reshape(-1)[: absmax.numel()]
        absmax = code[absmax.view(-1).long()] * per_block + offset
    shifts = torch.tensor([4, 0], dtype=torch.uint8, device=packed.device)
    nibbles = ((packed.view(-1, 1) >> shifts) & 15).view(-1)
    values = table[nibbles.long()].view(-1, blocksize) * absmax.view(-1, 1)
    return values.to(dtype).view(shape)


def linear_4bit(x, weight, bias, table) -> torch.Tensor:
    """x @ W.T + bias for a bitsandbytes Params4bit W, for compiled code. The dequantization runs
    under a checkpoint so that the compiled graph recomputes it in backward from the packed weight
    rather than keeping the dequantized one (without it, AOTAutograd kept a compute-dtype copy of
    every weight for backward: tests/training/test_linear4bit.py)."""
    state = weight.quant_state
    nested = (state.state2.code, state.state2.absmax, state.offset) if state.nested else None
    packed = weight if weight.dtype == torch.uint8 else weight.view(torch.uint8)  # a float quant storage
    full = checkpoint(
        dequantize, packed, state.absmax, table, state.blocksize, tuple(state.shape), x.dtype, nested,
        use_reentrant=False)
    return torch.nn.functional.linear(x, full, bias)


_tables: dict[tuple[str, str], torch.Tensor] = {}


def code_table(quant_type: str, device: torch.device) -> torch.Tensor:
    """The 16 fp32 values of `quant_type` exactly as bitsandbytes' kernels on `device` decode them."""
    key = (quant_type, str(device))
    if key not in _tables:
        nibbles = torch.arange(16, dtype=torch.uint8, device=device).repeat(TABLE_BLOCK // 16)
        packed = (nibbles[0::2] << 4 | nibbles[1::2]).view(-1, 1)
        ones = torch.ones(1, dtype=torch.float32, device=device)
        decoded = torch.ops.bitsandbytes.dequantize_4bit.default(
            packed, ones, TABLE_BLOCK, quant_type, (TABLE_BLOCK,), torch.float32)
        _tables[key] = decoded.reshape(-1)[:16].contiguous()
    return _tables[key]


def _fused_class(bnb_class: type) -> type:
    class Fused4bitLinear(bnb_class):
        """bitsandbytes' Linear4bit whose forward, when compiled, is linear_4bit (torch ops)."""

        def forward(self, x):
            # On CPUs with AVX512-BF16, bitsandbytes' eval forward repacks the weight in place into a
            # layout that dequantize does not read.
            repacked = getattr(self.weight.quant_state, "packing_format_for_cpu", False)
            if not torch.compiler.is_compiling() or repacked:
                return super().forward(x)
            bias = None if self.bias is None else self.bias.to(self.compute_dtype)
            out = linear_4bit(x.to(self.compute_dtype), self.weight, bias, self.relaytune_code_table)
            return out.to(x.dtype)

    Fused4bitLinear.__name__ = Fused4bitLinear.__qualname__ = f"Fused{bnb_class.__name__}"
    return Fused4bitLinear


_fused_classes: dict[type, type] = {}


def fusable(module: torch.nn.Module, autocast: torch.dtype | None) -> bool:
    """A bitsandbytes Linear4bit whose weight is one whole Params4bit (not sharded by FSDP; its bytes
    stored as uint8 or, `bnb_4bit_quant_storage`, as a float dtype) and whose compute dtype is the
    autocast dtype, so that autocast leaves its matmul's dtype as bitsandbytes computes it."""
    try:
        import bitsandbytes as bnb
    except ImportError:
        return False
    if not isinstance(module, bnb.nn.Linear4bit) or type(module) in _fused_classes.values():
        return False
    weight, state = module.weight, getattr(module.weight, "quant_state", None)
    if state is None or type(weight) is not bnb.nn.Params4bit or weight.dtype not in STORAGE_DTYPES:
        return False
    if state.nested and (state.state2.blocksize != 256 or state.offset is None):
        return False
    numel = int(state.shape[0]) * int(state.shape[1]) if len(state.shape) == 2 else -1
    dtype_ok = module.compute_dtype is not None and (autocast is None or module.compute_dtype == autocast)
    return dtype_ok and numel > 0 and numel % state.blocksize == 0


def fuse_4bit_linears(layers: list[torch.nn.Module], autocast: torch.dtype | None) -> int:
    """Turns every fusable Linear4bit in `layers` into its Fused form (same object, same state);
    returns how many."""
    count = 0
    for layer in layers:
        for module in layer.modules():
            if fusable(module, autocast):
                bnb_class = type(module)
                if bnb_class not in _fused_classes:
                    _fused_classes[bnb_class] = _fused_class(bnb_class)
                table = code_table(module.weight.quant_state.quant_type, module.weight.device)
                # A table of its own: Inductor fused the dequantizations of layers that read one shared
                # table into one kernel, so their weights lived together (+84 MB on Qwen2.5-3B).
                module.relaytune_code_table = table.clone()
                module.__class__ = _fused_classes[bnb_class]
                count += 1
    return count


def unfuse_4bit_linears(layers: list[torch.nn.Module]) -> None:
    """Gives every Fused Linear4bit in `layers` its bitsandbytes class back."""
    originals = {fused: original for original, fused in _fused_classes.items()}
    for layer in layers:
        for module in layer.modules():
            if type(module) in originals:
                module.__class__ = originals[type(module)]
                del module.relaytune_code_table


def unfused_4bit_linears(layers: list[torch.nn.Module]) -> int:
    """How many bitsandbytes Linear4bit in `layers` run bitsandbytes' own matmul when compiled."""
    try:
        import bitsandbytes as bnb
    except ImportError:
        return 0
    fused = tuple(_fused_classes.values())
    return sum(isinstance(m, bnb.nn.Linear4bit) and not isinstance(m, fused)
               for layer in layers for m in layer.modules())
