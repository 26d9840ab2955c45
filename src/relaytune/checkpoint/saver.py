"""When and how checkpoints are written: triggers, background commits, retention, failures.

The snapshot is taken in the caller's thread at a step boundary (short); the commit runs in
one background thread, at most one in flight. Everything the writer needs (the files, the
step, the step retention must keep) is handed to it as values when the save is submitted,
so the main thread never shares a field with it.
"""

from __future__ import annotations

import errno
import time
from collections.abc import Callable
from pathlib import Path

from relaytune import __version__
from relaytune.atomic import commit_folder
from relaytune.checkpoint.jobs import BackgroundJob
from relaytune.checkpoint.store import CheckpointStore
from relaytune.config import TrainConfig
from relaytune.errors import StoppedEarly, TrainingDiverged
from relaytune.log import info, warn

DISK_ERRORS = {errno.ENOSPC: "the disk is full", errno.EIO: "the disk reported an I/O error",
               errno.EDQUOT: "the disk quota is exhausted"}


def library_versions() -> dict:
    import peft
    import torch
    import transformers

    return {"relaytune": __version__, "torch": torch.__version__,
            "transformers": transformers.__version__, "peft": peft.__version__}


class Saver:
    def __init__(self, cfg: TrainConfig, store: CheckpointStore, config_hash: str, mirror=None):
        self._cfg = cfg
        self._store = store
        self._mirror = mirror
        self._meta = {"config_hash": config_hash, "versions": library_versions()}
        self._writer = BackgroundJob()
        self._last_save_time = time.monotonic()
        self._last_saved_step: int | None = None
        self._force_step: int | None = None  # a new best eval: save this step whatever the interval
        self.failures = 0  # failed saves in a row
        self.blocked_seconds = 0.0  # how long the last save held training up
        self.save_seconds = 1.0  # a whole save, from the request to the commit: what a stop costs

    def force(self, step: int) -> None:
        self._force_step = step

    def due(self, step: int, total: int) -> bool:
        if step == self._last_saved_step or step >= total:
            return False  # the final save covers the last step
        if step % self._cfg.save_steps == 0 or step == self._force_step:
            return True
        interval = self._cfg.save_every_seconds
        return interval > 0 and time.monotonic() - self._last_save_time >= interval

    def save(self, files_fn: Callable[[], dict], step: int, *, keep: frozenset[int] = frozenset(),
             since: float | None = None, wait: bool = False) -> Path | None:
        """Snapshot now (blocking, short), commit in the background unless `wait`.

        `keep` holds the steps retention must not delete (the best checkpoint). `since` is when
        the save was requested (a signal), for the measured cost of a stop. Returns the committed
        path when waiting; None otherwise or if the save failed.
        """
        t0 = time.monotonic() if since is None else since
        self._writer.wait()  # at most one save in flight: waiting for it blocks training too
        files = files_fn()
        self.blocked_seconds = time.monotonic() - t0
        self._last_save_time = time.monotonic()
        self._last_saved_step = step

        def job() -> Path | None:
            try:
                return self._commit(files, step, keep, t0)
            except OSError as e:  # reported at once, from whichever thread ran the save
                self._report(e, step)
                return None

        if not wait:
            self._writer.submit(job)
            return None
        return job()

    def _commit(self, files: dict, step: int, keep: frozenset[int], t0: float) -> Path:
        path = self._store.save(files, step, self._meta)
        self.failures = 0
        if self._mirror:
            self._mirror.submit(path, keep)
        self._prune(step, keep)
        self.save_seconds = time.monotonic() - t0
        return path

    def _prune(self, step: int, keep: frozenset[int]) -> None:
        try:
            self._store.prune(self._cfg.save_total_limit, keep, upto=step)
        except OSError as e:  # the new checkpoint is committed; an old one merely stays
            warn(f"retention could not remove an old checkpoint ({e.strerror or e}); will retry")

    def _report(self, e: OSError, step: int | None) -> None:
        self.failures += 1
        self._last_saved_step = None  # the next trigger tries again
        what = DISK_ERRORS.get(e.errno, str(e))
        warn(f"checkpoint at step {step} failed ({what}); the previous checkpoint is intact, "
             "training continues and the next save tries again")

    def out_of_room(self, what: str, step: int) -> Exception:
        """How a session that cannot write its work ends. Exit 75 promises a checkpoint to continue
        from, so it is StoppedEarly only where one is committed; without one the session's steps are
        gone, and that is a failure (exit 1), not a stop."""
        _, latest, _ = self._store.latest_valid()
        if latest is None:
            return TrainingDiverged(f"{what}, and no checkpoint of this run is committed: the steps of this "
                                    f"session, up to step {step}, are lost. Free space, then run the same "
                                    "command again to start them over")
        return StoppedEarly(f"{what}; the run is intact at {latest.name}. Free space", step, str(latest), how="disk")

    def flush(self) -> None:
        """Wait for the save in flight; a failure is reported, never raised."""
        self._writer.wait()

    def wait_quietly(self) -> None:
        self._writer.wait_quietly()

    def commit_final(self, files: dict[str, bytes], target: Path, step: int, keep: frozenset[int],
                     run: dict | None = None) -> Path:
        self._writer.wait()
        try:  # `run`: the config and data fingerprint, kept in the manifest so final/ stands alone
            path = commit_folder(files, target, {"kind": "final", **self._meta, **({"run": run} if run else {})})
        except OSError as e:
            raise self.out_of_room(f"the final adapter could not be written ({e.strerror or e})", step) from None
        info(f"final adapter written to {path}")
        self._prune(step, keep)  # a kill during an earlier retention may have left one checkpoint too many
        if self._mirror:
            self._mirror.submit(path, keep)
        return path
