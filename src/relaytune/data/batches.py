"""The order in which rows are trained, as a pure function of (seed, epoch).

Step s always trains the same global batch: epoch s // steps_per_epoch, batch
s % steps_per_epoch of that epoch's permutation. A resume at step s seeks there
in O(1) without touching skipped data, and the micro-batch size only decides
how the global batch is cut, never which rows it holds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from relaytune.data.packing import position_ids
from relaytune.data.rows import IGNORE, TokenRow


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
        self._permutations: dict[int, np.ndarray] = {}  # epoch -> row order; the current and the last

    def cursor(self, step: int) -> Cursor:
        return Cursor(step // self.steps_per_epoch, step % self.steps_per_epoch)

    def batch_rows(self, step: int) -> list[int]:
        """Row indices of the global batch that optimizer step `step` (0-based) consumes."""
        c = self.cursor(step)
        perm = self._permutation(c.epoch)
        return perm[c.batch * self.global_batch:(c.batch + 1) * self.global_batch].tolist()

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._permutations:
            if len(self._permutations) >= 2:  # a run moves forward: the oldest epoch is done
                del self._permutations[next(iter(self._permutations))]
            self._permutations[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.n_rows)
        return self._permutations[epoch]


def total_steps(n_rows: int, global_batch: int, num_train_epochs: float, max_steps: int) -> int:
    if max_steps > 0:
        return max_steps
    return max(1, math.ceil(num_train_epochs * math.ceil(n_rows / global_batch)))


def micro_batches(rows: list[TokenRow], micro_batch_size: int, pad_id: int, flat: bool = False,
                  width: int | None = None):
    """Cut a global batch into padded micro-batches, keeping row order (see `collate`)."""
    for start in range(0, len(rows), micro_batch_size):
        yield collate(rows[start:start + micro_batch_size], pad_id, flat, width)


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """The micro-batch on `device`. A GPU gets it through pinned memory, without the host waiting:
    a copy from pageable memory first synchronises the stream, so the host would wait for the GPU to
    finish the previous micro-batch before it could queue this one's kernels. Each GPU tensor keeps
    its pinned source as `host_copy`, for readers on the host (the input embedding in host memory,
    embedding_offload.py): a copy back would synchronise the same way."""
    if device.type != "cuda":
        return {k: v.to(device) for k, v in batch.items()}
    moved = {}
    for key, pinned in pinned_batch(batch, device).items():
        moved[key] = pinned.to(device, non_blocking=True)
        moved[key].host_copy = pinned
    return moved


def pinned_batch(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """The micro-batch in pinned host memory when it goes to a GPU (as it is otherwise): the host's
    part of `to_device`, which a batch pinned here skips."""
    if device.type != "cuda":
        return batch
    return {k: v if v.is_pinned() else v.pin_memory() for k, v in batch.items()}


def host_copy(tensor: torch.Tensor) -> torch.Tensor | None:
    """The pinned host tensor a GPU tensor of a micro-batch was copied from (`to_device`), or None."""
    return getattr(tensor, "host_copy", None)


def collate(rows: list[TokenRow], pad_id: int, flat: bool = False,
            width: int | None = None) -> dict[str, torch.Tensor]:
    """Pad a micro-batch. Packed rows get per-sample position_ids and no attention_mask:
    from those, transformers builds a block-diagonal causal mask (SDPA/eager/flex), so packed
    samples never attend to each other. (It skips that detection when a KV cache is in use:
    training runs with config.use_cache=False.) With `attention: flex` the same position_ids
    give the document ids (`document_ids`) of one FlexAttention BlockMask per batch instead, and
    with `attention: varlen` where each document starts (training/attention.py).

    flat=True lays the whole micro-batch out as one row without padding, the only layout in
    which transformers' flash attention switches to varlen (`packing.flat_layout(model)`).
    `width` pads to at least that many positions (compiled layers: one shape, `speedups.batch_width`).
    """
    if flat:
        return _flat(rows)
    width = max(width or 0, *(len(r.input_ids) for r in rows))
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r.input_ids)
        ids[i, :n] = torch.from_numpy(np.asarray(r.input_ids, dtype=np.int64))
        labels[i, :n] = torch.from_numpy(np.asarray(r.labels, dtype=np.int64))
    if any(r.segments is not None for r in rows):
        pos = np.stack([position_ids(r.segments or (len(r.input_ids),), width) for r in rows])
        return {"input_ids": ids, "labels": labels, "position_ids": torch.from_numpy(pos).long()}
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        mask[i, :len(r.input_ids)] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Which packed sample each position belongs to, from collate's position_ids: a sample starts
    where its positions restart at 0 (the padding after the last sample is a sample of its own,
    with no targets). Same shape as position_ids; computed on its device, with no host sync.
    The document mask of FlexAttention is built from these (`training/attention.py`)."""
    return (position_ids == 0).cumsum(-1)


def _flat(rows: list[TokenRow]) -> dict[str, torch.Tensor]:
    ids = np.concatenate([np.asarray(r.input_ids, dtype=np.int64) for r in rows])
    labels = np.concatenate([np.asarray(r.labels, dtype=np.int64) for r in rows])
    start = 0
    for r in rows[:-1]:
        start += len(r.input_ids)
        labels[start] = IGNORE  # a row boundary is a sample boundary: no label across it
    pos = np.concatenate([position_ids(r.segments or (len(r.input_ids),), len(r.input_ids)) for r in rows])
    return {"input_ids": torch.from_numpy(ids)[None], "labels": torch.from_numpy(labels)[None],
            "position_ids": torch.from_numpy(pos).long()[None]}


def count_targets(rows: list[TokenRow]) -> int:
    """Tokens that carry loss (labels are shifted by one inside the model's loss)."""
    return sum(r.targets for r in rows)
