"""What the GGUF export tests share."""

from __future__ import annotations

from pathlib import Path

import gguf


def fields(path: Path) -> tuple[dict, gguf.GGUFReader]:
    """The file's key-value fields as gguf.GGUFReader reads them (without its GGUF.* header keys),
    and the reader, for the tensors."""
    reader = gguf.GGUFReader(path)
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}, reader
