"""Stopping on purpose: a signal, or the time limit. Each hooks into the loop at one point.

- `StopRequest`: SIGTERM/SIGINT/SIGUSR1/SIGHUP only set a flag; the loop checks
  it after each optimizer step, saves and exits 75. A second signal within a few
  seconds abandons the step in progress (exit 75, nothing saved). With several processes
  (ranks) a step cannot be abandoned by one rank alone (the others would wait in a collective),
  so there every signal stops after the step, with a checkpoint, on every rank together; but once
  another worker has died nothing can be saved, and a signal ends the process at once.
- `Deadline`: from `time_limit` (or the environment), says when there is no
  longer time for one more step plus a save, using measured durations.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from dataclasses import dataclass

from relaytune.distributed.launch import peer_lost
from relaytune.errors import StoppedEarly
from relaytune.log import warn, warn_unbuffered

PEER_LOST_EXIT = 1  # a crash, as the dead peer's: the agent restarts the workers either way
STOP_SIGNALS = tuple(getattr(signal, n) for n in ("SIGTERM", "SIGINT", "SIGUSR1", "SIGHUP") if hasattr(signal, n))


class Abandoned(BaseException):
    """A second signal soon after the first: the step in progress is abandoned, nothing is saved.
    A BaseException so that no `except Exception` inside a step can swallow it."""


class StoppedBeforeTraining(BaseException):
    """A stop signal during the set-up, before any handler of the run's own is in place: nothing of the
    run has changed yet, so the set-up is left at once. A BaseException, so that no library's `except
    Exception` while the model loads can swallow it."""

    def __init__(self, signal_name: str):
        super().__init__(signal_name)
        self.signal_name = signal_name


class StopRequest:
    """Flag-setting signal handlers, from `install()` (or `with`) until `uninstall()`.

    The recipe keeps them installed until train() returns, so a second signal after the stop
    checkpoint is committed cannot kill the process with another exit code: every way out is 75.

    First signal: the loop stops after the current step, with a checkpoint (the message says
    roughly when, from `eta`, a callable the trainer sets). A second one within ABANDON_WINDOW
    seconds, while a step runs (not while the stop checkpoint is written), abandons the step at
    its next safe point (`check()`, called before each forward): exit 75 at once, no save.
    """

    ABANDON_WINDOW = 5.0

    def __init__(self):
        self.signal_name: str | None = None
        self.at: float | None = None
        self.abandon = False  # a second signal came soon enough: leave the step at the next safe point
        self.saving = False  # the stop checkpoint is being written: a second signal waits for it
        self.committed = False  # the stop checkpoint is committed: nothing but exit 75 is left
        self.eta = None  # () -> seconds until the stop, or None
        self.last_checkpoint = None  # () -> name of the newest committed checkpoint, or None
        self.finish_writes = None  # () -> None: waits for a checkpoint being committed in the background
        # One of several ranks (RANK/WORLD_SIZE set): no abandoning; the launcher also forwards the
        # signal the process group already got, so a repeat within a second is the same request.
        self.several = "RANK" in os.environ and int(os.environ.get("WORLD_SIZE") or 1) > 1
        self._previous: dict = {}

    @classmethod
    def adopt(cls) -> StopRequest:
        """The request whose handlers are installed already (a worker installs them before its
        set-up, so that an early signal is kept), or a new one."""
        return _installed if _installed is not None else cls()

    def install(self) -> StopRequest:
        global _installed
        take_over_from_setup()
        if threading.current_thread() is threading.main_thread() and not self._previous:
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
            _installed = self
        return self

    def uninstall(self) -> None:
        """Hand the signals back; but where the process exits right after (`exit_follows`) and the
        stop checkpoint is committed, leave them ignored, so that a late signal on the way out
        cannot turn exit 75 into 130 or 143."""
        global _installed
        ignore = self.committed and _exit_follows
        for sig, handler in self._previous.items():
            signal.signal(sig, signal.SIG_IGN if ignore else handler)
        if self._previous and _installed is self:
            _installed = None
        self._previous = {}

    def __enter__(self) -> StopRequest:
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        now = time.monotonic()
        if self.several and peer_lost():
            # No rank can save or finish a step without the dead one. A checkpoint already being
            # committed in the background may finish (the agent's SIGKILL bounds the wait); then the
            # launcher restarts every worker from the last committed checkpoint.
            warn_unbuffered(f"{name} received after another worker died: exiting now, the launcher restarts "
                            "the workers from the last committed checkpoint")
            try:
                if self.finish_writes is not None:
                    self.finish_writes()
            finally:
                os._exit(PEER_LOST_EXIT)
        if self.signal_name is None:
            self.signal_name, self.at = name, now
            _say(f"{name} received: stopping after this step{self._when()}, with a checkpoint"
                 + ("" if self.several else f"; send it again within {self.ABANDON_WINDOW:.0f} s to stop at "
                                            "once without saving"))
        elif self.several:
            if now - self.at > 1.0:
                _say(f"{name} received again: with several processes every rank stops after this step, "
                     "with a checkpoint")
        elif self.committed:
            _say(f"{name} received again: the stop checkpoint is already committed; exiting")
        elif self.saving:
            _say(f"{name} received again: the stop checkpoint is being written; exiting as soon as it is committed")
        elif now - self.at <= self.ABANDON_WINDOW:
            if not self.abandon:
                self.abandon = True
                _say(f"{name} received again: abandoning the step in progress")
        else:
            _say(f"{name} received again: still stopping after this step{self._when()}")

    def _when(self) -> str:
        try:
            eta = self.eta() if self.eta else None
        except Exception:
            eta = None
        return "" if eta is None else f" (in about {eta:.0f} s, from the measured step time)"

    def check(self, *_args) -> None:
        """A safe point inside a step (a forward pre-hook): leave it if a second signal asked to."""
        if self.abandon and not self.saving:
            raise Abandoned()

    @property
    def requested(self) -> bool:
        return self.signal_name is not None


_installed: StopRequest | None = None  # the request whose handlers are in place
_exit_follows = False  # inside `exit_follows()`: the process ends as soon as train() returns


@contextlib.contextmanager
def exit_follows():
    """Around the CLI's train(), whose process exits when it returns: a committed stop then keeps
    ignoring the stop signals after `uninstall` (the Python API gets its handlers back)."""
    global _exit_follows
    _exit_follows = True
    try:
        yield
    finally:
        _exit_follows = False


_setup_guarded = False  # inside `leave_setup_at_once()`, before the run's own handlers took over


@contextlib.contextmanager
def leave_setup_at_once():
    """Around the CLI's train(): until the run's own handlers take over (the loop's StopRequest, or the
    launcher's forwarding to its workers), a stop signal leaves the set-up at once, as StoppedEarly
    (exit 75): loading a large model can outlast a preemption's grace period, and nothing is lost.
    Once they took over, a signal reaching this handler again (train() is returning) is ignored: the
    process exits next with train()'s own outcome."""
    global _setup_guarded

    def leave(signum, frame):
        global _setup_guarded
        if _setup_guarded:
            _setup_guarded = False  # a second signal while the set-up unwinds must not interrupt its clean-up
            raise StoppedBeforeTraining(signal.Signals(signum).name)

    _setup_guarded = True
    previous = {sig: signal.signal(sig, leave) for sig in STOP_SIGNALS}
    stopped = False
    try:
        yield
    except StoppedBeforeTraining as e:
        stopped = True
        raise StoppedEarly(f"{e.signal_name} received before training began: the run is as it was",
                           None, None, how="signal") from None
    finally:
        _setup_guarded = False
        for sig, handler in previous.items():
            if signal.getsignal(sig) is leave:  # not where a committed stop left the signal ignored
                # Stopped: the process exits next, and a late signal must not turn exit 75 into 143.
                signal.signal(sig, signal.SIG_IGN if stopped else handler)


def take_over_from_setup() -> None:
    """The run's own signal handling begins: `leave_setup_at_once` no longer leaves anything."""
    global _setup_guarded
    _setup_guarded = False


def _say(message: str) -> None:
    try:
        warn(message)
    except RuntimeError:
        # The signal landed inside a write to stderr (the progress bar's, say), and the buffered stream
        # refuses a reentrant write: the message goes to the file descriptor itself, never a crash.
        warn_unbuffered(message)


@dataclass(frozen=True)
class Deadline:
    """The wall-clock time by which the run must have saved and exited, and why; stops early
    enough that the final save lands before it."""

    end: float | None  # Unix time, or None for no limit
    source: str

    SAFETY = 1.25  # measured times vary; keep a quarter in reserve

    def describe(self) -> str:
        if self.end is None:
            return "no time limit"
        left = self.end - time.time()
        return (f"{left / 3600:.2f} h left ({self.source}; ends "
                f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(self.end))})")

    def remaining(self) -> float | None:
        return None if self.end is None else self.end - time.time()

    def must_stop(self, step_seconds: float, save_seconds: float) -> bool:
        left = self.remaining()
        return left is not None and left < self.SAFETY * (step_seconds + save_seconds) + 1.0


def safe_points(model) -> list:
    """Where a step may be abandoned: before the forward of the model and of each of its decoder
    layers (the elements of its longest ModuleList when it has no decoder), so a long step is left
    within one layer's time."""
    import torch

    from relaytune.layers import decoder_layers

    layers = decoder_layers(model)
    if not layers:
        lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
        layers = list(max(lists, key=len)) if lists else []
    return [model, *layers]
