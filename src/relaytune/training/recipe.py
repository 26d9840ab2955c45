"""The recipe: LoRA / QLoRA supervised fine-tuning, top to bottom.

    set-up:  config -> data (before any model loads) -> model -> optimizer -> resume
    loop:    one global batch per optimizer step, split into micro-batches;
             log, evaluate, checkpoint; stop cleanly on a signal or the deadline
    finish:  the last evaluation, best/, final/, and return

Exactness rests on three rules: the global batch of step s is a pure function of
(seed, s); the loss is normalised by the target tokens of the whole global batch, so
the micro-batch size does not change the maths; and every piece of state is saved and
restored at a step boundary. The parts live in trainer.py (the live objects),
step.py (one optimizer step), recovery.py (OOM, NaN), stops.py (signals, deadline)
and the checkpoint package (everything on disk).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from relaytune import faults
from relaytune.config import load_config
from relaytune.distributed.launch import maybe_launch, run_lock
from relaytune.distributed.world import joined
from relaytune.errors import UserError
from relaytune.log import info
from relaytune.run_dir import RunDir
from relaytune.training.stops import StopRequest
from relaytune.training.trainer import Trainer


@dataclass
class RunResult:
    status: str  # "finished" or "already finished"
    step: int | None  # the last step trained; None when the run had already finished
    output_dir: Path
    final_adapter: Path

    @property
    def already_finished(self) -> bool:
        return self.status == "already finished"


def train(config=None, /, *, fresh: bool = False, **overrides) -> RunResult:
    """Train, or continue the run in the config's output_dir. The CLI calls exactly this."""
    cfg = load_config(config, overrides)
    run = _run_dir(cfg)
    if run.is_finished():
        return already_finished(cfg, run, fresh, config, overrides)
    if (launched := maybe_launch(cfg, run, config, fresh, overrides)) is not None:
        return launched  # several GPUs: the workers ran this same function, each as one rank
    faults.reset()  # a test's fault plan is read once per run
    created = _missing_folders(run.root)  # removed again if the run fails before it has anything
    try:
        _create(run.root)
        # One training process (or launch) per run folder; a second one exits 2 touching nothing.
        with joined() as world, run_lock(world, run.root):
            trainer = Trainer(cfg, run)
            # Signal handlers only set a flag. Installed when the loop starts and kept until train()
            # returns, so a second signal after the stop checkpoint is committed still ends in exit 75.
            stop = trainer.stop = StopRequest.adopt()  # a worker's, installed before set-up
            try:
                trainer.setup(fresh)  # everything that can reject the config happens before the model loads
                trainer.run_loop()
                final = trainer.finish()
                return RunResult("finished", trainer.state.step, run.root, final)
            except BaseException as e:
                trainer.end_session(e)
                if created:
                    _forget_lock_if_nothing_else(run)  # while still held: no other process is in there
                raise
            finally:
                trainer.close()
                stop.uninstall()
    except BaseException:
        _remove_if_empty(created)
        raise


# --- a run that fails before its first step leaves no folder behind ---------------------------

def _missing_folders(root: Path) -> list[Path]:
    """The folders that creating `root` creates, deepest first (none if it exists)."""
    missing = []
    p = root
    while not p.exists() and p != p.parent:
        missing.append(p)
        p = p.parent
    return missing


def _forget_lock_if_nothing_else(run: RunDir) -> None:
    """Remove the lock file and an empty data-cache, if they are all that this call left in a folder it
    created: a run that failed before its first step (a bad dataset path, say)."""
    from relaytune.atomic import TMP_PREFIX

    try:
        entries = list(run.root.iterdir())
        cache = [p for p in run.data_cache.iterdir()] if run.data_cache.is_dir() else []
        if any(p.name not in (run.lock.name, run.data_cache.name) for p in entries) or \
                any(not p.name.startswith(TMP_PREFIX) for p in cache):
            return  # something worth keeping (quarantine.jsonl, a cache entry, logs)
        for p in cache:  # our own unfinished cache write
            shutil.rmtree(p, ignore_errors=True)
        if run.data_cache.is_dir():
            run.data_cache.rmdir()
        run.lock.unlink(missing_ok=True)
    except OSError:
        pass


def _remove_if_empty(created: list[Path]) -> None:
    """rmdir the folders this call created, deepest first, while they are empty (never anything else)."""
    for folder in created:
        try:
            folder.rmdir()
        except OSError:
            return


# --- a finished run ----------------------------------------------------------------------------

def already_finished(cfg, run: RunDir, fresh: bool, config=None, overrides: dict | None = None) -> RunResult:
    """Nothing to train: say so, and when the user asked for something else, why and what to do."""
    from relaytune.checkpoint.resume import config_changes
    from relaytune.errors import UserError
    from relaytune.log import warn
    from relaytune.run_dir import saved_config, step_checkpoints

    if fresh:
        raise UserError(
            f"--fresh: {run.root} already holds a finished run (final/ is committed); a fresh start there "
            "would mix two runs, and relaytune never deletes a run. Start the new run in another folder: "
            f"{_command(config, overrides, {'output_dir': _sibling(run.root, 'new')}, fresh=True)}")
    saved = saved_config(run.root)
    breaking = config_changes(saved["config"], cfg)[0] if saved else []
    if not breaking:
        info(f"{run.root} holds a finished run (final/ is committed); nothing to do")
        return RunResult("already finished", None, run.root, run.final)
    refs = step_checkpoints(run.root)
    options = []
    if refs:
        options.append(
            f"train longer from this run's last checkpoint ({refs[-1].name}) with the new schedule, in a new "
            f"folder (this run stays as it is): "
            + _command(config, overrides, {"output_dir": _sibling(run.root, "continued"),
                                           "resume_from_checkpoint": str(run.root)}) +
            "  - the result is not what one uninterrupted run with the new settings would give: "
            "exactness to a single run no longer applies")
    else:
        options.append("train longer from this run's state: not possible, its checkpoints/ is gone "
                       "(final/ holds the adapter only, without the optimizer state)")
    options.append(f"start a new run with the new settings in another folder: "
                   f"{_command(config, overrides, {'output_dir': _sibling(run.root, 'new')})}")
    warn(f"{run.root} holds a finished run (final/ is committed), so nothing was trained: the run "
         f"finished with other settings than this config asks for ({'; '.join(breaking)}). A finished run "
         "never changes. To get what you asked for:\n" +
         "\n".join(f"  {i}. {o}" for i, o in enumerate(options, 1)))
    return RunResult("already finished", None, run.root, run.final)


def _sibling(root: Path, tag: str) -> str:
    return str(root.with_name(f"{root.name}-{tag}"))


def _command(config, overrides: dict | None, extra: dict, fresh: bool = False) -> str:
    """The exact command that does it: the CLI form for a config file, else the Python call."""
    import shlex

    settings = {**(overrides or {}), **extra}
    if isinstance(config, (str, Path)):
        words = ["relaytune", "train", str(config), *(f"{k}={v}" for k, v in settings.items())]
        return " ".join(shlex.quote(w) for w in words) + (" --fresh" if fresh else "")
    args = ", ".join(f"{k}={v!r}" for k, v in settings.items())
    return f"relaytune.train(config, {args}" + (", fresh=True)" if fresh else ")")


def _run_dir(cfg) -> RunDir:
    """output_dir as an absolute folder, or a message that says why it cannot be one (exit 2)."""
    raw = Path(cfg.output_dir).expanduser()
    try:
        root = raw.resolve()
        is_file = root.exists() and not root.is_dir()
    except (RuntimeError, OSError) as e:  # Python reports a symlink loop as a RuntimeError
        raise UserError(f"`output_dir`: {raw} cannot be used ({e}); choose another folder") from None
    if is_file:
        raise UserError(f"`output_dir`: {root} is a file, not a folder; choose a folder (it is created if missing)")
    return RunDir(root)


def _create(root: Path) -> None:
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a read-only parent, a full disk, a path through a file
        raise UserError(f"`output_dir`: cannot create {root} ({e.strerror or e}); choose a folder you can "
                        "write to") from None
