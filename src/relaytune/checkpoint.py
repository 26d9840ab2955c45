"""The checkpoint store: a folder is a checkpoint only once its manifest is committed.

Commit protocol (each step is a named fault point, see faults.py):
  1. write every file into `.relaytune-tmp-*` beside the target, fsync each;
  2. write manifest.json (sha256 and size of every file, step, metadata), fsync;
  3. rename the tmp folder to its final name, fsync the parent folder.
A crash at any point leaves either the old state or the new one. Only folders
named `.relaytune-tmp-*` are ever cleaned up; anything else is reported.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import threading
import time
import uuid
from pathlib import Path
from typing import Callable

from . import faults
from .log import info, warn

MANIFEST = "manifest.json"
FORMAT = "relaytune-checkpoint/1"
TMP_PREFIX = ".relaytune-tmp-"
STEP_DIR = re.compile(r"^step-(\d+)$")


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(path: Path, data: bytes) -> dict:
    """Write, fsync, and return the manifest entry of one file."""
    with open(path, "wb") as fh:
        half = len(data) // 2
        fh.write(data[:half])
        faults.reach("save:mid_file")
        fh.write(data[half:])
        fh.flush()
        os.fsync(fh.fileno())
    return {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}


def commit_folder(files: dict[str, bytes | Callable[[], bytes]], target: Path, meta: dict) -> Path:
    """Write `files` as the folder `target` by the commit protocol.

    A value may be a callable that returns the bytes: it runs here, in the writing thread.
    """
    faults.reach("save:begin")
    files = {name: data() if callable(data) else data for name, data in files.items()}
    parent = target.parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp = parent / f"{TMP_PREFIX}{target.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        entries = {name: write_file(tmp / name, data) for name, data in sorted(files.items())}
        faults.reach("save:before_manifest")
        manifest = {"format": FORMAT, **meta, "files": entries, "created": time.time()}
        write_file(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
        faults.reach("save:after_manifest")
        if target.exists():
            _set_aside(target)
        faults.reach("save:before_rename")
        os.rename(tmp, target)
        fsync_dir(parent)
        faults.reach("save:after_rename")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _set_aside(path: Path) -> None:
    """A folder where a new commit must go: keep it under another name, never delete it."""
    kind = "replaced" if verify(path) is None else "invalid"
    aside = path.with_name(f"{path.name}.{kind}-{int(time.time())}")
    os.rename(path, aside)
    warn(f"{path} already existed ({kind}); kept it as {aside.name} and wrote a new one")


def verify(path: Path) -> str | None:
    """None if `path` is a committed, intact folder; otherwise why not."""
    mpath = path / MANIFEST
    if not mpath.is_file():
        return "no manifest (an unfinished or foreign folder)"
    try:
        manifest = json.loads(mpath.read_text())
        entries = manifest["files"]
    except (ValueError, KeyError, TypeError):
        return "unreadable manifest"
    if manifest.get("format") != FORMAT:
        return f"unknown format {manifest.get('format')!r}"
    for name, entry in entries.items():
        f = path / name
        if not f.is_file():
            return f"missing file {name}"
        if f.stat().st_size != entry["size"]:
            return f"{name} has {f.stat().st_size} bytes, the manifest says {entry['size']}"
        if _sha256(f) != entry["sha256"]:
            return f"{name} does not match its sha256 (corrupted)"
    return None


def read_manifest(path: Path) -> dict:
    return json.loads((path / MANIFEST).read_text())


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class CheckpointStore:
    """`checkpoints/step-<N>/` folders under one run."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def startup_cleanup(self) -> None:
        if not self.root.is_dir():
            return
        for p in sorted(self.root.iterdir()):
            if p.name.startswith(TMP_PREFIX):
                shutil.rmtree(p, ignore_errors=True)
                info(f"removed an unfinished save of ours: {p.name}")
            elif not STEP_DIR.match(p.name):
                warn(f"{p} is not ours; leaving it alone")

    def remove_unfinished_final(self, out_dir: Path) -> None:
        """A kill inside the final commit leaves our tmp folder beside final/."""
        for p in sorted(Path(out_dir).glob(f"{TMP_PREFIX}*")):
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
                info(f"removed an unfinished save of ours: {p.name}")

    def step_dirs(self) -> list[tuple[int, Path]]:
        if not self.root.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.root.iterdir() if (m := STEP_DIR.match(p.name))]
        return sorted(found)

    def latest_valid(self) -> tuple[Path | None, list[str]]:
        """The newest intact checkpoint, and why each newer folder was skipped."""
        skipped = []
        for step, path in reversed(self.step_dirs()):
            reason = verify(path)
            if reason is None:
                return path, skipped
            skipped.append(f"{path.name}: {reason}")
        return None, skipped

    def save(self, files: dict[str, bytes], step: int, meta: dict) -> Path:
        return commit_folder(files, self.root / f"step-{step}", {"step": step, **meta})

    def prune(self, keep: int | None, protect: set[int] = frozenset(), upto: int | None = None) -> None:
        """Delete committed checkpoints beyond the newest `keep`, never one in `protect`.

        Only called after a commit, so space is freed only once the new one is safe.
        `upto` is the step just committed: newer folders (left by an earlier session,
        perhaps corrupt) do not count, so the checkpoint just written is never deleted.
        """
        if keep is None:
            return
        committed = [(s, p) for s, p in self.step_dirs()
                     if (p / MANIFEST).is_file() and (upto is None or s <= upto)]
        for step, path in committed[:-keep] if len(committed) > keep else []:
            if step in protect:
                continue
            faults.reach("save:during_retention")
            # Rename first: a crash mid-delete leaves a tmp folder, not a broken step-N.
            doomed = self.root / f"{TMP_PREFIX}delete-{path.name}-{uuid.uuid4().hex[:8]}"
            os.rename(path, doomed)
            shutil.rmtree(doomed, ignore_errors=True)


class AsyncSaver:
    """Writes snapshots in a background thread, at most one in flight."""

    def __init__(self):
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last_result = None

    def submit(self, job) -> None:
        self.wait()
        self._thread = threading.Thread(target=self._run, args=(job,), daemon=True)
        self._thread.start()

    def _run(self, job) -> None:
        try:
            self.last_result = job()
        except BaseException as e:  # reported to the main thread at the next wait()
            self._error = e

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def wait_quietly(self) -> None:
        """On the way out after another error: finish the write, drop its error."""
        try:
            self.wait()
        except BaseException as e:  # the original exception matters more
            warn(f"a background checkpoint write failed: {e}")
