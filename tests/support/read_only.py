"""A run folder that cannot be written, as Kaggle's /kaggle/input is: chmod where the tests run as a
user; as root (CI), which writes through chmod, the durable writer fails as that file system would."""

from __future__ import annotations

import errno
import os
from pathlib import Path

from relaytune import atomic


def make_read_only(folder: Path, monkeypatch) -> None:
    if os.geteuid() == 0:
        def read_only(path, data, points="save"):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

        monkeypatch.setattr(atomic, "write_file", read_only)
    else:
        folder.chmod(0o555)


def files(folder: Path) -> list[tuple[str, int]]:
    """Every file and folder under `folder` with its size: what a read-only command must leave as it was."""
    return sorted((p.relative_to(folder).as_posix(), p.stat().st_size) for p in folder.rglob("*"))
