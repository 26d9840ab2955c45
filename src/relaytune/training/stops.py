"""Stopping on purpose: a signal, or the time limit. Each hooks into the loop at one point.

- `StopRequest`: SIGTERM/SIGINT/SIGUSR1/SIGHUP only set a flag; the loop checks
  it after each optimizer step, saves and exits 75.
- `Deadline`: from `time_limit` (or the environment), says when there is no
  longer time for one more step plus a save, using measured durations.
"""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass

from relaytune.log import warn

STOP_SIGNALS = tuple(getattr(signal, n) for n in ("SIGTERM", "SIGINT", "SIGUSR1", "SIGHUP") if hasattr(signal, n))


class StopRequest:
    """Installs flag-setting signal handlers for the duration of a `with` block."""

    def __init__(self):
        self.signal_name: str | None = None
        self.at: float | None = None
        self._previous: dict = {}

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        if self.signal_name is None:
            self.signal_name = signal.Signals(signum).name
            self.at = time.monotonic()
            warn(f"{self.signal_name} received: stopping after this step, with a checkpoint")

    @property
    def requested(self) -> bool:
        return self.signal_name is not None


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
