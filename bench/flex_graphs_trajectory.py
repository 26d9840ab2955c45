"""Loss and gradient norm per step of a short AdamW trajectory on the tests' tiny llama (bf16, packed
batches of width 32, a different batch each step): eager SDPA against compiled FlexAttention layers
without and with CUDA graphs. Needs a CUDA GPU; run from the repository root.

    python bench/flex_graphs_trajectory.py [--steps 5] [--lr 1e-2]

With graphs on it also prints the CUDA graphs held after each step (gpu_bench.cuda_graphs_held): a
count that grows every step means each step's batch, new tensors at new addresses, is recorded again.

A trajectory compounds rounding (the update of each step depends on the last), so its drift mixes the
paths' rounding with any real fault; tests/training/test_attention.py's CUDA tests compare per-batch
gradients at fixed weights instead. Results: bench/results/vs-trl-h200.md (twenty-third and
twenty-fourth sessions).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests"), str(ROOT / "bench")]

import torch  # noqa: E402
from gpu_bench import cuda_graphs_held  # noqa: E402
from support.packed_cases import (  # noqa: E402
    DIFFERENT_BATCHES,
    packed_batch,
    target_count,
    tiny_config,
    tiny_lora_model,
)

from relaytune.tiny import make_tiny_model  # noqa: E402
from relaytune.training.loss import causal_lm_loss  # noqa: E402

PATHS = {"eager sdpa": dict(torch_compile=False, attention="sdpa"),
         "compiled flex, graphs off": dict(torch_compile=True, attention="flex", cuda_graphs=False),
         "compiled flex, graphs on": dict(torch_compile=True, attention="flex", cuda_graphs=True)}


def trajectory(model_dir: Path, work: Path, steps: int, lr: float, held: list,
               **settings) -> list[tuple[float, float]]:
    """(loss, grad norm) per step; `held` gets the CUDA graphs held after each step."""
    torch._dynamo.reset()
    cfg = tiny_config(model_dir, work, packing=True, gradient_checkpointing=True, bf16=True, max_seq_length=32,
                      **settings)
    model = tiny_lora_model(cfg)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr)
    out = []
    for segments in (DIFFERENT_BATCHES * steps)[:steps]:
        batch = {k: v.cuda() for k, v in packed_batch(model.config.vocab_size, segments, width=32).items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = causal_lm_loss(model, batch, target_count(batch))
        loss.backward()
        out.append((loss.item(), torch.nn.utils.clip_grad_norm_(params, 1.0).item()))
        opt.step()
        opt.zero_grad(set_to_none=True)
        held.append(cuda_graphs_held())
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-2)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("flex_graphs_trajectory.py needs a GPU: FlexAttention's backward and CUDA graphs run there only.",
              file=sys.stderr)
        raise SystemExit(2)
    work = Path(tempfile.mkdtemp())
    model_dir = make_tiny_model(work / "model")
    reference = None
    for name, settings in PATHS.items():
        held: list = []
        out = trajectory(model_dir, work, args.steps, args.lr, held, **settings)
        reference = reference or out
        worst = max(abs(a - b) / abs(b) for x, y in zip(out, reference) for a, b in zip(x, y))
        steps = ", ".join(f"({loss:.5f}, {norm:.5f})" for loss, norm in out)
        print(f"{name}: (loss, grad norm) per step {steps}; worst relative difference from eager {worst:.4f}")
        if settings.get("cuda_graphs"):
            print(f"{name}: CUDA graphs held after each step {held}")


if __name__ == "__main__":
    main()
