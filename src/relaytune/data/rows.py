"""What the pipeline hands to training: `TokenRow`, and `IGNORE`, the label of a position without loss.

Defined here, below every other data module, so that tokenizing, packing, batching and
the loss all read one value and one row type without importing the pipeline itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

IGNORE = -100  # the label of a position that carries no loss (torch's cross_entropy ignore_index)


@dataclass(eq=False)
class TokenRow:
    """One training sequence; `segments` holds the sample lengths of a packed one."""

    input_ids: np.ndarray  # int32 (lists are converted)
    labels: np.ndarray
    segments: tuple[int, ...] | None = None

    def __post_init__(self):
        self.input_ids = np.asarray(self.input_ids, dtype=np.int32)
        self.labels = np.asarray(self.labels, dtype=np.int32)

    @property
    def targets(self) -> int:
        """Tokens that carry loss (the model's loss shifts labels by one; label 0 is never predicted)."""
        return int(np.count_nonzero(self.labels[1:] != IGNORE))
