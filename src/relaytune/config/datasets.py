"""The shape of `dataset` entries and of the column mapping, as config types.

Kept apart from the readers so that `config` can import it without pulling in
the data pipeline (and without an import cycle).
"""

from __future__ import annotations

import difflib
from typing import Literal

from pydantic import BaseModel, ConfigDict, field_validator

MAX_WEIGHT = 10_000

Format = Literal["auto", "text", "alpaca", "messages", "sharegpt", "prompt_completion"]

# The standard field names a `dataset_columns` mapping may rename.
COLUMNS = ("text", "instruction", "input", "output", "system", "prompt", "completion",
           "messages", "conversations", "role", "content", "from", "value")


class DatasetSource(BaseModel):
    """One entry of a mixed `dataset` list."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    path: str
    """A .jsonl/.json/.csv/.parquet file, a folder of them, a saved `datasets` folder, or a Hub id."""
    weight: float = 1.0
    """How many times each row is used per epoch: 1 all once, 2 every row twice, 0.3 a fixed,
    seeded 30% of the rows."""
    split: str | None = None
    """Split to load for a Hub dataset (default train) or a local datasets folder."""
    subset: str | None = None
    """Configuration (subset) name of a Hub dataset."""
    format: Format | None = None
    """Row format of this source; unset: the top-level dataset_format."""
    columns: dict[str, str] | None = None
    """Column mapping of this source; unset: the top-level dataset_columns."""

    @field_validator("path")
    @classmethod
    def _path(cls, v: str) -> str:
        if not str(v).strip():
            raise ValueError("`path` must not be empty")
        return v

    @field_validator("weight")
    @classmethod
    def _weight(cls, v: float) -> float:
        if not v >= 0 or v != v or v == float("inf"):
            raise ValueError("`weight` must be 0 or more")
        if v > MAX_WEIGHT:
            raise ValueError(f"`weight` must be at most {MAX_WEIGHT:,}: each epoch lists every row "
                             "weight times, so a huge weight exhausts memory; raise the epochs instead")
        return v

    @field_validator("columns")
    @classmethod
    def _columns(cls, v):
        return check_columns(v)


def check_columns(mapping: dict[str, str] | None) -> dict[str, str] | None:
    """Every key must be a standard field name; say which one was meant if not."""
    if mapping is None:
        return None
    for key, value in mapping.items():
        if key not in COLUMNS:
            close = difflib.get_close_matches(str(key), COLUMNS, n=1, cutoff=0.6)
            hint = f"did you mean `{close[0]}`? " if close else ""
            raise ValueError(f"`{key}` is not a standard field; {hint}known: {', '.join(COLUMNS)}")
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"the column name for `{key}` must be non-empty text")
    return mapping


def as_sources(dataset: str | list) -> list[DatasetSource]:
    """The `dataset` setting as a list of sources (a plain string is one source, weight 1)."""
    items = dataset if isinstance(dataset, list) else [dataset]
    return [DatasetSource(path=i) if isinstance(i, str) else i for i in items]


def written_paths(key: str, value) -> list[tuple[int | None, str]]:
    """(index in a `dataset` list, or None for a plain value; the path) of each path a data or path
    setting's raw value holds, for checks that run before validation (URLs, where each was written)."""
    if isinstance(value, str):
        return [(None, value)]
    if key != "dataset" or not isinstance(value, list):
        return []
    found = []
    for i, item in enumerate(value):
        path = item.get("path") if isinstance(item, dict) else getattr(item, "path", item)
        if isinstance(path, str):
            found.append((i, path))
    return found
