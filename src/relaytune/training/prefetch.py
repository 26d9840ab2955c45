"""The next step's global batch and micro-batches, made while the GPU still runs this step.

The host reads the next global batch's rows, collates, pins and queues the copies of its micro-batches
(and looks up the input embedding rows when the table is in host memory) before it waits for this
step's loss; at the step boundary the GPU then starts the next forward without waiting for that host
work. A step's rows are a pure function of (seed, step), so nothing here changes what is trained:
prepared micro-batches are used only for exactly the rows and micro-batch size they were made for,
and dropped otherwise (an OOM that halved the micro-batch, a roll-back to a checkpoint).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from relaytune.data.batches import micro_batches, to_device
from relaytune.embedding_offload import prefetch_rows


class Prefetch:
    """At most one global batch made ahead. Without `rows_of` (a step -> its rows, set by the trainer)
    nothing is made ahead and `batches` collates as it goes."""

    def __init__(self, model, pad_id: int, width: int | None, device: torch.device):
        self.model, self.pad_id, self.width, self.device = model, pad_id, width, device
        self.rows_of: Callable[[int], list] | None = None
        self.steps = 0  # the run's last step + 1: nothing is made ahead of it
        self._rows: tuple[int, list] | None = None
        self._batches: tuple[list, int, list[dict]] | None = None

    def rows(self, step: int) -> list:
        """The global batch of `step`: the rows made ahead when they are that step's."""
        ahead, self._rows = self._rows, None
        return ahead[1] if ahead is not None and ahead[0] == step else self.rows_of(step)

    def prepare(self, step: int, micro_batch_size: int) -> None:
        """Make `step`'s rows and device micro-batches now (the first one's embedding rows too)."""
        if self.rows_of is None or step >= self.steps:
            return
        rows = self.rows_of(step)
        batches = [to_device(b, self.device)
                   for b in micro_batches(rows, micro_batch_size, self.pad_id, width=self.width)]
        prefetch_rows(self.model, batches[0]["input_ids"])
        self._rows, self._batches = (step, rows), (rows, micro_batch_size, batches)

    def batches(self, rows: list, micro_batch_size: int) -> Iterator[dict]:
        """The device micro-batches of `rows`: the prepared ones when they were made for these."""
        ready, self._batches = self._batches, None
        if ready is not None and ready[0] is rows and ready[1] == micro_batch_size:
            yield from ready[2]
            return
        for batch in micro_batches(rows, micro_batch_size, self.pad_id, width=self.width):
            yield to_device(batch, self.device)
