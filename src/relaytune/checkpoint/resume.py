"""Which checkpoint a run continues from, and whether the config still allows it.

Besides its own `checkpoints/`, a run can continue another run's state (the relay):
`resume_from_checkpoint` naming a checkpoint or a whole run folder, or, on Kaggle with an
empty output_dir, a matching run found under the notebook's inputs (a previous session's
output attached read-only). The source is only ever read: the state is loaded from it, its
tokenization cache is copied into this run's own data-cache, and every later checkpoint is
written here.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from relaytune.atomic import MANIFEST, read_manifest, verify
from relaytune.checkpoint.store import CheckpointStore, verify_checkpoint
from relaytune.config import TrainConfig, saved_config_view
from relaytune.errors import UserError
from relaytune.log import info, notice, warn
from relaytune.redact import redact_url
from relaytune.run_dir import STEP_DIR, TRAINER_STATE, RunDir

KAGGLE_INPUT = Path("/kaggle/input")  # where Kaggle mounts a notebook's inputs, read-only
SEARCH_DEPTH = 4  # /kaggle/input/<notebook>/<output folder>/<run>: a few levels are enough
SCHEDULE_KEYS = ("max_steps", "num_train_epochs")  # what `train longer` changes


# Keys whose change between sessions leaves the continuation exact (or is checked by itself).
HARMLESS_KEYS = {
    "logging_steps", "eval_steps", "save_steps", "save_every_seconds", "save_total_limit",
    "save_only_model", "resume_from_checkpoint", "time_limit", "deadline", "mirror_to", "output_dir",
    "max_bad_steps", "on_repeated_nan", "report_to", "run_name", "load_best_model_at_end",
    "per_device_train_batch_size", "gradient_accumulation_steps", "eval_dataset",
    "global_batch_size",  # checked by itself, with the global batch, in check_compatible
    "dataset_cache", "max_bad_fraction",  # the data fingerprint still guards the rows themselves
    # Same maths, other kernels: equal within rounding, never bit for bit on a GPU anyway; on the
    # CPU both default to off, so a run that never sets them stays byte-identical across resumes.
    "torch_compile", "attention", "cuda_graphs", "compile_checkpoint", "liger_kernels",
    # Where the frozen input embedding lives; a lookup copies the same values either way.
    "offload_embeddings",
    # Where the checkpointed layer inputs wait for backward (GPU or pinned CPU memory), not what they hold.
    "offload_activations",
    # The global batch does not depend on the process count; a crash-restart budget is not maths.
    "num_gpus", "max_restarts",
    # Sharding changes where the frozen weights live, not the LoRA maths or the checkpoint's files;
    # the 4-bit storage dtype changes how the same packed values are held.
    "fsdp", "bnb_4bit_quant_storage",
}


def kaggle_input_root() -> Path:
    """The folder searched for earlier sessions' runs (RELAYTUNE_KAGGLE_INPUT overrides, for tests)."""
    return Path(os.environ.get("RELAYTUNE_KAGGLE_INPUT") or KAGGLE_INPUT)


@dataclass
class Source:
    """A checkpoint of another run folder this run may continue from."""

    run: Path
    checkpoint: Path
    step: int
    config: dict
    fingerprint: str


@dataclass
class Relay:
    """The other runs a new run may continue (newest step first), until the data decides."""

    sources: list[Source] = field(default_factory=list)
    where: str = ""  # for messages: "under /kaggle/input" or "in resume_from_checkpoint"
    rejected: list[str] = field(default_factory=list)  # why other runs did not match
    explicit: bool = False  # named by resume_from_checkpoint: a mismatch is an error, not a fresh start

    def caches(self) -> list[Path]:
        """The sources' tokenization caches, read (never written) on a cache miss here."""
        return [RunDir(s.run).data_cache for s in self.sources]

    def pick(self, fingerprint: str) -> Path | None:
        """The newest source trained on the same data (content fingerprint), or None: start fresh."""
        reasons = list(self.rejected)
        for s in self.sources:
            if s.fingerprint == fingerprint or self.explicit:  # explicit: check_compatible says what differs
                info(f"continuing from {s.checkpoint} (step {s.step}), the run found {self.where}; "
                     "this run's checkpoints go to its own output_dir, the source is only read")
                return s.checkpoint
            reasons.append(f"{s.run}: the training data differs (its content fingerprint)")
        for why in reasons:
            notice(f"not continued: {why}")
        notice(f"no run {self.where} matches this one's config and data; starting from the beginning")
        return None


def choose_checkpoint(cfg: TrainConfig, store: CheckpointStore, fresh: bool) -> Path | Relay | None:
    """The checkpoint to continue from, a Relay to decide once the data is known, or None (fresh)."""
    setting = cfg.resume_from_checkpoint
    if isinstance(setting, str) and setting.lower() in ("true", "false", "auto"):
        setting = {"true": "auto", "false": False, "auto": "auto"}[setting.lower()]
    if setting is True:
        setting = "auto"
    existing = store.step_dirs()
    if fresh:
        if existing:
            raise UserError(
                f"{store.root} already holds {len(existing)} checkpoint(s); a fresh start would "
                "mix two runs. Choose a new output_dir, or move the old run away yourself "
                "(relaytune never deletes a run).")
        return None
    if setting is False:
        if existing:
            raise UserError(
                f"`resume_from_checkpoint`: it is false, but {store.root} already holds a run. "
                "Set it to auto to continue, or choose a new output_dir.")
        return None
    if setting != "auto":
        return _explicit(cfg, Path(str(setting)).expanduser(), store)
    own = _own_latest(store)
    if own is None and not existing and _kaggle_relay_applies(store):
        return find_relay(cfg, kaggle_input_root())
    return own


def _own_latest(store: CheckpointStore) -> Path | None:
    _, path, skipped = store.latest_valid()
    for why in skipped:
        warn(f"skipped checkpoint {why}")
    if path is not None:
        info(f"continuing from {path.name}" + (" (the newest valid one)" if skipped else ""))
    elif skipped:
        warn("no valid checkpoint; starting from the beginning")
    return path


def _kaggle_relay_applies(store: CheckpointStore) -> bool:
    # Lazily, and torch-free: the platform is the one thing checkpoint/ asks of training/.
    from relaytune.platforms import platform

    return platform() == "kaggle" and not RunDir(store.root.parent).looks_like_a_run()


def _explicit(cfg: TrainConfig, path: Path, store: CheckpointStore) -> Path | Relay:
    """`resume_from_checkpoint: PATH`: a checkpoint folder, or a run folder (its newest valid one)."""
    path = path.resolve() if path.exists() else path
    own_root = store.root.parent.resolve() if store.root.parent.exists() else store.root.parent
    if path == own_root:  # this run's own folder: the ordinary resume
        return _own_latest(store)
    if not (path / MANIFEST).is_file() and is_run_folder(path):
        source, skipped = newest_source(path)
        for why in skipped:
            warn(f"skipped {why}")
        if source is None:
            raise UserError(f"`resume_from_checkpoint`: the run folder {path} holds no valid checkpoint to "
                            "continue from" + (f" ({'; '.join(skipped)})" if skipped else "") +
                            (" (final/ holds only the adapter, not the optimizer state)"
                             if (path / "final" / MANIFEST).is_file() else ""))
        return _unless_own_is_newer(store, Relay([source], where=f"in resume_from_checkpoint ({path})",
                                                 explicit=True))
    reason = verify(path)
    if reason:
        kind = _manifest_kind(path)
        if kind in ("final", "best"):
            reason = (f"{kind}/ holds the finished adapter only (no optimizer state or data position); "
                      f"name the run folder {path.parent} to continue from its newest checkpoint")
        raise UserError(f"`resume_from_checkpoint`: {path} is not a usable checkpoint: {reason}")
    if _manifest_kind(path) in ("final", "best"):
        raise UserError(f"`resume_from_checkpoint`: {path} is a finished adapter ({path.name}/), not a "
                        f"checkpoint; name the run folder {path.parent} to continue from its newest checkpoint")
    run = path.parent.parent if path.parent.name == "checkpoints" else None
    state = _read_state(path)
    if run is not None and state is not None and run != own_root:  # another run's checkpoint: read its cache too
        m = STEP_DIR.match(path.name)
        return _unless_own_is_newer(store, Relay(
            [Source(run, path, int(m.group(1)) if m else 0, state["config"], state["data_fingerprint"])],
            where=f"in resume_from_checkpoint ({run})", explicit=True))
    info(f"continuing from {path} (as configured)")
    return path


def _unless_own_is_newer(store: CheckpointStore, relay: Relay) -> Path | Relay:
    """A later session of a relayed run continues its own checkpoints, not the source again."""
    own_step, own, _ = store.latest_valid()
    source = relay.sources[0]
    if own is not None and own_step >= source.step:
        info(f"continuing from {own.name} (this run's own, newer than {source.checkpoint})")
        return own
    return relay


def _manifest_kind(path: Path) -> str | None:
    try:
        return read_manifest(path).get("kind")
    except (OSError, ValueError):
        return None


def is_run_folder(path: Path) -> bool:
    """A relaytune run folder: checkpoints/ with step-N folders, or a committed final/."""
    ck = path / "checkpoints"
    try:
        if ck.is_dir() and any(STEP_DIR.match(p.name) for p in ck.iterdir()):
            return True
    except OSError:
        return False
    return (path / "final" / MANIFEST).is_file()


def newest_source(run: Path) -> tuple[Source | None, list[str]]:
    """The newest intact checkpoint of another run folder (read only), and why newer ones were skipped."""
    skipped: list[str] = []
    for step, path in reversed(CheckpointStore(run / "checkpoints").step_dirs()):
        reason = verify_checkpoint(path)
        state = _read_state(path) if reason is None else None
        if state is None:
            skipped.append(f"{path}: {reason or 'unreadable trainer_state.json'}")
            continue
        return Source(run, path, step, state["config"], state["data_fingerprint"]), skipped
    return None, skipped


def _read_state(path: Path) -> dict | None:
    try:
        state = json.loads((path / TRAINER_STATE).read_text())
        return state if isinstance(state.get("config"), dict) and "data_fingerprint" in state else None
    except (OSError, ValueError, AttributeError):
        return None


def find_relay(cfg: TrainConfig, root: Path) -> Relay | None:
    """Kaggle: the runs under `root` (an earlier session's output) whose config allows continuing."""
    runs = _run_folders(root)
    if not runs:
        return None
    relay = Relay(where=f"under {root}")
    for run in runs:
        source, skipped = newest_source(run)
        if source is None:
            relay.rejected.append(f"{run}: no valid checkpoint" + (f" ({'; '.join(skipped)})" if skipped else "")
                                  + (" (a finished run; its checkpoints were removed)"
                                     if (run / "final" / MANIFEST).is_file() else ""))
            continue
        breaking, _ = config_changes(source.config, cfg)
        if breaking:
            relay.rejected.append(f"{source.checkpoint}: the config differs: {'; '.join(breaking)}")
            continue
        relay.sources.append(source)
    relay.sources.sort(key=lambda s: -s.step)
    if relay.sources:
        info(f"this output_dir is empty; found {len(relay.sources)} earlier run(s) {relay.where} with the "
             "same config (the data is checked next)")
        return relay
    for why in relay.rejected:
        notice(f"not continued: {why}")
    notice(f"no run under {root} matches this one; starting from the beginning")
    return None


def _run_folders(root: Path) -> list[Path]:
    found: list[Path] = []

    def walk(folder: Path, depth: int) -> None:
        try:
            children = sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
        except OSError:
            return
        for child in children:
            if is_run_folder(child):
                found.append(child)
            elif depth > 1:
                walk(child, depth - 1)

    if root.is_dir():
        walk(root, SEARCH_DEPTH)
    return found


def config_changes(saved: dict, cfg: TrainConfig, extending: bool = False) -> tuple[list[str], list[str]]:
    """(breaking, harmless) differences between a saved config and this one, each in words.

    `extending`: continuing another, finished run's state with a new schedule, where
    max_steps / num_train_epochs may change (see check_compatible)."""
    current = cfg.model_dump(mode="json")
    saved = saved_config_view(saved, current)  # relative paths saved by older runs name the same places
    changed = sorted(k for k in current if k in saved and saved[k] != current[k])
    allowed = HARMLESS_KEYS | (set(SCHEDULE_KEYS) if extending else set())
    breaking = [f"`{k}`: {redact_url(repr(saved[k]))} -> {redact_url(repr(current[k]))}"
                for k in changed if k not in allowed]
    old_batch = saved.get("global_batch_size") or \
        saved["per_device_train_batch_size"] * saved["gradient_accumulation_steps"]
    if old_batch != cfg.global_batch_size:
        breaking.append("global batch (per_device_train_batch_size x gradient_accumulation_steps: "
                        f"{old_batch} -> {cfg.global_batch_size})")
    harmless = [f"{k} {redact_url(repr(saved[k]))} -> {redact_url(repr(current[k]))}"
                for k in changed if k in allowed]
    return breaking, harmless


def _extending(cfg: TrainConfig) -> bool:
    """Continuing another run's checkpoint named by resume_from_checkpoint (not this run's own)."""
    setting = cfg.resume_from_checkpoint
    if not isinstance(setting, str) or setting.lower() in ("true", "false", "auto"):
        return False
    path = Path(setting).expanduser().resolve()
    own = Path(cfg.output_dir).expanduser().resolve()
    return path != own and own not in path.parents


def check_compatible(saved: dict, cfg: TrainConfig, fingerprint: str, saved_fingerprint: str) -> None:
    """Refuse changes that would break exact continuation; note harmless ones."""
    extending = _extending(cfg)
    breaking, harmless = config_changes(saved, cfg, extending)
    if breaking:
        raise UserError(
            f"the config changed since the checkpoint in a way that breaks exact continuation: "
            f"{'; '.join(breaking)}. Restore the old value(s), or start a new run in another output_dir.")
    if fingerprint != saved_fingerprint:
        raise UserError(
            "the training data changed since the checkpoint (its content fingerprint differs), so "
            "continuing would not be the same run. Restore the data, or start a new run in another output_dir.")
    schedule = [h for h in harmless if h.split(" ", 1)[0] in SCHEDULE_KEYS]
    if schedule:
        notice("continuing another run's state with a new schedule (" + ", ".join(schedule) + "): the "
               "learning-rate schedule and the number of steps follow this config from here on, so the "
               "result is not what one uninterrupted run would give (exactness to a single run no longer applies)")
    others = [h for h in harmless if h not in schedule]
    if others:
        notice("changed since the checkpoint, which is fine: " + ", ".join(others))
