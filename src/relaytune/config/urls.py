"""URLs in settings: which keys take one, and what a refusal may show.

A URL given where a local path is expected used to be joined onto a folder (`https:/user:pw@...`,
its `//` collapsed), which both hid the mistake and hid the URL from redaction. Only `mirror_to`
reads URLs (through fsspec); every other path setting refuses one by name, showing it without
its credentials.
"""

from __future__ import annotations

import re
from typing import Any

from relaytune.config.datasets import written_paths
from relaytune.errors import UserError
from relaytune.redact import redact_url

# Two letters at least: `C://x` is a Windows drive, not a scheme.
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]+://")

URL_KEYS = ("mirror_to",)

# What each path setting takes instead of a URL.
_INSTEAD = {
    "dataset": "a local .jsonl/.json/.csv/.parquet file or folder, or a Hub dataset id (org/name); "
               "download the file first and give its path",
    "eval_dataset": "a local .jsonl/.json/.csv/.parquet file; download it first and give its path",
    "model": "a Hub id (org/name), a local folder or .gguf file, or builtin:SmolLM2-135M-Instruct; "
             "download the file first and give its path",
    "chat_template": "a template name (chatml, llama3, gemma, mistral, phi3, zephyr, plain, tokenizer) "
                     "or a local .jinja file",
    "resume_from_checkpoint": "auto, false, or a local checkpoint folder; to restore from remote "
                              "storage, set mirror_to (a new session restores from it)",
    "output_dir": "a local folder; to copy checkpoints to remote storage, set mirror_to",
}


def is_url(value: Any) -> bool:
    """Does `value` start with `scheme://`?"""
    return isinstance(value, str) and _SCHEME.match(value.strip()) is not None


def _urls_in(key: str, value: Any) -> list[tuple[str, str]]:
    """(shown key, URL) of each URL that `key`'s value holds, `dataset` list entries included."""
    return [(key if i is None else f"{key}[{i}]", path) for i, path in written_paths(key, value) if is_url(path)]


def refuse_urls(raw: dict, where: dict[str, str]) -> None:
    """UserError for the first path setting that holds a URL where only `mirror_to` takes one."""
    for key, value in raw.items():
        if key not in _INSTEAD:
            continue
        for shown, url in _urls_in(key, value):
            at = f"{where[key]}: " if where.get(key) else ""
            raise UserError(f"{at}`{shown}` does not read URLs ({redact_url(url.strip())}); it takes "
                            f"{_INSTEAD[key]}. Of the path settings, only mirror_to takes a URL")


def config_path_url(source: Any) -> None:
    """A config file is read from the local disk: refuse a URL before it becomes a path."""
    if is_url(source):
        raise UserError(f"{redact_url(str(source).strip())}: the config file must be a local file, not a "
                        "URL; download it first")
