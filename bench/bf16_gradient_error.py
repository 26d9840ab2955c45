"""How far each bf16 path's loss and gradients are from fp32, per batch at fixed weights, on the tests'
tiny llama (packed batches of width 32, different documents in each): eager SDPA in fp32 is the reference;
eager SDPA in bf16 is the rounding that bf16 costs anyway; compiled FlexAttention layers without and with
CUDA graphs, and FlashAttention's varlen kernel (sm_80+), are measured against both. Needs a CUDA GPU.

    python bench/bf16_gradient_error.py

The bf16 CUDA tests in tests/training/test_attention.py hold each path within a bound (BF16_FACTOR and the
floors) that these figures must fit; results go to bench/results/vs-trl-h200.md.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests"), str(ROOT / "tests" / "training")]

import torch  # noqa: E402
from test_attention import _cuda_losses_and_gradients, _errors  # noqa: E402

from relaytune.tiny import make_tiny_model  # noqa: E402

PATHS = {"eager sdpa bf16 (again)": dict(torch_compile=False, attention="sdpa"),
         "compiled flex, graphs off": dict(torch_compile=True, attention="flex", cuda_graphs=False),
         "compiled flex, graphs on": dict(torch_compile=True, attention="flex", cuda_graphs=True),
         "compiled varlen": dict(torch_compile=True, attention="varlen")}


def show(name: str, errs: list[tuple[float, float]]) -> None:
    print(f"{name}: (loss, gradient) relative error per batch "
          + ", ".join(f"({a:.2e}, {b:.4f})" for a, b in errs))


def main() -> None:
    if not torch.cuda.is_available():
        print("bf16_gradient_error.py needs a CUDA GPU.", file=sys.stderr)
        raise SystemExit(2)
    work = Path(tempfile.mkdtemp())
    model = make_tiny_model(work / "model")
    _, fp32 = _cuda_losses_and_gradients(model, work, torch.float32, torch_compile=False, attention="sdpa")
    _, bf16 = _cuda_losses_and_gradients(model, work, torch.bfloat16, torch_compile=False, attention="sdpa")
    show("eager sdpa bf16 vs fp32", _errors(bf16, fp32))
    runs = {}
    for name, settings in PATHS.items():
        if settings["attention"] == "varlen" and torch.cuda.get_device_capability() < (8, 0):
            continue
        applied, runs[name] = _cuda_losses_and_gradients(model, work, torch.bfloat16, **settings)
        show(f"{name} vs fp32 {applied}", _errors(runs[name], fp32))
        show(f"{name} vs eager bf16", _errors(runs[name], bf16))
    show("graphs on vs graphs off", _errors(runs["compiled flex, graphs on"], runs["compiled flex, graphs off"]))


if __name__ == "__main__":
    main()
