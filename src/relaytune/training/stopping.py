"""Stopping on purpose with exit 75: after a signal or at the deadline (save, then stop; with several
ranks, once they agree), after an OOM at micro-batch 1, or abandoning a step on a second signal.
The trainer's way out."""

from __future__ import annotations

import time

from relaytune.distributed import agree
from relaytune.errors import StoppedEarly, TrainingDiverged
from relaytune.log import info
from relaytune.training.recovery import oom_advice
from relaytune.training.stops import StopRequest


def stop_after_oom(trainer) -> None:
    advice = oom_advice(trainer.cfg)
    step = trainer.state.step
    path = trainer.world.decide(lambda: trainer.checkpointer.save(trainer.snapshot, step, wait=True))
    if path is None:
        raise TrainingDiverged(advice)
    raise StoppedEarly(f"{advice}\nCheckpoint {path.name} is committed", trainer.state.step, str(path), how="oom")


def agreed_stop(trainer, stop: StopRequest) -> None:
    """Several ranks: one tiny all-reduce of every rank's reasons to stop (a signal, the deadline,
    checkpoints failing on rank 0); any reason stops them all here, together."""
    flags = agree.stop_flags(
        trainer.world, stop.requested,
        trainer.deadline.must_stop(trainer.step_seconds, trainer.checkpointer.save_seconds),
        trainer.world.is_main and trainer.checkpointer.failing())
    if flags.disk:
        trainer.checkpointer.raise_if_failing(trainer.state.step, force=True)
    if flags.any:
        trainer.stop_and_save(stop, signal=flags.signal)


def stop_and_save(trainer, stop: StopRequest, signal: bool | None = None) -> None:
    """Save and stop (exit 75). Several ranks: every rank arrives here at the same step (agreed),
    rank 0 commits the one checkpoint and every rank learns its path."""
    signal = bool(stop.signal_name) if signal is None else signal
    why = (stop.signal_name or "a signal on another rank") if signal else f"time limit ({trainer.deadline.source})"
    how = "signal" if signal else "time_limit"
    began = stop.at or time.monotonic()
    step = trainer.state.step
    stop.saving = True
    if trainer.unsafe_to_save():
        trainer.checkpointer.flush()
        last = trainer.checkpointer.rollback_point()
        intact = f"the run is intact at {last.name}" if last else "no checkpoint is committed"
        raise StoppedEarly(f"stopped by {why} at step {step} without a new checkpoint (the state is not "
                           f"finite); {intact}",
                           step, str(last) if last else None, how=how)
    # `since`: the cost of a stop is measured from the request (the signal), not from the save.
    path = trainer.world.decide(lambda: trainer.checkpointer.save(trainer.snapshot, step, since=began, wait=True))
    stop.committed = path is not None
    if path is None:
        raise StoppedEarly(f"stopped by {why} at step {step}, but the checkpoint could not be written",
                           step, None, how=how)
    info(f"stopped by {why}: checkpoint {path.name} committed {time.monotonic() - began:.1f}s after "
         "the request; run the same command to continue")
    raise StoppedEarly(f"stopped by {why} at step {step}", step, str(path), how=how)


def abandon_step(trainer, stop: StopRequest) -> None:
    """A second signal during a step: leave it unsaved; the newest committed checkpoint stands."""
    trainer.live.optimizer.zero_grad(set_to_none=True)
    trainer.checkpointer.flush()  # a background save already under way is let finish: it is a whole step
    last = trainer.checkpointer.rollback_point()
    stop.committed = True
    where = f"the last committed checkpoint, {last.name}, is intact" if last else "no checkpoint is committed yet"
    info(f"stopped by a second {stop.signal_name} during step {trainer.state.step + 1}: that step is abandoned "
         f"unsaved; {where}; run the same command to continue")
    raise StoppedEarly(f"stopped by {stop.signal_name} during step {trainer.state.step + 1} (abandoned); {where}",
                       trainer.state.step, str(last) if last else None, how="signal")
