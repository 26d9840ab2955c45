"""Human-facing messages. Everything goes to stderr so stdout stays clean for tools."""

import sys

from tqdm.auto import tqdm


def info(message: str) -> None:
    tqdm.write(f"relaytune: {message}", file=sys.stderr)


def notice(message: str) -> None:
    tqdm.write(f"relaytune: note: {message}", file=sys.stderr)


def warn(message: str) -> None:
    tqdm.write(f"relaytune: warning: {message}", file=sys.stderr)
