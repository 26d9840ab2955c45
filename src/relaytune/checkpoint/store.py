"""The checkpoint store: `checkpoints/step-<N>/` folders, committed by atomic.commit_folder.

A folder is a checkpoint only once its manifest is committed (see atomic.py for the
protocol and its fault points). Only our own tmp folders are ever cleaned up; anything
else in checkpoints/ is reported and left alone.
"""

from __future__ import annotations


from pathlib import Path

from relaytune import atomic, faults
from relaytune.atomic import MANIFEST, verify
from relaytune.log import warn

from relaytune.run_dir import STEP_DIR


class CheckpointStore:
    """`checkpoints/step-<N>/` folders under one run."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def startup_cleanup(self) -> None:
        """Remove our own unfinished saves; report anything else that is not a step-N folder."""
        atomic.clean_tmp(self.root)
        if self.root.is_dir():
            for p in sorted(self.root.iterdir()):
                if not STEP_DIR.match(p.name):
                    warn(f"{p} is not ours; leaving it alone")

    def step_dirs(self) -> list[tuple[int, Path]]:
        if not self.root.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.root.iterdir() if (m := STEP_DIR.match(p.name))]
        return sorted(found)

    def latest_valid(self) -> tuple[int | None, Path | None, list[str]]:
        """(step, path) of the newest intact checkpoint, and why each newer folder was skipped."""
        skipped = []
        for step, path in reversed(self.step_dirs()):
            reason = verify(path)
            if reason is None:
                return step, path, skipped
            skipped.append(f"{path.name}: {reason}")
        return None, None, skipped

    def path(self, step: int) -> Path:
        return self.root / f"step-{step}"

    def save(self, files: dict[str, bytes], step: int, meta: dict) -> Path:
        return atomic.commit_folder(files, self.path(step), {"step": step, **meta})

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
            atomic.remove_folder(path)
