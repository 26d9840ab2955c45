"""How far flex_graphs_trajectory.py's trajectory moves from rounding alone, on the CPU: the same tiny
llama, packed batches of width 32, eager SDPA, AdamW at lr 1e-2, run in fp32, under bf16 autocast, and
in fp32 with every LoRA weight scaled by 1 + 1e-3 before the first step. Prints (loss, grad norm) per
step and each run's grad-norm distance from the fp32 run.

    python bench/trajectory_sensitivity.py [--steps 5] [--lr 1e-2]

On the GPU the compiled paths' trajectories spread from eager's by 8.8% (graphs off) and 16.7% (graphs
on) at step 5, while their per-batch gradients at fixed weights agree within bf16 rounding. If rounding
alone moves this trajectory by as much, the spread says nothing about a fault. Results:
bench/results/flex-decoding-h100.md.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]

import torch  # noqa: E402
from support.packed_cases import (  # noqa: E402
    DIFFERENT_BATCHES,
    packed_batch,
    target_count,
    tiny_config,
    tiny_lora_model,
)

from relaytune.tiny import make_tiny_model  # noqa: E402
from relaytune.training.loss import causal_lm_loss  # noqa: E402

RUNS = {"fp32": dict(bf16=False, scale=0.0), "bf16 autocast": dict(bf16=True, scale=0.0),
        "fp32, LoRA weights x (1 + 1e-3)": dict(bf16=False, scale=1e-3)}


def trajectory(model_dir: Path, work: Path, steps: int, lr: float, bf16: bool, scale: float):
    """(loss, grad norm) per step of the CPU run, as flex_graphs_trajectory.trajectory steps on the GPU."""
    cfg = tiny_config(model_dir, work, packing=True, gradient_checkpointing=True, max_seq_length=32,
                      torch_compile=False, attention="sdpa")
    model = tiny_lora_model(cfg)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    with torch.no_grad():
        for param in params:
            param.mul_(1 + scale)
    opt = torch.optim.AdamW(params, lr=lr)
    out = []
    for segments in (DIFFERENT_BATCHES * steps)[:steps]:
        batch = packed_batch(model.config.vocab_size, segments, width=32)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = causal_lm_loss(model, batch, target_count(batch))
        loss.backward()
        out.append((loss.item(), torch.nn.utils.clip_grad_norm_(params, 1.0).item()))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-2)
    args = p.parse_args()
    torch.set_num_threads(1)  # one thread: the fp32 run is the same on every machine
    work = Path(tempfile.mkdtemp())
    model_dir = make_tiny_model(work / "model")
    reference = None
    for name, settings in RUNS.items():
        out = trajectory(model_dir, work, args.steps, args.lr, **settings)
        reference = reference or out
        steps = ", ".join(f"({loss:.5f}, {norm:.5f})" for loss, norm in out)
        moved = ", ".join(f"{abs(a[1] - b[1]) / b[1]:.3f}" for a, b in zip(out, reference))
        print(f"{name}: (loss, grad norm) per step {steps}; grad norm's relative distance from fp32 per step {moved}")


if __name__ == "__main__":
    main()
