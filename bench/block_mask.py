"""Time building one packed batch's document BlockMask: relaytune's builder (training/document_mask.py)
against torch's create_block_mask, the way relaytune called it before (compiled on a GPU, eager on the CPU).

    python bench/block_mask.py                    # B 2, S 2048, documents of 64..1024 tokens, 50 builds each
    python bench/block_mask.py --batch 4 --seq 512

Prints the median wall time per build (on a GPU: with a synchronize after each build, so it is the
build's whole latency, host and kernels), and whether the two masks are equal tensor for tensor.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
from relaytune.data.packing import position_ids  # noqa: E402
from relaytune.training.document_mask import document_block_mask, torch_block_mask  # noqa: E402


def packed_positions(batch: int, seq: int, device: str, seed: int = 0) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(batch):
        segments, left = [], seq
        while left > 0:
            segments.append(min(left, int(rng.integers(64, 1025))))
            left -= segments[-1]
        rows.append(position_ids(tuple(segments), seq))
    return torch.from_numpy(np.stack(rows)).long().to(device)


def median_ms(build, pos: torch.Tensor, repeats: int) -> float:
    for _ in range(3):  # warm-up: compiles on a GPU
        build(pos)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        build(pos)
        if pos.is_cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=50)
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    pos = packed_positions(args.batch, args.seq, device)
    ours, theirs = document_block_mask(pos), torch_block_mask(pos)
    fields = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks", "q_indices",
              "full_q_num_blocks", "full_q_indices")
    equal = all(torch.equal(getattr(ours, f), getattr(theirs, f)) for f in fields)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"### document BlockMask, batch {args.batch} x {args.seq} ({name}, torch {torch.__version__})\n")
    print(f"| builder | ms per build (median of {args.repeats}) |\n|---|---|")
    print(f"| relaytune document_block_mask | {median_ms(document_block_mask, pos, args.repeats):.3f} |")
    print(f"| create_block_mask{' (compiled)' if device == 'cuda' else ''} | "
          f"{median_ms(torch_block_mask, pos, args.repeats):.3f} |")
    print(f"\n- equal tensor for tensor: {equal}")


if __name__ == "__main__":
    main()
