"""Whether Inductor's flex decoding kernel is kept out, and what it costs when it is not: the tests' tiny
llama, compiled FlexAttention layers with and without CUDA graphs, each packed batch's (loss, gradient)
relative distance from eager SDPA in fp32, in fp32 and bf16, at widths 32 (under 128 queries: decoding
is eligible in a forward without gradients) and 256, with attention.FLEX_KERNEL_OPTIONS as relaytune
sets it and emptied. Needs a CUDA GPU.

    python bench/flex_decoding_check.py

Results: bench/results/flex-decoding-h100.md.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests"), str(ROOT / "tests" / "training")]

import support.packed_cases as cases  # noqa: E402
import test_attention  # noqa: E402
import torch  # noqa: E402
from bf16_gradient_error import show  # noqa: E402

from relaytune.tiny import make_tiny_model  # noqa: E402
from relaytune.training import attention  # noqa: E402

RELAYTUNE_OPTIONS = dict(attention.FLEX_KERNEL_OPTIONS)


def widen(factor: int) -> None:
    """The tests' batches with every document `factor` times as long (width 32 * factor)."""
    width = 32 * factor
    test_attention.DIFFERENT_BATCHES = tuple(tuple(tuple(factor * n for n in row) for row in batch)
                                             for batch in cases.DIFFERENT_BATCHES)
    test_attention.tiny_config = lambda *a, **k: cases.tiny_config(*a, **{**k, "max_seq_length": width})
    test_attention.packed_batch = lambda vocab, segments, **_: cases.packed_batch(vocab, segments, width)


def main() -> None:
    if not torch.cuda.is_available():
        print("flex_decoding_check.py needs a CUDA GPU.", file=sys.stderr)
        raise SystemExit(2)
    work = Path(tempfile.mkdtemp())
    model = make_tiny_model(work / "model")
    run = test_attention._cuda_losses_and_gradients
    for factor in (1, 8):
        widen(factor)
        fp32 = run(model, work, torch.float32, torch_compile=False, attention="sdpa")[1]
        for dtype in (torch.float32, torch.bfloat16):
            for options in (RELAYTUNE_OPTIONS, {}):
                attention.FLEX_KERNEL_OPTIONS = options
                for graphs in (False, True):
                    got = run(model, work, dtype, torch_compile=True, attention="flex", cuda_graphs=graphs)[1]
                    show(f"width {32 * factor}, {str(dtype)[6:]}, kernel options {options}, CUDA graphs "
                         f"{'on' if graphs else 'off'} vs eager fp32", test_attention._errors(got, fp32))
    attention.FLEX_KERNEL_OPTIONS = RELAYTUNE_OPTIONS


if __name__ == "__main__":
    main()
