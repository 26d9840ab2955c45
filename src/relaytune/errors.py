"""The exceptions that carry the contract's exit codes: the CLI exits with `exc.exit_code`.

0 finished or already finished; 75 stopped early on purpose with a checkpoint committed;
2 bad configuration or data; 1 training cannot go on as configured.
"""

from __future__ import annotations

from enum import StrEnum


class UserError(Exception):
    """Bad configuration or data: the message says what and where. Exit code 2."""

    exit_code = 2


class StopReason(StrEnum):
    """How a session that stopped early ended; the value is written to sessions.jsonl."""

    SIGNAL = "signal"  # SIGTERM/SIGINT/SIGUSR1, e.g. a preemption notice
    TIME_LIMIT = "time_limit"  # time_limit or stop_at reached
    OOM = "oom"  # out of memory at the smallest micro-batch, after a checkpoint
    DISK = "disk"  # checkpoints could not be written, repeatedly


class StoppedEarly(Exception):
    """Stopped on purpose (signal, time limit, unrecoverable OOM, no room for checkpoints) with
    the newest checkpoint kept; running the same command again continues. Exit code 75."""

    exit_code = 75

    def __init__(self, message: str, step: int | None, checkpoint: str | None, how: StopReason | str):
        super().__init__(message)
        self.how = StopReason(how)
        self.step = step
        self.checkpoint = checkpoint


class TrainingDiverged(Exception):
    """Training cannot go on as configured (repeated NaNs with on_repeated_nan: stop, or an
    OOM at micro-batch 1 with no checkpoint written), or a full disk took the session's work with no
    checkpoint committed. The message is the diagnosis. Exit code 1."""

    exit_code = 1
