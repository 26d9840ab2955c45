"""Fault injection for tests: the real fault at the real place.

Switches are environment variables, read once per process:

RELAYTUNE_CRASH_AT="point:N[,point:N...]"
    SIGKILL this process the N-th time (1-based) it reaches `point`. Points in
    the save path: save:begin, save:mid_file, save:before_manifest,
    save:after_manifest, save:before_rename, save:after_rename,
    save:during_retention; in the loop: step:end.
RELAYTUNE_FAIL_AT="point:N:errno"
    Raise OSError(errno) (e.g. 28 = ENOSPC, 5 = EIO) at the N-th time `point`
    is reached, as a full or failing disk would.
RELAYTUNE_FILL_AT="point:N" with RELAYTUNE_FILL_FILE=/path/on/the/same/filesystem
    Fill the filesystem (by writing that file until the kernel says ENOSPC) the
    N-th time `point` is reached; every write after that fails for real.
RELAYTUNE_OOM_AT="step:micro[,step:micro...]"
    Raise torch.OutOfMemoryError in the forward of that micro-batch (0-based)
    of that optimizer step (0-based), once each.
RELAYTUNE_NAN_AT="step[,step...]"
    Make the loss of that optimizer step NaN, once each.
RELAYTUNE_SLOW_STEP=seconds
    Sleep this long after every optimizer step, so that a tiny test model trains
    slowly enough for a signal or a time limit to land mid-run.
"""

from __future__ import annotations

import os
import signal
import time
from collections import Counter

_hits: Counter = Counter()
_fired: set = set()


def _parse(name: str) -> list[list[str]]:
    raw = os.environ.get(name, "").strip()
    return [item.strip().split(":") for item in raw.split(",") if item.strip()]


def reach(point: str) -> None:
    """Mark that execution reached `point`; crash or fail here if a switch says so."""
    if point == "step:end" and os.environ.get("RELAYTUNE_SLOW_STEP"):
        time.sleep(float(os.environ["RELAYTUNE_SLOW_STEP"]))
    _hits[point] += 1
    n = _hits[point]
    for spec in _parse("RELAYTUNE_CRASH_AT"):
        if ":".join(spec[:-1]) == point and int(spec[-1]) == n:
            os.kill(os.getpid(), signal.SIGKILL)
    for spec in _parse("RELAYTUNE_FAIL_AT"):
        if ":".join(spec[:-2]) == point and int(spec[-2]) == n:
            err = int(spec[-1])
            raise OSError(err, f"{os.strerror(err)} (injected at {point}, occurrence {n})")
    for spec in _parse("RELAYTUNE_FILL_AT"):
        if ":".join(spec[:-1]) == point and int(spec[-1]) == n:
            _fill_disk(os.environ["RELAYTUNE_FILL_FILE"])


def _fill_disk(path: str) -> None:
    chunk = b"\0" * (1 << 16)
    with open(path, "ab") as fh:
        try:
            while True:
                fh.write(chunk)
                fh.flush()
        except OSError:
            pass
        try:  # fill the last partial block too
            while True:
                fh.write(b"\0")
                fh.flush()
        except OSError:
            pass


def oom_now(step: int, micro: int) -> bool:
    key = ("oom", step, micro)
    for spec in _parse("RELAYTUNE_OOM_AT"):
        if (int(spec[0]), int(spec[1])) == (step, micro) and key not in _fired:
            _fired.add(key)
            return True
    return False


def nan_now(step: int) -> bool:
    key = ("nan", step)
    for spec in _parse("RELAYTUNE_NAN_AT"):
        if int(spec[0]) == step and key not in _fired:
            _fired.add(key)
            return True
    return False
