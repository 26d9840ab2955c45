"""Rolling back after repeated non-finite steps: to the newest committed state, further back if that
state fails again, or a stop with a diagnosis. The trainer's part of recovery from NaN."""

from __future__ import annotations

from relaytune.checkpoint.load import Damaged, Loaded
from relaytune.errors import TrainingDiverged
from relaytune.log import warn
from relaytune.observe.metrics import parse_records
from relaytune.training.recovery import lower_learning_rate

MAX_ROLLBACKS = 5  # rollbacks in one session before the run stops with a diagnosis


def roll_back(trainer) -> None:
    """Repeated non-finite steps: return to the last committed state, then lower the LR or stop."""
    cfg, bad_at, before = trainer.cfg, trainer.state.step, trainer.recovery
    skipped = trainer.state.skipped_steps
    if trainer.world.distributed:  # every rank must see the same committed checkpoints: none in flight
        if trainer.world.is_main:
            trainer.checkpointer.flush()
        trainer.world.barrier()
    streak_began = bad_at - before.consecutive_bad_steps + 1
    # A rollback whose state fails again before getting past the failure that led to it: that
    # state is no good, so step back further (an older checkpoint, then the start), or stop.
    bound = trainer.rollbacks[-1][0] if trainer.rollbacks and streak_began <= trainer.rollbacks[-1][1] else None
    if len(trainer.rollbacks) >= MAX_ROLLBACKS:
        _diverged(trainer, bad_at, f"after {len(trainer.rollbacks)} rollbacks in this session")
    loaded = _rollback_target(trainer, bound)
    if loaded is None:
        _diverged(trainer, bad_at, "after rolling back to every earlier state" if trainer.rollbacks else
                       "and there is no earlier state to return to")
    trainer._restore(loaded)
    trainer.rollbacks.append((trainer.state.step, bad_at))
    # Step records after the rollback point are redone; the events that led here are kept.
    events = [r for r in parse_records(trainer.metrics.text()) if "event" in r and r["step"] > trainer.state.step]
    trainer.metrics.reset_to(loaded.metrics)
    for record in events:
        trainer.metrics.write(record)
    trainer.state.skipped_steps = skipped
    where = loaded.where
    if cfg.on_repeated_nan == "stop":
        trainer.metrics.write({"step": trainer.state.step, "event": "nan_stop", "bad_steps_until": bad_at})
        raise TrainingDiverged(
            f"{cfg.max_bad_steps} steps in a row had a non-finite loss or gradient (up to step {bad_at}). "
            f"The run is intact at {where}. Likely causes: a learning rate too high "
            f"(now {cfg.learning_rate}), fp16 overflow (use bf16 where the GPU has it), or bad data rows.")
    new_scale = before.lr_scale * cfg.nan_lr_factor  # the restored schedule carries its own, older scale
    lower_learning_rate(trainer.live.scheduler, trainer.live.optimizer, new_scale / trainer.recovery.lr_scale)
    trainer.recovery.lr_scale = new_scale
    trainer.recovery.micro_batch_size, trainer.recovery.accumulation = before.micro_batch_size, before.accumulation
    trainer.metrics.write({"step": trainer.state.step, "event": "nan_rollback", "bad_steps_until": bad_at,
                        "lr_scale": new_scale})
    warn(f"{cfg.max_bad_steps} non-finite steps in a row (up to step {bad_at}): rolled back to {where} "
         f"and continue with the learning rate x{new_scale:g}")


def _rollback_target(trainer, before: int | None) -> Loaded | None:
    """The newest valid checkpoint (older than step `before`, if given), read and checked; a
    damaged one is set aside and the one before it taken; then the start of this session's
    run, if it began fresh; None when nothing is left."""
    path = trainer.checkpointer.rollback_point(before)
    while path is not None:
        try:
            loaded = trainer.checkpointer.load(path)  # (set aside and fall back inside, if damaged)
            if loaded is not None and (before is None or loaded.state["progress_step"] < before):
                from relaytune.checkpoint.load import check_fits

                check_fits(loaded, trainer.live)
                return loaded
            path = trainer.checkpointer.rollback_point(before)
        except Damaged as e:
            path = trainer.checkpointer.give_up_on(path, str(e), before=before)
    if trainer.initial_state is not None and (before is None or before > 0):
        from relaytune.checkpoint.load import load

        return load(trainer.initial_state, where="the start")
    return None


def _diverged(trainer, bad_at: int, how: str) -> None:
    path = trainer.checkpointer.rollback_point()
    trainer.metrics.write({"step": trainer.state.step, "event": "nan_stop", "bad_steps_until": bad_at,
                        "rollbacks": len(trainer.rollbacks)})
    raise TrainingDiverged(
        f"{trainer.cfg.max_bad_steps} steps in a row had a non-finite loss or gradient (up to step {bad_at}) "
        f"{how}; training cannot go on as configured, and re-running will stop the same way. "
        f"{'The checkpoints (newest ' + path.name + ') are kept' if path else 'No checkpoint is committed'}. "
        "Likely causes: "
        f"a learning rate too high (now {trainer.cfg.learning_rate}), fp16 overflow (use bf16 where the GPU "
        "has it), or bad data rows.")
