"""When and how the recipe saves: triggers, background commits, retention, failures.

The recipe calls `saver.due(step)` and `saver.save(...)`; everything about
timing, at-most-one-in-flight, disk errors and retention is here.
"""

from __future__ import annotations

import errno
import time
from pathlib import Path

from relaytune import __version__
from relaytune.atomic import commit_folder
from relaytune.checkpoint.jobs import BackgroundJob
from relaytune.checkpoint.store import CheckpointStore
from relaytune.config.schema import TrainConfig
from relaytune.log import info, warn
from relaytune.checkpoint.state import adapter_files


def library_versions() -> dict:
    import peft
    import torch
    import transformers

    return {"relaytune": __version__, "torch": torch.__version__,
            "transformers": transformers.__version__, "peft": peft.__version__}


class Saver:
    def __init__(self, cfg: TrainConfig, store: CheckpointStore, config_hash: str, mirror=None):
        self.cfg = cfg
        self.store = store
        self.mirror = mirror
        self.consecutive_failures = 0
        self.meta = {"config_hash": config_hash, "versions": library_versions()}
        self.writer = BackgroundJob()
        self.last_save_time = time.monotonic()
        self.last_saved_step: int | None = None
        self.last_blocked = 0.0
        self.save_seconds = 1.0  # measured duration of one whole save, for the deadline
        self.protect: set[int] = set()  # the best checkpoint's step: retention keeps it
        self.force_step: int | None = None  # a new best eval: save this step whatever the interval

    def due(self, step: int, total: int) -> bool:
        if step == self.last_saved_step or step >= total:
            return False  # the final save covers the last step
        if step % self.cfg.save_steps == 0 or step == self.force_step:
            return True
        interval = self.cfg.save_every_seconds
        return interval > 0 and time.monotonic() - self.last_save_time >= interval

    def save(self, files_fn, step: int, wait: bool = False) -> Path | None:
        """Snapshot now (blocking, short), commit in the background unless `wait`.

        Returns the committed path when waiting; None otherwise or if the save failed.
        """
        t0 = time.monotonic()
        self._collect_previous()  # at most one save in flight: waiting for it blocks training too
        files = files_fn()
        self.last_blocked = time.monotonic() - t0
        self.last_save_time = time.monotonic()
        self.last_saved_step = step

        def job():
            try:
                return commit()
            except OSError as e:  # reported at once, from whichever thread ran the save
                self._report(e, step)
                return None

        def commit():
            path = self.store.save(files, step, self.meta)
            self.consecutive_failures = 0
            if self.mirror:
                self.mirror.protect = set(self.protect)
                self.mirror.submit(path)
            try:
                self.store.prune(self.cfg.save_total_limit, self.protect, upto=step)
            except OSError as e:  # the new checkpoint is committed; an old one merely stays
                warn(f"retention could not remove an old checkpoint ({e.strerror or e}); will retry")
            self.save_seconds = time.monotonic() - t0  # from the request to the commit: what a stop costs
            return path

        if not wait:
            self.writer.submit(job)
            return None
        return job()

    def flush(self) -> None:
        """Wait for the save in flight; a failure is reported, never raised."""
        self._collect_previous()

    def _collect_previous(self) -> None:
        self.writer.wait()

    def _report(self, e: OSError, step: int | None) -> None:
        self.consecutive_failures += 1
        self.last_saved_step = None  # the next trigger tries again
        what = {errno.ENOSPC: "the disk is full", errno.EIO: "the disk reported an I/O error",
                errno.EDQUOT: "the disk quota is exhausted"}.get(e.errno, str(e))
        warn(f"checkpoint at step {step} failed ({what}); the previous checkpoint is intact, "
             "training continues and the next save tries again")

    def commit_final(self, model, out_dir: Path, step: int) -> Path:
        self._collect_previous()
        files = adapter_files(model)
        try:
            path = commit_folder(files, out_dir / "final", {"kind": "final", **self.meta})
        except OSError as e:
            from relaytune.errors import StoppedEarly

            _, latest, _ = self.store.latest_valid()
            raise StoppedEarly(
                f"the final adapter could not be written ({e.strerror or e}); "
                f"{'the run is intact at ' + latest.name if latest else 'no checkpoint is committed'}. "
                "Free space, then run again", step, str(latest) if latest else None, how="disk") from None
        info(f"final adapter written to {path}")
        try:  # a kill during an earlier retention may have left one checkpoint too many
            self.store.prune(self.cfg.save_total_limit, self.protect, upto=step)
        except OSError as e:
            warn(f"retention could not remove an old checkpoint ({e.strerror or e})")
        if self.mirror:
            self.mirror.submit(path)
        return path
