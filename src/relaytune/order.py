"""The order in which rows are trained, as a pure function of (seed, epoch).

Step s always trains the same global batch: epoch s // steps_per_epoch, batch
s % steps_per_epoch of that epoch's permutation. A resume at step s seeks there
in O(1) without touching skipped data, and the micro-batch size only decides
how the global batch is cut, never which rows it holds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from .data import IGNORE, TokenRow


@dataclass(frozen=True)
class Cursor:
    """Where the next global batch starts."""

    epoch: int
    batch: int

    def as_dict(self) -> dict:
        return {"epoch": self.epoch, "batch": self.batch}


class DataOrder:
    def __init__(self, n_rows: int, global_batch: int, seed: int):
        self.n_rows = n_rows
        self.global_batch = global_batch
        self.seed = seed
        self.steps_per_epoch = math.ceil(n_rows / global_batch)

    def cursor(self, step: int) -> Cursor:
        return Cursor(step // self.steps_per_epoch, step % self.steps_per_epoch)

    def batch_rows(self, step: int) -> list[int]:
        """Row indices of the global batch that optimizer step `step` (0-based) consumes."""
        c = self.cursor(step)
        perm = self._permutation(c.epoch)
        return perm[c.batch * self.global_batch:(c.batch + 1) * self.global_batch].tolist()

    @lru_cache(maxsize=2)
    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.n_rows)


def total_steps(n_rows: int, global_batch: int, num_train_epochs: float, max_steps: int) -> int:
    if max_steps > 0:
        return max_steps
    return max(1, math.ceil(num_train_epochs * math.ceil(n_rows / global_batch)))


def micro_batches(rows: list[TokenRow], micro_batch_size: int, pad_id: int):
    """Cut a global batch into padded micro-batches, keeping row order."""
    for start in range(0, len(rows), micro_batch_size):
        yield collate(rows[start:start + micro_batch_size], pad_id)


def collate(rows: list[TokenRow], pad_id: int) -> dict[str, torch.Tensor]:
    width = max(len(r.input_ids) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r.input_ids)
        ids[i, :n] = torch.tensor(r.input_ids)
        labels[i, :n] = torch.tensor(r.labels)
        mask[i, :n] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def count_targets(rows: list[TokenRow]) -> int:
    """Tokens that carry loss (labels are shifted by one inside the model's loss)."""
    return sum(r.targets for r in rows)
