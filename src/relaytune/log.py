"""Human-facing messages. Everything goes to stderr so stdout stays clean for tools."""

import logging
import os
import sys

from tqdm.auto import tqdm


def info(message: str) -> None:
    tqdm.write(f"relaytune: {message}", file=sys.stderr)


def notice(message: str) -> None:
    tqdm.write(f"relaytune: note: {message}", file=sys.stderr)


def warn(message: str) -> None:
    tqdm.write(f"relaytune: warning: {message}", file=sys.stderr)


def warn_unbuffered(message: str) -> None:
    """warn() straight to stderr's file descriptor, for a signal handler that interrupted a write to the
    buffered stream (which refuses the reentrant write); a message that cannot be written is dropped."""
    try:
        os.write(sys.stderr.fileno(), f"\nrelaytune: warning: {message}\n".encode())
    except (OSError, ValueError, AttributeError):
        pass


class _DropMessage(logging.Filter):
    """Drops the records of one logger whose message starts with `prefix`; keeps every other."""

    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


# bitsandbytes logs this at import on a CPU with AVX512-BF16 when the optional `kernels` package is
# missing; it then uses its own CPU kernels, so nothing is wrong. The import comes from `import peft`
# (wherever that runs first, e.g. the checkpoint saver's version list), so the filter is set here, in
# the module every relaytune module imports, before any of them can import peft.
logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(
    _DropMessage("Failed to load CPU gemm_4bit_forward"))
