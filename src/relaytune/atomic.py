"""Durable writes: the one place that decides how relaytune puts bytes on disk.

Every writer (checkpoints, final/ and best/, the data cache, metrics, trackers' state,
the status plot, the eval cache, exports, the built-in model cache, the mirror) goes
through here, so a durability fix reaches all of them.

Rules:
  - a file is replaced by writing `.relaytune-tmp-*` beside it, fsyncing it, renaming
    it over the old one and fsyncing the folder: a reader sees the old or the new file;
  - a folder is committed the same way, and holds `manifest.json` (sha256 and size of
    every file, written last) so that a folder without a valid manifest is never trusted;
  - a folder is removed by renaming it to a tmp name first, so a crash mid-delete
    leaves a tmp folder, never a half folder under its real name;
  - cleanup only ever removes entries named `.relaytune-tmp-*`: our own unfinished work.

Each commit step is a named fault point (see faults.py): `<points>:begin`, `:mid_file`,
`:before_manifest`, `:after_manifest`, `:before_rename`, `:after_rename`.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, StrictStr, ValidationError

from relaytune import faults
from relaytune.log import info, warn

TMP_PREFIX = ".relaytune-tmp-"
MANIFEST = "manifest.json"
FORMAT = "relaytune-checkpoint/1"

FileBytes = bytes | Callable[[], bytes]


class FileEntry(BaseModel):
    """One file of a committed folder: exactly its sha256 and size, nothing else."""

    model_config = ConfigDict(extra="forbid", strict=True)
    sha256: Annotated[StrictStr, Field(pattern=r"^[0-9a-f]{64}$")]
    size: Annotated[StrictInt, Field(ge=0)]


class Manifest(BaseModel):
    """The exact shape of `manifest.json`. Writers add their own keys (`step`, `kind`, `config_hash`,
    `versions`, `eval_loss`, `version`): those are allowed, and typed where they are known."""

    model_config = ConfigDict(extra="allow", strict=True)
    format: Literal["relaytune-checkpoint/1"]
    files: dict[StrictStr, FileEntry]
    created: StrictFloat | StrictInt
    step: Annotated[StrictInt, Field(ge=0)] | None = None
    kind: StrictStr | None = None
    config_hash: StrictStr | None = None
    versions: dict[StrictStr, StrictStr] | None = None
    eval_loss: StrictFloat | StrictInt | None = None


def parse_manifest(raw: bytes | str) -> Manifest:
    """The manifest, checked against its exact shape; ValueError (never anything else) if it is not one."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as e:  # RecursionError: a deeply nested (hostile) document
        raise ValueError(f"not JSON ({str(e)[:80]})") from None
    try:
        manifest = Manifest.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"]) or "top level"
        raise ValueError(f"{where}: {err['msg']}") from None
    for name in manifest.files:
        if name in ("", ".", "..", MANIFEST) or name.startswith("/") or ".." in name.split("/") or "\\" in name \
                or "\0" in name:
            raise ValueError(f"files: {name!r} is not a file name of this folder")
    return manifest


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def tmp_path(parent: Path, name: str) -> Path:
    """A unique tmp name in `parent`: ours to remove if a crash leaves it behind."""
    return Path(parent) / f"{TMP_PREFIX}{name}-{uuid.uuid4().hex[:8]}"


def write_file(path: Path, data: bytes, points: str = "save") -> dict:
    """Write and fsync one new file; return its manifest entry."""
    with open(path, "wb") as fh:
        if faults.armed(f"{points}:mid_file"):  # a kill between two halves: a torn file on disk
            fh.write(data[:len(data) // 2])
            faults.reach(f"{points}:mid_file")
            fh.write(data[len(data) // 2:])
        else:
            fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    return {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}


def replace_file(path: Path, data: bytes | str, durable: bool = True) -> None:
    """Atomically replace (or create) one file: readers see the old bytes or the new ones.

    `durable=False` skips the fsyncs, for files rewritten every step that only report (progress):
    after a power loss such a file may be old or absent, never torn, and an fsync per step costs
    tens of milliseconds on some filesystems.
    """
    path = Path(path)
    raw = data.encode("utf-8") if isinstance(data, str) else data
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}-{uuid.uuid4().hex[:8]}")
    try:
        if durable:
            write_file(tmp, raw, points="replace")
        else:
            tmp.write_bytes(raw)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)


def commit_folder(files: dict[str, FileBytes], target: Path, meta: dict, points: str = "save") -> Path:
    """Write `files` as the folder `target`, with a manifest, by the commit protocol.

    A value may be a callable that returns the bytes: it runs here, in the writing thread.
    A folder already at `target` is kept under another name, never deleted.
    """
    faults.reach(f"{points}:begin")
    files = {name: data() if callable(data) else data for name, data in files.items()}
    parent = Path(target).parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_path(parent, Path(target).name)
    tmp.mkdir()
    try:
        entries = {name: write_file(tmp / name, data, points) for name, data in sorted(files.items())}
        faults.reach(f"{points}:before_manifest")
        manifest = {"format": FORMAT, **meta, "files": entries, "created": time.time()}
        write_file(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode(), points)
        faults.reach(f"{points}:after_manifest")
        if Path(target).exists():
            set_aside(Path(target))
        faults.reach(f"{points}:before_rename")
        publish(tmp, Path(target))
        faults.reach(f"{points}:after_rename")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Path(target)


def commit_file(tmp: Path, target: Path) -> None:
    """A file written in place by a library (not by write_file): fsync it, then give it its real name."""
    fsync_dir(tmp)  # opening read-only and fsyncing works for a file as for a folder
    os.replace(tmp, target)
    fsync_dir(Path(target).parent)


def publish(tmp: Path, target: Path) -> None:
    """Give a finished tmp folder (or file) its real name, durably."""
    os.rename(tmp, target)
    fsync_dir(Path(target).parent)


def set_aside(path: Path, kind: str | None = None, reason: str | None = None) -> Path:
    """Keep a folder under another name, never delete it: one where a new commit must go
    (`replaced` or `invalid`), or (with `reason`) one that turned out damaged when read."""
    kind = kind or ("replaced" if verify(path) is None else "invalid")
    aside = path.with_name(f"{path.name}.{kind}-{int(time.time())}")
    n = 1
    while aside.exists():
        aside = path.with_name(f"{path.name}.{kind}-{int(time.time())}-{n}")
        n += 1
    os.rename(path, aside)
    fsync_dir(path.parent)
    if reason is None:
        warn(f"{path} already existed ({kind}); kept it as {aside.name} and wrote a new one")
    else:
        warn(f"{path.name} cannot be restored ({reason}); kept it aside as {aside.name}")
    return aside


def remove_folder(path: Path) -> None:
    """Delete a folder of ours: rename it to a tmp name first, so a crash mid-delete is harmless."""
    doomed = tmp_path(Path(path).parent, f"delete-{Path(path).name}")
    os.rename(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def clean_tmp(parent: Path, quiet: bool = False) -> None:
    """Remove our own unfinished writes in `parent`; nothing else is ever touched."""
    if not Path(parent).is_dir():
        return
    for p in sorted(Path(parent).iterdir()):
        if not p.name.startswith(TMP_PREFIX) or p.is_symlink():
            continue
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        if not quiet:
            info(f"removed an unfinished save of ours: {p.name}")


# A tmp folder younger than this, unlocked and empty, may be one whose maker has not locked it yet.
NEWBORN_SECONDS = 60.0


@contextlib.contextmanager
def held_tmp_folder(parent: Path, name: str) -> Iterator[Path]:
    """A new `.relaytune-tmp-<name>-*` folder in `parent`, kernel-locked (flock) while this process
    holds it and removed on leaving (unless published meanwhile).

    Why a lock and not a pid or an age: the kernel drops the lock however the process ends (SIGKILL
    included), a recycled pid (a restarted container starts at the same small pids) cannot keep a dead
    folder alive, and a long export (an 8B merge) is never mistaken for an old one. `clean_stale_tmp`
    removes only folders whose lock it can take. A filesystem without locks leaves the folder unlocked
    and the cleaner then cannot tell, so it keeps it.
    """
    parent = Path(parent)
    while True:
        folder = tmp_path(parent, name)
        folder.mkdir()
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        _lock(fd, wait=True)
        try:
            if os.stat(folder).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:  # a cleaner took it for a dead one before the lock (clock skew): anew
            pass
        os.close(fd)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        os.close(fd)  # after the removal: no cleaner can take it for a dead one meanwhile


def _lock(fd: int, wait: bool) -> bool:
    """flock(LOCK_EX): True if taken, False if another holds it; OSError if locks are unsupported."""
    import fcntl  # not on Windows; imported where it is used

    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        return True
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return False
        if wait:
            return True  # unsupported here: the folder stays unlocked, and cleaners keep it (see above)
        raise


def clean_stale_tmp(parent: Path, name: str) -> tuple[list[tuple[Path, int]], list[Path]]:
    """Remove the `.relaytune-tmp-<name>-*` folders in `parent` that no live process holds
    (see `held_tmp_folder`): ([(removed, bytes)], [kept because this filesystem cannot tell])."""
    removed: list[tuple[Path, int]] = []
    unsure: list[Path] = []
    if not Path(parent).is_dir():
        return removed, unsure
    for p in sorted(Path(parent).glob(f"{TMP_PREFIX}{name}-*")):
        if p.is_symlink() or not p.is_dir():
            continue
        try:
            fd = os.open(p, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            continue  # removed meanwhile (its export ended), or not ours to open
        try:
            if not _lock(fd, wait=False):
                continue  # a live export's
            if not any(p.iterdir()) and time.time() - p.stat().st_mtime < NEWBORN_SECONDS:
                continue  # just made, its maker about to lock it
            size = sum(_on_disk(f) for f in p.rglob("*") if f.is_file() and not f.is_symlink())
            shutil.rmtree(p, ignore_errors=True)  # under our lock: no maker can adopt it meanwhile
            removed.append((p, size))
        except OSError:
            unsure.append(p)
        finally:
            os.close(fd)
    return removed, unsure


def _on_disk(f: Path) -> int:
    """Bytes `f` takes on disk: a file killed mid-write may be sparse (written into a pre-sized mmap)."""
    st = f.stat()
    blocks = getattr(st, "st_blocks", None)  # not on Windows
    return st.st_size if blocks is None else min(st.st_size, blocks * 512)


def verify(path: Path) -> str | None:
    """None if `path` is a committed, intact folder; otherwise why not. Never raises."""
    try:
        return _problem(Path(path))
    except Exception as e:  # an unreadable file, a folder that vanished meanwhile: not intact
        return f"unreadable ({type(e).__name__}: {str(e)[:120]})"


def _problem(path: Path) -> str | None:
    mpath = path / MANIFEST
    if not mpath.is_file():
        return "no manifest (an unfinished or foreign folder)"
    raw = mpath.read_bytes()
    try:
        json.loads(raw)
    except (ValueError, RecursionError):
        return "unreadable manifest"
    try:
        manifest = parse_manifest(raw)
    except ValueError as e:
        if isinstance(json.loads(raw), dict) and json.loads(raw).get("format") not in (FORMAT, None):
            return f"unknown format {json.loads(raw).get('format')!r}"
        return f"malformed manifest ({e})"
    for name, entry in manifest.files.items():
        f = path / name
        if not f.is_file() or f.is_symlink():
            return f"missing file {name}"
        if f.stat().st_size != entry.size:
            return f"{name} has {f.stat().st_size} bytes, the manifest says {entry.size}"
        if sha256_file(f) != entry.sha256:
            return f"{name} does not match its sha256 (corrupted)"
    return None


def read_manifest(path: Path) -> dict:
    """The manifest as a dict, checked against its exact shape (ValueError if it has another)."""
    return parse_manifest((Path(path) / MANIFEST).read_bytes()).model_dump(exclude_none=True)
