"""The checkpoint store: `checkpoints/step-<N>/` folders, committed by atomic.commit_folder.

A folder is a checkpoint only once its manifest is committed (see atomic.py for the
protocol and its fault points). Only our own tmp folders are ever cleaned up; anything
else in checkpoints/ is reported and left alone.
"""

from __future__ import annotations

from pathlib import Path

from relaytune import atomic, faults
from relaytune.atomic import MANIFEST, read_manifest, verify
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
            reason = verify_checkpoint(path)
            if reason is None:
                return step, path, skipped
            skipped.append(f"{path.name}: {reason}")
        return None, None, skipped

    def set_aside(self, path: Path, reason: str) -> Path:
        """A checkpoint that failed to restore: keep it as `step-N.invalid-<time>`, never delete it."""
        aside = atomic.set_aside(Path(path), kind="invalid", reason=reason)
        return aside

    def path(self, step: int) -> Path:
        return self.root / f"step-{step}"

    def save(self, files: dict[str, bytes], step: int, meta: dict) -> Path:
        target = self.path(step)
        if target.exists() and verify(target) is None and verify_checkpoint(target) is not None:
            atomic.set_aside(target, kind="invalid")  # intact as a folder, not as a checkpoint: say so
        return atomic.commit_folder(files, target, {"step": step, **meta})

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


def verify_checkpoint(path: Path) -> str | None:
    """None if `path` is an intact checkpoint: a verified manifest for its own step, listing exactly
    the files a checkpoint has (see load.py). Never raises."""
    reason = verify(path)
    if reason is not None:
        return reason
    from relaytune.checkpoint.load import checkpoint_files_problem

    try:
        manifest = read_manifest(path)
        m = STEP_DIR.match(Path(path).name)
        if m and manifest.get("step") != int(m.group(1)):
            return f"the manifest is for step {manifest.get('step')}, the folder for step {m.group(1)}"
        return checkpoint_files_problem(Path(path), manifest["files"])
    except Exception as e:  # vanished or changed meanwhile
        return f"unreadable ({type(e).__name__}: {str(e)[:120]})"
