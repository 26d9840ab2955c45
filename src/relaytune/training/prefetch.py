"""The next step's global batch and micro-batches, made on the host while the GPU still runs this step.

The host reads the next global batch's rows, collates and pins its micro-batches (and looks up the
input embedding rows when the table is in host memory) before it waits for this step's loss; at the
step boundary only the copies to the GPU are left to queue. Nothing is allocated on the GPU ahead:
device tensors made here raised Qwen2.5-3B QLoRA's seq-512 peak by 47 MiB with CUDA graphs on (2.847
to 2.894 GiB on an H200; bench/results/vs-trl-h200.md, nineteenth session).

A step's rows are a pure function of (seed, step), so nothing here changes what is trained: prepared
micro-batches are used only for exactly the rows and micro-batch size they were made for, and dropped
otherwise (an OOM that halved the micro-batch, a roll-back to a checkpoint).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from relaytune.data.batches import micro_batches, pinned_batch, to_device
from relaytune.embedding_offload import prefetch_rows


class Prefetch:
    """At most one global batch made ahead. `rows_of` (set by the trainer) gives a step's row ids and
    rows; without it nothing is made ahead and `batches` collates as it goes."""

    def __init__(self, model, pad_id: int, width: int | None, device: torch.device):
        self.model, self.pad_id, self.width, self.device = model, pad_id, width, device
        self.rows_of: Callable[[int], tuple[list[int], list]] | None = None
        self.steps = 0  # the run's last step + 1: nothing is made ahead of it
        self._rows: tuple[int, list[int], list] | None = None
        self._batches: tuple[list, int, list[dict]] | None = None

    def rows(self, step: int) -> tuple[list[int], list]:
        """The row ids and rows of `step`'s global batch: the ones made ahead when they are that step's."""
        ahead, self._rows = self._rows, None
        return (ahead[1], ahead[2]) if ahead is not None and ahead[0] == step else self.rows_of(step)

    def prepare(self, step: int, micro_batch_size: int) -> None:
        """Make `step`'s rows and pinned micro-batches now (the first one's embedding rows too). Never
        raises out of memory: this step's update is already queued, so the trainer's redo of "this step"
        would apply it twice. The next step makes its batch itself and meets the OOM there instead."""
        if self.rows_of is None or step >= self.steps:
            return
        ids, rows = self.rows_of(step)
        self._rows = (step, ids, rows)
        try:
            batches = [pinned_batch(b, self.device)
                       for b in micro_batches(rows, micro_batch_size, self.pad_id, width=self.width)]
            prefetch_rows(self.model, batches[0]["input_ids"])
        except torch.OutOfMemoryError:
            return
        self._batches = (rows, micro_batch_size, batches)

    def batches(self, rows: list, micro_batch_size: int) -> Iterator[dict]:
        """The device micro-batches of `rows`: from the prepared ones when they were made for these, each
        let go of once it is handed out."""
        ready, self._batches = self._batches, None
        if ready is not None and ready[0] is rows and ready[1] == micro_batch_size:
            prepared = ready[2]
            del ready
            while prepared:
                yield to_device(prepared.pop(0), self.device)
            return
        for batch in micro_batches(rows, micro_batch_size, self.pad_id, width=self.width):
            yield to_device(batch, self.device)
