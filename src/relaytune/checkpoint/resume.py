"""Which checkpoint a run continues from, and whether the config still allows it."""

from __future__ import annotations

from pathlib import Path

from relaytune.atomic import verify
from relaytune.checkpoint.store import CheckpointStore
from relaytune.config import HARMLESS_KEYS, TrainConfig, saved_config_view
from relaytune.errors import UserError
from relaytune.log import info, notice, warn
from relaytune.redact import redact_url


def choose_checkpoint(cfg: TrainConfig, store: CheckpointStore, fresh: bool) -> Path | None:
    """The checkpoint to continue from, or None for a fresh start."""
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
                f"`resume_from_checkpoint` is false, but {store.root} already holds a run. "
                "Set it to auto to continue, or choose a new output_dir.")
        return None
    if setting != "auto":
        path = Path(str(setting)).expanduser()
        reason = verify(path)
        if reason:
            raise UserError(f"`resume_from_checkpoint`: {path} is not a usable checkpoint: {reason}")
        info(f"continuing from {path} (as configured)")
        return path
    _, path, skipped = store.latest_valid()
    for why in skipped:
        warn(f"skipped checkpoint {why}")
    if path is not None:
        info(f"continuing from {path.name}" + (" (the newest valid one)" if skipped else ""))
    elif skipped:
        warn("no valid checkpoint; starting from the beginning")
    return path


def check_compatible(saved: dict, cfg: TrainConfig, fingerprint: str, saved_fingerprint: str) -> None:
    """Refuse changes that would break exact continuation; note harmless ones."""
    current = cfg.model_dump(mode="json")
    saved = saved_config_view(saved, current)  # relative paths saved by older runs name the same places
    changed = sorted(k for k in current if k in saved and saved[k] != current[k])
    breaking = [k for k in changed if k not in HARMLESS_KEYS]
    old_batch = saved["per_device_train_batch_size"] * saved["gradient_accumulation_steps"]
    if old_batch != cfg.global_batch_size:
        breaking.append("global batch (per_device_train_batch_size x gradient_accumulation_steps: "
                        f"{old_batch} -> {cfg.global_batch_size})")
    if breaking:
        details = "; ".join(
            f"`{k}`: {redact_url(repr(saved[k]))} -> {redact_url(repr(current[k]))}" if k in current else k
            for k in breaking)
        raise UserError(
            f"the config changed since the checkpoint in a way that breaks exact continuation: "
            f"{details}. Restore the old value(s), or start a new run in another output_dir.")
    if fingerprint != saved_fingerprint:
        raise UserError(
            "the training data changed since the checkpoint (its content fingerprint differs), so "
            "continuing would not be the same run. Restore the data, or start a new run in another output_dir.")
    harmless = [k for k in changed if k in HARMLESS_KEYS]
    if harmless:
        notice("changed since the checkpoint, which is fine: " +
               ", ".join(f"{k} {redact_url(repr(saved[k]))} -> {redact_url(repr(current[k]))}" for k in harmless))
