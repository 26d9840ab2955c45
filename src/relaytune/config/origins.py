"""Where each data path setting was written, so that the data reader's messages can name it.

The reader sees only a path (prepare_data builds a DatasetSource from `eval_dataset` as from
`dataset`), but a missing file must be reported against the key and the config line that named
it. load_config records them here; the latest load wins, as it is the one being run.
"""

from __future__ import annotations

from typing import Any

from relaytune.config.datasets import written_paths

_written: dict[str, tuple[str, str]] = {}  # path as resolved -> (key, "file:line" or "the override ...")
_KEEP = 256  # a notebook loading configs in a loop must not grow this without bound


def _paths(key: str, value: Any) -> list[tuple[str, str]]:
    """(shown key, path): a `dataset` list entry is named by its index where the list has several."""
    several = isinstance(value, list) and len(value) > 1
    return [(f"{key}[{i}]" if i is not None and several else key, path) for i, path in written_paths(key, value)]


def remember(raw: dict, where: dict[str, str]) -> None:
    """Record the data paths of a loaded config with the place each was written."""
    for key in ("dataset", "eval_dataset"):
        for shown, path in _paths(key, raw.get(key)):
            _written.pop(path, None)
            _written[path] = (shown, where.get(key, ""))
    while len(_written) > _KEEP:
        del _written[next(iter(_written))]


def written_at(path: str) -> str:
    """`file:line: `key`` (or just `` `dataset` ``) for a data path, as a message's prefix."""
    key, where = _written.get(path, ("dataset", ""))
    return f"{where}: `{key}`" if where else f"`{key}`"
