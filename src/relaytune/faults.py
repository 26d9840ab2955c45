"""Fault injection for tests: the real fault at the real place.

The plan comes from environment variables and is read once per run (`reset()`, which
each training run calls at set-up and a test calls after changing the variables):

RELAYTUNE_CRASH_AT="point:N[,point:N...]"
    SIGKILL this process the N-th time (1-based) it reaches `point`. Points in
    the save path: save:begin, save:mid_file, save:before_manifest,
    save:after_manifest, save:before_rename, save:after_rename,
    save:during_retention; the data cache: cache:*; in the loop: step:end.
RELAYTUNE_FAIL_AT="point:N:errno"
    Raise OSError(errno) (e.g. 28 = ENOSPC, 5 = EIO) at the N-th time `point`
    is reached, as a full or failing disk would.
RELAYTUNE_FILL_AT="point:N" with RELAYTUNE_FILL_FILE=/path/on/the/same/filesystem
    Fill the filesystem (by writing that file until the kernel says ENOSPC) the
    N-th time `point` is reached; every write after that fails for real.
RELAYTUNE_OOM_AT="step:micro[,step:micro...]"
    Raise torch.OutOfMemoryError in the forward of that micro-batch (0-based)
    of that optimizer step (0-based), once each. With several processes, micro is
    counted within the rank's share, and RELAYTUNE_OOM_RANK=r limits it to rank r.
RELAYTUNE_NAN_AT="step[,step...]"
    Make the loss of that optimizer step NaN, once each.
RELAYTUNE_RECORD_ROWS=/path/prefix
    Append {"step", "rank", "rows"} (the row ids this rank trains in that step) to
    PREFIX.rank<r>.jsonl, so a test can see which rows every global batch held.
RELAYTUNE_SLOW_STEP=seconds
    Sleep this long after every optimizer step, so that a tiny test model trains
    slowly enough for a signal or a time limit to land mid-run.
RELAYTUNE_PAUSE_AT="step:/path/gate"
    After optimizer step `step` (its record written), create /path/gate.reached and
    wait until /path/gate exists, in short sleeps that let signal handlers run. A
    test acts on a run held at a known step, however late a loaded machine lets it
    notice; every process (rank) of the run, and every restart of it, pauses there.
    `step` may be `load`: the pause is in the set-up, just before the model loads.
RELAYTUNE_FUSED_ADAMW=1
    Run a GPU's update on the CPU: the fused AdamW, queued before the loss is read,
    with the next batch made ahead (training/optim.fusable). relaytune otherwise keeps
    the per-tensor AdamW on a CPU, so without this the CPU tests never take that path.
    Not a fault: one of SESSION_VARIABLES, which a test's child processes keep (they
    start without the VARIABLES), so set around a whole test session it reaches every
    training process of it.
"""

from __future__ import annotations

import os
import signal
import time
from collections import Counter
from dataclasses import dataclass, field

VARIABLES = ("RELAYTUNE_CRASH_AT", "RELAYTUNE_FAIL_AT", "RELAYTUNE_FILL_AT", "RELAYTUNE_OOM_AT",
             "RELAYTUNE_NAN_AT", "RELAYTUNE_SLOW_STEP", "RELAYTUNE_OOM_RANK", "RELAYTUNE_RECORD_ROWS",
             "RELAYTUNE_PAUSE_AT")
SESSION_VARIABLES = ("RELAYTUNE_FUSED_ADAMW",)


@dataclass
class Plan:
    crash: set[tuple[str, int]] = field(default_factory=set)  # (point, occurrence)
    fail: dict[tuple[str, int], int] = field(default_factory=dict)  # (point, occurrence) -> errno
    fill: set[tuple[str, int]] = field(default_factory=set)
    fill_file: str | None = None
    oom: set[tuple[int, int]] = field(default_factory=set)  # (step, micro-batch)
    nan: set[int] = field(default_factory=set)
    slow_step: float = 0.0
    pause: tuple[int | str, str] | None = None  # (step or "load", gate path)
    fused_adamw: bool = False
    hits: Counter = field(default_factory=Counter)

    def points(self) -> set[str]:
        return {point for point, _ in self.crash | set(self.fail) | self.fill}


def _items(env, name: str) -> list[list[str]]:
    raw = env.get(name, "").strip()
    return [item.strip().split(":") for item in raw.split(",") if item.strip()]


def parse(env) -> Plan:
    plan = Plan(fill_file=env.get("RELAYTUNE_FILL_FILE"))
    for spec in _items(env, "RELAYTUNE_CRASH_AT"):
        plan.crash.add((":".join(spec[:-1]), int(spec[-1])))
    for spec in _items(env, "RELAYTUNE_FAIL_AT"):
        plan.fail[(":".join(spec[:-2]), int(spec[-2]))] = int(spec[-1])
    for spec in _items(env, "RELAYTUNE_FILL_AT"):
        plan.fill.add((":".join(spec[:-1]), int(spec[-1])))
    plan.oom = {(int(s[0]), int(s[1])) for s in _items(env, "RELAYTUNE_OOM_AT")}
    if env.get("RELAYTUNE_OOM_RANK", "").strip() and env.get("RANK", "0") != env["RELAYTUNE_OOM_RANK"].strip():
        plan.oom = set()  # another rank's fault
    if int(env.get("TORCHELASTIC_RESTART_COUNT") or 0) > 0:
        plan.oom = set()  # injected in the first round; a real OOM does not recur at half the micro-batch
    plan.nan = {int(s[0]) for s in _items(env, "RELAYTUNE_NAN_AT")}
    plan.slow_step = float(env.get("RELAYTUNE_SLOW_STEP") or 0.0)
    if env.get("RELAYTUNE_PAUSE_AT", "").strip():
        step, gate = env["RELAYTUNE_PAUSE_AT"].strip().split(":", 1)
        plan.pause = (step if step == "load" else int(step), gate)
    plan.fused_adamw = env.get("RELAYTUNE_FUSED_ADAMW", "").strip() == "1"
    return plan


_plan: Plan | None = None


def reset(env=None) -> Plan:
    """Read the plan from the environment and start counting occurrences from zero."""
    global _plan
    _plan = parse(os.environ if env is None else env)
    return _plan


def _current() -> Plan:
    return _plan if _plan is not None else reset()


def armed(point: str) -> bool:
    """Whether the plan does anything at `point`: lets a writer take its fault-ready path only then."""
    return point in _current().points()


def reach(point: str) -> None:
    """Mark that execution reached `point`; crash or fail here if the plan says so."""
    plan = _current()
    if not plan.crash and not plan.fail and not plan.fill:
        return
    plan.hits[point] += 1
    n = plan.hits[point]
    if (point, n) in plan.crash:
        os.kill(os.getpid(), signal.SIGKILL)
    if (point, n) in plan.fail:
        err = plan.fail[(point, n)]
        raise OSError(err, f"{os.strerror(err)} (injected at {point}, occurrence {n})")
    if (point, n) in plan.fill:
        _fill_disk(plan.fill_file)


def step_ended(step: int) -> None:
    """The loop's one hook after optimizer step `step` (1-based): the `step:end` point, the slow-step
    switch and the pause."""
    plan = _current()
    if plan.slow_step:
        time.sleep(plan.slow_step)
    if plan.pause and plan.pause[0] == step:
        _hold(plan.pause[1])
    reach("step:end")


def model_loading() -> None:
    """The set-up's hook just before the model loads: the pause `load:/path/gate`."""
    plan = _current()
    if plan.pause and plan.pause[0] == "load":
        _hold(plan.pause[1])


def _hold(gate: str) -> None:
    open(f"{gate}.reached", "a").close()
    while not os.path.exists(gate):
        time.sleep(0.01)


def rows_trained(step: int, rank: int, rows: list[int]) -> None:
    """The row ids this rank trains in optimizer step `step` (RELAYTUNE_RECORD_ROWS only)."""
    prefix = os.environ.get("RELAYTUNE_RECORD_ROWS")
    if prefix:
        import json

        with open(f"{prefix}.rank{rank}.jsonl", "a", encoding="utf-8") as fh:
            fh.write(json.dumps({"step": step, "rank": rank, "rows": rows}) + "\n")


def oom_now(step: int, micro: int) -> bool:
    """True once for each (step, micro-batch) the plan names."""
    plan = _current()
    if (step, micro) in plan.oom:
        plan.oom.discard((step, micro))
        return True
    return False


def fused_adamw() -> bool:
    """Whether the plan runs the GPU's AdamW path on the CPU too."""
    return _current().fused_adamw


def nan_now(step: int) -> bool:
    """True once for each step the plan names."""
    plan = _current()
    if step in plan.nan:
        plan.nan.discard(step)
        return True
    return False


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
