"""Copy committed checkpoints to durable storage, and bring them back to an empty disk.

`mirror_to` is any fsspec URL or folder: a mounted Google Drive, a Kaggle
dataset folder, s3://, gs://, hf://. The copy uses the same rule as the local
store: every file first, manifest.json last, so a remote folder without a
manifest is never trusted. Pushing runs in a background thread; a failure is
reported and retried, and never stops training.
"""

from __future__ import annotations

import json
import queue
import re
import shutil
import threading
import time
import uuid
from pathlib import Path

import fsspec

from relaytune import atomic
from relaytune.atomic import MANIFEST, verify
from relaytune.errors import UserError
from relaytune.log import info, warn
from relaytune.redact import redact_url as redact
from relaytune.redact import scrub, url_secrets
from relaytune.run_dir import STEP_DIR


class Mirror:
    RETRY_SECONDS = 30.0

    def __init__(self, url: str, keep: int | None, state_file: Path):
        self.url = url
        self.label = redact(url)
        try:
            self.fs, root = fsspec.core.url_to_fs(url)
        except ImportError as e:  # fsspec names the missing package in its message
            raise UserError(f"`mirror_to`: {self.label} needs a storage package that is not installed "
                            f"({redact(str(e)).splitlines()[0]}). Install the mirror extra: "
                            "pip install 'relaytune[mirror]' (s3fs and gcsfs), or the package named above") from None
        self.root = root.rstrip("/")
        self.keep = keep
        self.state_file = Path(state_file)
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._state = {"url": self.label, "last_mirrored_step": None, "last_error": None, "time": None}

    # --- pushing -----------------------------------------------------------------------
    def submit(self, local: Path, keep: frozenset[int] = frozenset()) -> None:
        """Queue a committed local folder (checkpoints/step-N or final) for copying; `keep`: steps
        that remote retention must not delete (the best checkpoint)."""
        self._queue.put((Path(local), frozenset(keep)))
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._worker, daemon=True)
            self._thread.start()

    def drain(self, timeout: float = 300.0) -> bool:
        """Wait until everything queued has been copied (or given up on); True if all copied."""
        deadline = time.monotonic() + timeout
        while (not self._queue.empty() or (self._thread and self._thread.is_alive())) and time.monotonic() < deadline:
            time.sleep(0.05)
        return self._state["last_error"] is None

    def _worker(self) -> None:
        while True:
            try:
                local, keep = self._queue.get(timeout=0.5)
            except queue.Empty:
                return
            while not self._queue.empty():  # only the newest matters; older ones may be pruned
                local, keep = self._queue.get()
            for attempt in range(3):
                try:
                    self.push(local, keep)
                    break
                except Exception as e:  # any backend error: report, retry, never stop training
                    self._record(error=f"{type(e).__name__}: {scrub(str(e), url_secrets(self.url))}")
                    warn(f"mirror to {self.label} failed ({type(e).__name__}); will retry")
                    time.sleep(min(self.RETRY_SECONDS, 0.5 * 4 ** attempt))

    def push(self, local: Path, keep: frozenset[int] = frozenset()) -> None:
        if verify(local) is not None:
            return  # pruned or replaced meanwhile: nothing to copy
        remote = f"{self.root}/{self._remote_name(local)}"
        self.fs.makedirs(remote, exist_ok=True)
        names = sorted(p.name for p in local.iterdir() if p.name != MANIFEST)
        for name in names:
            self.fs.put_file(str(local / name), f"{remote}/{name}")
        self.fs.put_file(str(local / MANIFEST), f"{remote}/{MANIFEST}")  # the commit
        step = self._step_of(local)
        if step is not None:
            self._prune(keep)
        self._record(step=step if step is not None else "final")

    def _remote_name(self, local: Path) -> str:
        return f"checkpoints/{local.name}" if STEP_DIR.match(local.name) else local.name

    @staticmethod
    def _step_of(local: Path) -> int | None:
        m = STEP_DIR.match(local.name)
        return int(m.group(1)) if m else None

    def _prune(self, keep: frozenset[int]) -> None:
        if self.keep is None:
            return
        committed = self.remote_steps()
        for step in committed[:-self.keep] if len(committed) > self.keep else []:
            if step not in keep:
                self.fs.rm(f"{self.root}/checkpoints/step-{step}/{MANIFEST}")  # uncommit first
                self.fs.rm(f"{self.root}/checkpoints/step-{step}", recursive=True)

    def _record(self, step=None, error: str | None = None) -> None:
        if step is not None:
            self._state["last_mirrored_step"] = step
        self._state["last_error"] = error
        self._state["time"] = time.time()
        try:
            self.state_file.write_text(json.dumps(self._state))
        except OSError:
            pass  # the state file is informational only

    # --- restoring ---------------------------------------------------------------------
    def remote_steps(self) -> list[int]:
        """Steps of committed (manifest present) remote checkpoints, oldest first."""
        try:
            entries = self.fs.ls(f"{self.root}/checkpoints", detail=False)
        except FileNotFoundError:
            return []
        steps = []
        for entry in entries:
            m = STEP_DIR.match(entry.rstrip("/").rsplit("/", 1)[-1])
            if m and self.fs.exists(f"{self.root}/checkpoints/{m.group(0)}/{MANIFEST}"):
                steps.append(int(m.group(1)))
        return sorted(steps)

    def restore_newer(self, local_root: Path, local_newest: int | None) -> Path | None:
        """If the mirror holds a newer valid checkpoint than the local disk, download it."""
        try:
            remote = [s for s in self.remote_steps() if local_newest is None or s > local_newest]
        except Exception as e:  # an unreachable mirror must not stop a run that can go on locally
            warn(f"cannot read the mirror {self.label} ({type(e).__name__}); continuing with the local disk")
            return None
        for step in reversed(remote):
            target = local_root / f"step-{step}"
            tmp = local_root / f"{atomic.TMP_PREFIX}mirror-{step}-{uuid.uuid4().hex[:8]}"
            tmp.mkdir(parents=True)
            try:
                self.fs.get(f"{self.root}/checkpoints/step-{step}/", str(tmp) + "/", recursive=True)
                nested = tmp / f"step-{step}"
                src = nested if nested.is_dir() and not (tmp / MANIFEST).exists() else tmp
                reason = verify(src)
                if reason:
                    warn(f"mirror checkpoint step-{step} is not usable ({reason}); trying an older one")
                    continue
                if target.exists():
                    continue
                src.rename(target)
                atomic.fsync_dir(local_root)
                info(f"restored step-{step} from the mirror {self.label}")
                return target
            except Exception as e:
                warn(f"cannot download step-{step} from the mirror {self.label} "
                     f"({type(e).__name__}: {scrub(str(e), url_secrets(self.url))})")
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        return None


def is_url(text: str) -> bool:
    return bool(re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", text))
