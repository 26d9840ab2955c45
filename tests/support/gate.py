"""A run held at a known step (RELAYTUNE_PAUSE_AT), so that a test signals or kills it there
however late a loaded machine lets the test notice: the run waits for the test, not the other
way round. Every process of the run, and every restart of it, pauses after that step until the
gate is opened."""

from __future__ import annotations

import os
import time
from pathlib import Path


class Gate:
    def __init__(self, folder: Path, step: int):
        self.step, self.path = step, Path(folder) / f"gate-after-step-{step}"
        self.reached_file = Path(f"{self.path}.reached")

    @property
    def env(self) -> dict[str, str]:
        return {"RELAYTUNE_PAUSE_AT": f"{self.step}:{self.path}"}

    def wait_reached(self, pid: int, timeout: float = 180) -> None:
        """Until a process of the run (`pid`, or one under it) is held after the step."""
        wait_for(self.reached_file.exists, pid, timeout, f"step {self.step}'s pause")

    def open(self) -> None:
        self.path.touch()


def wait_for(cond, pid: int, timeout: float = 180, what: str = "the condition") -> None:
    """Poll `cond` while process `pid` lives; a process that ended first fails the test at once."""
    end = time.monotonic() + timeout
    while not cond():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            if cond():  # it came true as the process ended
                return
            raise AssertionError(f"process {pid} ended before {what}") from None
        assert time.monotonic() < end, f"timed out after {timeout:.0f} s waiting for {what}"
        time.sleep(0.01)


def stderr_says(run, text: str):
    """A condition: the forked run's stderr holds `text` (the fork server writes it to a file)."""
    return lambda: text in run.files[1].read_text(encoding="utf-8", errors="replace")
