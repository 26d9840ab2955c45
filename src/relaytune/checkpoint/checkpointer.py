"""The Checkpointer: the one object the trainer talks to about checkpoints.

    resume_point(fresh)   which checkpoint to continue from (None: start fresh)
    restore(source, live) put a checkpoint back into the live objects
    due(step)             whether this step boundary should be saved
    save(...)             snapshot now, commit in the background (or wait)
    mark_best(step)       a new best eval: save it and keep it through retention
    finish(...)           best/, then final/
    close()               let the writer and the mirror finish

Everything behind it (store, saver thread, retention, mirror, best/) is private.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from relaytune import atomic
from relaytune.checkpoint import load as loading
from relaytune.checkpoint import state as saved
from relaytune.checkpoint.best import keep_best
from relaytune.checkpoint.load import Damaged, Loaded
from relaytune.checkpoint.mirror import Mirror
from relaytune.checkpoint.resume import Relay, choose_checkpoint
from relaytune.checkpoint.saver import Saver
from relaytune.checkpoint.state import Live, TrainState
from relaytune.checkpoint.store import CheckpointStore, verify_checkpoint
from relaytune.config import TrainConfig
from relaytune.errors import UserError
from relaytune.log import info, warn
from relaytune.run_dir import RunDir

MAX_FAILED_SAVES = 3  # failed saves in a row before the run stops (exit 75) rather than train unsaved


class Checkpointer:
    def __init__(self, cfg: TrainConfig, run: RunDir):
        self._cfg = cfg
        self._run = run
        self._store = CheckpointStore(run.checkpoints)
        self._mirror = Mirror(cfg.mirror_to, cfg.save_total_limit, run.mirror_state) if cfg.mirror_to else None
        config_dump = cfg.model_dump(mode="json")
        config_hash = hashlib.sha256(json.dumps(config_dump, sort_keys=True).encode()).hexdigest()[:16]
        self._saver = Saver(cfg, self._store, config_hash, self._mirror)
        self._keep: frozenset[int] = frozenset()  # the best step: retention never deletes it
        self._relay: Relay | None = None  # another run to continue (resume_from_checkpoint, Kaggle inputs)
        self._fingerprint: str | None = None  # the training data's, once known: written into final/

    # --- where to start ------------------------------------------------------------------
    def resume_point(self, fresh: bool) -> Path | None:
        """Clean up our own unfinished saves, pull newer checkpoints from the mirror, choose."""
        self._store.startup_cleanup()
        atomic.clean_tmp(self._run.root)  # a kill inside the final commit leaves our tmp folder beside final/
        if self._mirror and not fresh:
            local_newest, _, _ = self._store.latest_valid()
            self._mirror.restore_newer(self._store.root, local_newest)
        chosen = choose_checkpoint(self._cfg, self._store, fresh)
        if isinstance(chosen, Relay):  # another run's state: which one depends on the data (relay_pick)
            self._relay = chosen
            return None
        return chosen

    def relay_caches(self) -> list[Path]:
        """The tokenization caches of the runs this one may continue (read only, never written)."""
        return self._relay.caches() if self._relay else []

    def relay_pick(self, start_from: Path | None, fingerprint: str) -> Path | None:
        """Once the data is known: with a relay pending, the newest source checkpoint trained on this
        data (None: fresh); otherwise `start_from`. The fingerprint also goes into final/ and best/."""
        self._fingerprint = fingerprint
        return self._relay.pick(fingerprint) if self._relay else start_from

    def rollback_point(self, before: int | None = None) -> Path | None:
        """The newest committed checkpoint (older than step `before`, if given), for a rollback
        after repeated non-finite steps."""
        for step, path in reversed(self._store.step_dirs()):
            if (before is None or step < before) and verify_checkpoint(path) is None:
                return path
        return None

    def load(self, path: Path | None) -> Loaded | None:
        """Read and parse a checkpoint before anything live is touched; a damaged one is set aside
        (with the reason) and the next newest valid one is tried. None: nothing left to load."""
        while path is not None:
            try:
                return loading.load(path)
            except Damaged as e:
                path = self.give_up_on(path, str(e))
        return None

    def give_up_on(self, path: Path, reason: str, before: int | None = None) -> Path | None:
        """Set a checkpoint that cannot be restored aside; the newest valid one left (older than
        `before`, if given), or None."""
        if Path(path).parent != self._store.root:  # resume_from_checkpoint named it: the user's folder
            raise UserError(f"`resume_from_checkpoint`: {path} cannot be restored: {reason}")
        self._store.set_aside(Path(path), reason)
        if before is not None:
            return self.rollback_point(before)
        _, nxt, skipped = self._store.latest_valid()
        for why in skipped:
            warn(f"skipped checkpoint {why}")
        info(f"continuing from {nxt.name} instead" if nxt else "no valid checkpoint left; starting from the beginning")
        return nxt

    def restore(self, loaded: Loaded, live: Live) -> dict:
        """Check a loaded checkpoint against the live objects, then put it in (all or nothing):
        Damaged leaves the live objects exactly as they were."""
        loading.check_fits(loaded, live)
        loading.apply(loaded, live)
        best = saved.progress_of(loaded.state).best_step
        self._keep = frozenset() if best is None else frozenset({best})
        return loaded.state

    # --- saving --------------------------------------------------------------------------
    @property
    def save_seconds(self) -> float:
        """What one whole save took last time: the deadline keeps this much in reserve."""
        return self._saver.save_seconds

    @property
    def blocked_seconds(self) -> float:
        return self._saver.blocked_seconds

    def due(self, step: int, total: int) -> bool:
        return self._saver.due(step, total)

    def save(self, files_fn, step: int, since: float | None = None, wait: bool = False) -> Path | None:
        return self._saver.save(files_fn, step, keep=self._keep, since=since, wait=wait)

    def mark_best(self, step: int) -> None:
        self._keep = frozenset({step})
        self._saver.force(step)

    def failing(self) -> bool:
        """Too many saves in a row failed: the run must stop rather than train unsaved."""
        return self._saver.failures >= MAX_FAILED_SAVES

    def raise_if_failing(self, step: int, force: bool = False) -> None:
        """When saves keep failing: StoppedEarly (exit 75), or TrainingDiverged (exit 1) where no checkpoint
        is committed; `force`: another rank (rank 0, the one that saves) found they do, and every rank
        stops with it."""
        failures = self._saver.failures
        if failures >= MAX_FAILED_SAVES or force:
            failures = max(failures, MAX_FAILED_SAVES)
            raise self._saver.out_of_room(
                f"no checkpoint could be written {failures} times in a row (disk full or failing)", step)

    # --- the end -------------------------------------------------------------------------
    def finish(self, live: Live, progress: TrainState) -> Path:
        """best/ (and, with load_best_model_at_end, the best weights into the model), then final/."""
        self._saver.flush()
        config = self._cfg.model_dump(mode="json")

        def run_info(step: int) -> dict:  # in the manifests of final/ and best/: each works alone
            return saved.run_info(live.model, config, self._fingerprint, step)

        keep_best(self._cfg, live.model, progress, self._run, run_info)
        return self._saver.commit_final(saved.adapter_files(live.model), self._run.final, progress.step,
                                        self._keep, run=run_info(progress.step))

    def flush(self) -> None:
        """Wait for the save in flight (a failure is reported, never raised)."""
        self._saver.flush()

    def drain_mirror(self, timeout: float = 300.0) -> None:
        if self._mirror:
            self._mirror.drain(timeout=timeout)

    def close(self) -> None:
        """On any way out: let a background write finish; its error matters less than the one in flight."""
        self._saver.wait_quietly()

