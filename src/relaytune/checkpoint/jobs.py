"""A one-slot background job runner: the checkpoint writer thread."""

from __future__ import annotations

import threading
from collections.abc import Callable

from relaytune.log import warn


class BackgroundJob:
    """Runs one job at a time in a daemon thread; a new job first waits for the previous one.

    An exception in the job is kept and raised in the caller's thread at the next `wait()`.
    """

    def __init__(self):
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def submit(self, job: Callable[[], object]) -> None:
        self.wait()
        self._thread = threading.Thread(target=self._run, args=(job,), daemon=True)
        self._thread.start()

    def _run(self, job: Callable[[], object]) -> None:
        try:
            job()
        except BaseException as e:  # reported to the main thread at the next wait()
            self._error = e

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def wait_quietly(self) -> None:
        """On the way out after another error: finish the write, drop its error."""
        try:
            self.wait()
        except BaseException as e:  # the original exception matters more
            warn(f"a background checkpoint write failed: {e}")
