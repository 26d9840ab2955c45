"""The run folder that a command (`status`, `compare`) was pointed at, never one of the run's own folders.

A checkpoint holds metrics.jsonl, so `run_dir` takes it for a run; a command that then writes
there (status's plot, compare's report) adds a file that its manifest does not list, and the next
resume sets the checkpoint aside as invalid: committed work lost. So a checkpoint, final/, best/,
an unfinished save or any committed folder is refused with the command that reads its run.
`eval` and `export`, which write nothing there, read the same answer (`inner_folder`) as "that
adapter of its run".
"""

from __future__ import annotations

from pathlib import Path

from relaytune.atomic import MANIFEST, TMP_PREFIX
from relaytune.errors import UserError
from relaytune.run_dir import STEP_DIR, RunDir, run_dir


def run_folder(path: str | Path, command: str, option: str | None = None) -> Path:
    """`run_dir(path)`, or a UserError naming what `path` is and the run it belongs to; `option` (compare's
    --checkpoints) is how the command picks one adapter of a run, named in the message."""
    p = Path(path).expanduser().resolve()
    found = inner_folder(p) if p.is_dir() else None
    if found is None:
        return run_dir(path)
    what, run, adapter = found
    if run is None:
        raise UserError(f"{path} is {what}, not a run folder: pass the run's output_dir")
    pick = f" {option} {adapter}" if option and adapter else ""
    raise UserError(f"{path} is {what} of the run in {run}, not a run folder; "
                    f"use `relaytune {command} {run}{pick}`")


def inner_folder(p: Path) -> tuple[str, Path | None, str | None] | None:
    """(what it is, the run it belongs to if known, its adapter name if a command can pick it) for a folder
    inside a run; None for anything else."""
    own = RunDir(p)
    if not (p / MANIFEST).is_file() and any(f.exists() for f in (own.sessions, own.progress, own.checkpoints)):
        return None  # a run itself, whatever its name (an output_dir may well be called final)
    name = p.name.split(".", 1)[0]
    aside = name != p.name  # step-4.invalid-1700000000: set aside by a resume or a new commit
    if p.name.startswith(TMP_PREFIX):
        run = p.parent.parent if p.parent.name == "checkpoints" else p.parent
        return "an unfinished save", run if RunDir(run).looks_like_a_run() else None, None
    if STEP_DIR.match(name) and p.parent.name == "checkpoints":
        return f"checkpoint {name}" + (" set aside" if aside else ""), p.parent.parent, None if aside else name
    if name in ("final", "best") and RunDir(p.parent).looks_like_a_run():
        return f"the {name} adapter ({name}/)" + (" set aside" if aside else ""), p.parent, None if aside else name
    if p.name == "checkpoints" and RunDir(p.parent).looks_like_a_run():
        return "the checkpoints folder", p.parent, None
    if (p / MANIFEST).is_file():
        return f"a committed adapter folder (it holds {MANIFEST})", None, None
    return None
