"""Relative paths in settings become absolute, against the folder they were written for.

A path written in a config file means "next to this file", whatever the working directory;
a path given as a `key=value` override, a Python keyword or a dict means "from here" (the
working directory). Every later consumer (the saved config in checkpoints, status, export)
then sees the same absolute path. Hub ids and URLs are left alone.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from relaytune.config.datasets import DatasetSource
from relaytune.config.urls import is_url

DATA_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")
PATH_PREFIXES = (".", "/", "~")
RESUME_WORDS = ("auto", "true", "false")

# The settings that can name a local path; `dataset` also inside each list entry's `path`.
PATH_KEYS = ("output_dir", "dataset", "eval_dataset", "model", "chat_template", "mirror_to",
             "resume_from_checkpoint")


def absolute(value: str, base: Path) -> str:
    """`value` (~ expanded) joined to `base` and normalised, without following symlinks. A URL
    stays as written: normalising would collapse its `//` and hide it from redaction."""
    if is_url(value):
        return value
    return os.path.normpath(os.path.join(base, os.path.expanduser(value)))


def _data_path(value: str, base: Path) -> str:
    """A data source: resolved if it exists there or looks like a file path; else a Hub id."""
    if (base / os.path.expanduser(value)).exists() or value.startswith(PATH_PREFIXES) \
            or value.lower().endswith(DATA_SUFFIXES):
        return absolute(value, base)
    return value


def _model_path(value: str, base: Path) -> str:
    """A model: resolved if it exists there, starts like a path or is a .gguf; else a Hub id."""
    if value.startswith("builtin:"):
        return value
    if (base / os.path.expanduser(value)).exists() or value.startswith(PATH_PREFIXES) \
            or value.lower().endswith(".gguf"):
        return absolute(value, base)
    return value


def _template_path(value: str, base: Path) -> str:
    """A chat template: a .jinja file or a path is resolved; a name (chatml, llama3...) is not."""
    if value.lower().endswith(".jinja") or value.startswith(PATH_PREFIXES):
        return absolute(value, base)
    if ("." in value or "/" in value) and (base / value).is_file():
        return absolute(value, base)
    return value


def _folder_or_url(value: str, base: Path) -> str:
    """mirror_to: an fsspec URL (scheme://, or chained with ::) stays; a folder is resolved."""
    return value if "://" in value or "::" in value else absolute(value, base)


def _checkpoint_path(value: str, base: Path) -> str:
    return value if value.strip().lower() in RESUME_WORDS else absolute(value, base)


_RULES = {"output_dir": absolute, "eval_dataset": _data_path, "model": _model_path,
          "chat_template": _template_path, "mirror_to": _folder_or_url,
          "resume_from_checkpoint": _checkpoint_path}


def _dataset(value: Any, base: Path) -> Any:
    """`dataset`: a string, or a list of strings / {path: ...} entries / DatasetSource."""
    if isinstance(value, str):
        return _data_path(value, base) if value.strip() else value
    if not isinstance(value, list):
        return value
    out = []
    for item in value:
        if isinstance(item, str) and item.strip():
            item = _data_path(item, base)
        elif isinstance(item, dict) and isinstance(item.get("path"), str) and item["path"].strip():
            item = {**item, "path": _data_path(item["path"], base)}
        elif isinstance(item, DatasetSource):
            item = item.model_copy(update={"path": _data_path(item.path, base)})
        out.append(item)
    return out


def resolve_value(key: str, value: Any, base: Path) -> Any:
    """`value` of setting `key` with its local paths made absolute against `base`."""
    if key == "dataset":
        return _dataset(value, base)
    rule = _RULES.get(key)
    if rule is None or not isinstance(value, str) or not value.strip():
        return value
    return rule(value, base)


def resolve_paths(raw: dict, base: Path) -> dict:
    """`raw` with every path setting resolved against `base`."""
    return {k: resolve_value(k, v, base) for k, v in raw.items()}


def saved_config_view(saved: dict, current: dict, bases: tuple[Path, ...] = ()) -> dict:
    """The saved config of a checkpoint, with relative paths (a run started before paths were
    resolved) replaced by the current absolute value wherever they name the same place.

    Such a run resolved them against a working directory that is unknown now. A value counts as
    the same place when resolving it against the working directory or one of `bases` gives
    today's value, or when it is written as a path (./x, x.jsonl, x.gguf) and today's absolute
    path ends with it. The data fingerprint still guards what the data files hold.
    """
    view = dict(saved)
    for key in PATH_KEYS:
        if key not in saved or key not in current or saved[key] == current[key]:
            continue
        for base in (Path.cwd(), *bases):
            if _as_json(resolve_value(key, saved[key], base)) == current[key]:
                view[key] = current[key]
                break
        else:
            view[key] = _adopt(saved[key], current[key])
    return view


def _adopt(old: Any, new: Any) -> Any:
    """`new` where `old` is a path-looking relative form of it (entry by entry for lists)."""
    if isinstance(old, str) and isinstance(new, str):
        return new if _tail_of(old, new) else old
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return [_adopt_entry(o, n) for o, n in zip(old, new)]
    return old


def _adopt_entry(old: Any, new: Any) -> Any:
    if isinstance(old, dict) and isinstance(new, dict) and "path" in old and "path" in new:
        return {**old, "path": _adopt(old["path"], new["path"])}
    return _adopt(old, new)


def _tail_of(relative: str, absolute_path: str) -> bool:
    """Is `relative`, written as a path, the end of `absolute_path` (leading ../ aside)?"""
    looks_like_path = relative.startswith(("./", "../")) or \
        relative.lower().endswith((*DATA_SUFFIXES, ".gguf", ".jinja"))
    if not looks_like_path or os.path.isabs(relative) or not os.path.isabs(absolute_path):
        return False
    parts = [p for p in Path(os.path.normpath(relative)).parts if p != ".."]
    return bool(parts) and Path(absolute_path).parts[-len(parts):] == tuple(parts)


def _as_json(value: Any) -> Any:
    """A resolved value in the shape `model_dump(mode="json")` gives it, for comparison."""
    if isinstance(value, list):
        return [v.model_dump(mode="json") if isinstance(v, DatasetSource) else v for v in value]
    return value
