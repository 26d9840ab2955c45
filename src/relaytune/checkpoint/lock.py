"""One training process per run folder: an exclusive kernel lock on `output_dir/.relaytune.lock`.

`fcntl.flock` is held for the whole run on an open file; the kernel drops it when the process
ends, however it ends (a SIGKILL included), so a lock left by a killed run never blocks a re-run.
The file holds the holder's pid and start time, for the message a second process prints. It is
never deleted: deleting it would let two processes lock two different files of the same name.
Read-only commands (status, eval, export) do not take it.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from relaytune.errors import UserError

LOCK_NAME = ".relaytune.lock"  # RunDir.lock


class RunLock:
    """`with RunLock(output_dir):` the whole training run; UserError (exit 2) if another process holds it."""

    def __init__(self, root: Path):
        self.path = Path(root) / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = _describe(fd)
            os.close(fd)
            raise UserError(f"another relaytune process ({holder}) is training in {self.path.parent}; "
                            "wait for it to end, or stop it, then run again") from None
        except BaseException:
            os.close(fd)
            raise
        record = json.dumps({"pid": os.getpid(), "started": time.time(),
                             "started_at": time.strftime("%Y-%m-%d %H:%M:%S")}).encode()
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, record, 0)
        except OSError:
            pass  # a full disk: the lock holds all the same, only the message loses its details
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the file drops the kernel lock
            self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _describe(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"pid {int(info['pid'])}, started {str(info['started_at'])[:40]}"
    except (OSError, ValueError, KeyError, TypeError):
        return "pid unknown, started at an unknown time"  # it is writing its details right now
