"""`relaytune train` with several GPUs: start the workers through torch's elastic agent.

The launcher (the process the user started) holds the run-folder lock, picks a free port for a
standalone c10d rendezvous on 127.0.0.1, and hands `worker` to
`torch.distributed.launcher.api.elastic_launch`, the engine behind torchrun. Each worker joins
the process group and runs the same `train()` as a single process would (world.py says which
rank it is). A worker that crashes (SIGKILL, an unexpected exception) makes the agent restart
every worker, up to `max_restarts` times; they continue from the last committed checkpoint.

Exit codes stay the contract. A worker never raises for an ending that is the run's answer
(finished, stopped with a checkpoint, bad config, diverged): it returns it, so the agent does
not restart it, and the launcher turns rank 0's answer back into the same exception. SIGTERM
or SIGINT to the launcher: the agent passes it to the workers, they stop at the same step
boundary with one committed checkpoint, and the launcher exits 75.

The launcher handles SIGTERM/SIGINT/SIGHUP/SIGUSR1 itself rather than through the agent's own handler:
it forwards the signal to the workers and lets the agent go on monitoring them, so their
answers (exit 75, the checkpoint's path) come back the ordinary way. (The agent's handler shuts
the workers down instead, and a function worker that has answered then waits for the agent to
read its answer, which a shutting-down agent never does: 30 s lost before a SIGKILL.) A third
signal hands over to the agent's shutdown.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import uuid
from contextlib import contextmanager

from relaytune.distributed.world import LAUNCHER_PID, die_with_parent, libc_prctl
from relaytune.errors import StoppedEarly, TrainingDiverged, UserError
from relaytune.log import info


def maybe_launch(cfg, run, config, fresh: bool, overrides: dict):
    """In the process the user started, with several GPUs wanted: launch the workers and return
    the run's result (or raise its error). None: train in this process (one GPU, or this is
    already a worker of relaytune's launcher or of an external torchrun)."""
    if "RANK" in os.environ or "TORCHELASTIC_RUN_ID" in os.environ:
        return None  # a worker: join, never launch
    nproc = processes_wanted(cfg)
    if nproc <= 1:
        return None
    return launch(run, nproc, config, fresh, overrides, cfg.max_restarts)


@contextmanager
def run_lock(world, root):
    """The run-folder lock: a single process takes it; under relaytune's launcher the launcher
    holds it already; under an external torchrun global rank 0 takes it (and every rank learns
    whether it could)."""
    from relaytune.checkpoint.lock import RunLock

    held: list = []
    if not world.distributed:
        held.append(RunLock(root).acquire())
    elif not world.launched:
        world.decide(lambda: held.append(RunLock(root).acquire()) if world.is_main else None)
    try:
        yield
    finally:
        for lock in held:
            lock.release()


def processes_wanted(cfg) -> int:
    """num_gpus: auto = every visible CUDA GPU (1 without one); a number is checked against them.
    On a machine without CUDA a number above 1 means that many CPU processes (gloo)."""
    import torch

    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if cfg.num_gpus == "auto":
        return max(1, visible)
    if visible and cfg.num_gpus > visible:
        raise UserError(f"`num_gpus`: {cfg.num_gpus} asked for, but {visible} GPU(s) are visible "
                        "(CUDA_VISIBLE_DEVICES); lower num_gpus or use auto")
    return cfg.num_gpus


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(run, nproc: int, config, fresh: bool, overrides: dict, max_restarts: int):
    """Run `nproc` workers on this host and return rank 0's RunResult (or raise its error)."""
    import torch
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from relaytune.checkpoint.lock import RunLock

    logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)
    # fork is fast and safe while this process has run no torch kernel and touched no CUDA
    # context; with GPUs, spawn (a CUDA context does not survive a fork).
    start = os.environ.get("RELAYTUNE_START_METHOD") or ("spawn" if torch.cuda.is_available() else "fork")
    with RunLock(run.root):
        config_args = LaunchConfig(
            min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"relaytune-{uuid.uuid4().hex[:12]}",
            rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{free_port()}", rdzv_configs={"is_host": True},
            max_restarts=max_restarts, monitor_interval=0.1, start_method=start,
            signals_to_handle="SIGQUIT")  # the stop signals are forwarded by `_forward_signals`
        info(f"starting {nproc} workers ({'GPUs' if torch.cuda.is_available() else 'CPU processes, gloo'}), "
             f"up to {max_restarts} restarts after a crash")
        os.environ["RELAYTUNE_LAUNCHED"] = "1"  # the workers know the launcher holds the lock
        if start in ("fork", "spawn"):  # the workers are this process's children (not a forkserver's)
            os.environ[LAUNCHER_PID] = str(os.getpid())
        libc_prctl()  # looked up before the forks (world.py says why)
        since = _sessions_size(run)
        previous = _forward_signals()
        try:
            answers = elastic_launch(config_args, worker)(config, fresh, overrides)
        except SignalException as e:
            raise _after_signal(run, e.sigval.name, since) from None
        except ChildFailedError as e:
            raise RuntimeError(f"the workers failed {max_restarts + 1} times (max_restarts: {max_restarts}); "
                               f"the last committed checkpoint is intact.\n{e.format_msg()}") from None
        finally:
            os.environ.pop("RELAYTUNE_LAUNCHED", None)
            os.environ.pop(LAUNCHER_PID, None)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    return _result(run, answers)


def _forward_signals() -> dict:
    """Handlers that pass a stop signal on to the workers (the launcher's children); the third
    one raises the agent's SignalException, whose shutdown ends the workers."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    seen = []

    def forward(signum, frame):
        seen.append(signum)
        if len(seen) >= 3:
            raise SignalException(f"signal {signum} received {len(seen)} times", signal.Signals(signum))
        for pid in _children():
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    from relaytune.training.stops import take_over_from_setup

    take_over_from_setup()  # the workers now decide how a stop ends, not the CLI's set-up guard
    previous = {}
    for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1"):  # SIGUSR1: SLURM's `--signal` notice
        sig = getattr(signal, name)
        previous[sig] = signal.signal(sig, forward)
    return previous


def _children() -> list[int]:
    """The workers: this process's children, but not multiprocessing's resource tracker."""
    return children_of(os.getpid())


def children_of(pid: int) -> list[int]:
    """A process's live children (not zombies), but not multiprocessing's resource tracker."""
    pids = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as fh:
                pids += [int(x) for x in fh.read().split()]
        except OSError:
            continue
    out = []
    for child in pids:
        try:
            with open(f"/proc/{child}/cmdline", "rb") as fh:
                if b"resource_tracker" in fh.read():
                    continue
            with open(f"/proc/{child}/stat") as fh:
                if fh.read().rpartition(")")[2].split()[0] == "Z":
                    continue
        except OSError:
            continue
        out.append(child)
    return out


def peer_lost() -> bool:
    """In a worker of relaytune's launcher: whether fewer workers live than LOCAL_WORLD_SIZE, so a peer
    has died. The agent then sends the others SIGTERM, but they cannot finish their step (its
    collectives wait for the dead peer; NCCL for its whole timeout), and the agent SIGKILLs them only
    30 s later: 30 s of every restart, measured on 2 H200s (bench/results/multi-gpu.md). A worker that
    has finished stays alive until every worker has returned its answer (the agent's function workers
    wait for it to read them all), so only a crash makes one disappear early. Not under an external
    torchrun, whose script workers exit as soon as they finish."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or 0)
    if local <= 1 or os.environ.get("RELAYTUNE_LAUNCHED") != "1" or "RANK" not in os.environ:
        return False
    try:
        return len(children_of(os.getppid())) < local
    except OSError:  # no /proc: keep the agent's own timing
        return False


def worker(config, fresh: bool, overrides: dict) -> dict:
    """One rank: the same train() as a single process, in worker mode (RANK/WORLD_SIZE are set).
    The run's own endings are returned, not raised, so the agent restarts only real crashes."""
    die_with_parent()  # first: the launcher may already be gone (world.py says why)
    from relaytune.training.recipe import train

    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0) > 0
    # A stop signal before the loop's handlers are in place must set the flag too, never kill
    # (a killed worker is a crash, and the agent would restart every worker).
    from relaytune.training.stops import StopRequest

    early = StopRequest().install()
    try:
        r = train(config, fresh=fresh and not restarted, **overrides)  # a restart continues the run
        return {"code": 0, "status": r.status, "step": r.step}
    except StoppedEarly as e:
        return {"code": 75, "type": "StoppedEarly", "message": str(e), "step": e.step,
                "checkpoint": e.checkpoint, "how": str(e.how)}
    except (UserError, TrainingDiverged) as e:
        return {"code": e.exit_code, "type": type(e).__name__, "message": str(e)}
    finally:
        early.uninstall()


def _result(run, answers: dict):
    """Rank 0's answer (or the first rank's that is not a success) as train() would give it."""
    from relaytune.training.recipe import RunResult

    a = next((answers[r] for r in sorted(answers) if answers[r]["code"] != 0), answers[0])
    if a["code"] == 0:
        return RunResult(a["status"], a["step"], run.root, run.final)
    if a["type"] == "StoppedEarly":
        raise StoppedEarly(a["message"], a["step"], a["checkpoint"], a["how"])
    if a["type"] == "UserError":
        raise UserError(a["message"])
    raise TrainingDiverged(a["message"])


def _sessions_size(run) -> int:
    try:
        return run.sessions.stat().st_size
    except OSError:
        return 0


def _after_signal(run, name: str, since: int) -> BaseException:
    """The agent stopped the workers with the signal; rank 0 recorded in sessions.jsonl how its
    session ended (only what this launch wrote, from byte `since`, counts)."""
    how, step = None, None
    try:
        with open(run.sessions, "rb") as fh:
            fh.seek(since)
            lines = fh.read().decode("utf-8", "replace").splitlines()
    except OSError:
        lines = []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("event") == "end":
            how, step = rec.get("how"), rec.get("at_step")
        elif rec.get("event") == "start":
            how, step = None, None
    if how in ("signal", "time_limit"):
        return StoppedEarly(f"stopped by {name} at step {step}", step, None, how="signal")
    return RuntimeError(f"stopped by {name} before the workers could commit a checkpoint; the last "
                        "committed checkpoint is intact; run the same command to continue")
