"""The exceptions that map to the contract's exit codes."""


class UserError(Exception):
    """Bad configuration or data: the message says what and where. Exit code 2."""

    exit_code = 2


class StoppedEarly(Exception):
    """Stopped on purpose (signal, time limit, unrecoverable OOM) with a checkpoint
    committed; running the same command again continues. Exit code 75."""

    exit_code = 75

    def __init__(self, message: str, step: int, checkpoint: str | None, how: str = "stopped"):
        super().__init__(message)
        self.how = how  # "signal", "time_limit", "oom", "nan": how the session ended
        self.step = step
        self.checkpoint = checkpoint


class TrainingDiverged(Exception):
    """Training cannot go on as configured (repeated NaNs with on_repeated_nan: stop, or an
    OOM at micro-batch 1 with no checkpoint written). The message is the diagnosis. Exit code 1."""

    exit_code = 1
