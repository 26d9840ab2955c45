"""Rank, world size and device of this process; the process group; small collectives.

A process is a worker of a multi-process run when RANK and WORLD_SIZE (set by torch's elastic
agent, ours or an external torchrun) say so. Every helper here is a no-op with one process, so
the single-process path never touches torch.distributed.

Data parallelism without DDP's reducer: every rank holds the same replicated model, computes
the gradient of its share of the global batch (each micro-batch's loss divided by the target
tokens of the WHOLE global batch), and `sum_grads` adds the ranks' gradients with one all-reduce
of the flattened LoRA gradients. DDP's bucketed all-reduce inside backward would hang a rank
whose peer ran out of memory mid-backward; here the ranks first agree that nobody did
(agree.py), then reduce. LoRA gradients are small, so one flat all-reduce per step is cheap.
"""

from __future__ import annotations

import functools
import os
from contextlib import contextmanager
from dataclasses import dataclass

from relaytune.errors import StoppedEarly, TrainingDiverged, UserError


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    launched: bool = False  # started by relaytune's own launcher (which holds the run lock)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @property
    def takes_lock(self) -> bool:
        """Who holds the run-folder lock: a single process; under relaytune's launcher the
        launcher itself (not a worker); under an external torchrun, global rank 0."""
        return not self.distributed or (self.is_main and not self.launched)

    # --- the share of a global batch ---------------------------------------------------
    def share(self, rows: list) -> list:
        """This rank's contiguous slice of the global batch (sizes differ by at most one row).
        Contiguous, so that with a share that is a multiple of the micro-batch the micro-batches
        hold the same rows as one process would cut them."""
        n, w, r = len(rows), self.size, self.rank
        start = r * (n // w) + min(r, n % w)
        return rows[start:start + n // w + (1 if r < n % w else 0)]

    # --- collectives (no-ops with one process) ------------------------------------------
    def barrier(self) -> None:
        if self.distributed:
            import torch.distributed as dist

            dist.barrier()

    def all_reduce(self, values: list[float], op: str = "sum", dtype=None) -> list[float]:
        """Element-wise sum or max of a few numbers over the ranks (float64 unless `dtype`; on the
        CPU for gloo, on the GPU for NCCL)."""
        if not self.distributed:
            return list(values)
        import torch
        import torch.distributed as dist

        t = torch.tensor(values, dtype=dtype or torch.float64, device=self.device())
        dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
        return t.tolist()

    def any(self, flag: bool) -> bool:
        return bool(self.all_reduce([1.0 if flag else 0.0], "max")[0])

    def sum_grads(self, params: list) -> None:
        """Add the ranks' gradients of `params` in place: one all-reduce of one flat buffer
        (a missing gradient counts as zeros). The order of the sum is fixed by the backend,
        so the same world size gives the same bytes every time."""
        if not self.distributed:
            return
        import torch
        import torch.distributed as dist

        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1).float() for g in grads])
        dist.all_reduce(flat)
        offset = 0
        for p, g in zip(params, grads):
            n = g.numel()
            chunk = flat[offset:offset + n].view_as(g).to(g.dtype)
            if p.grad is None:
                p.grad = chunk.clone()
            else:
                p.grad.copy_(chunk)
            offset += n

    def broadcast_params(self, params: list) -> None:
        """Rank 0's values for every rank (the same seed gives the same LoRA init anyway; this
        makes it a fact rather than a hope)."""
        if not self.distributed:
            return
        import torch.distributed as dist

        for p in params:
            dist.broadcast(p.data, src=0)

    def share_object(self, value=None):
        """Rank 0's `value`, on every rank (pickled by torch over the process group; only
        relaytune's own values travel: paths, numbers, messages)."""
        if not self.distributed:
            return value
        import torch.distributed as dist

        box = [value if self.is_main else None]
        dist.broadcast_object_list(box, src=0, device=self.device())
        return box[0]

    def decide(self, fn):
        """Run `fn` on rank 0 only and give its result (or its error) to every rank."""
        if not self.distributed:
            return fn()
        outcome = None
        if self.is_main:
            try:
                outcome = ("ok", fn())
            except BaseException as e:
                outcome = ("error", _describe(e))
                self.share_object(outcome)
                raise
        outcome = self.share_object(outcome)
        if outcome[0] == "error":
            raise _rebuild(outcome[1])
        return outcome[1]

    def main_first(self, fn):
        """Run `fn` on rank 0, then (if it succeeded) on the others: for work that fills a cache
        the others then read (data preparation, the built-in model's decoding)."""
        if not self.distributed:
            return fn()
        if self.is_main:
            return self.decide(fn)
        self.decide(lambda: None)
        return fn()

    @contextmanager
    def rank0_first(self):
        """`with world.rank0_first():` the block runs on rank 0, then (if it succeeded there) on
        the other ranks: for work that fills a cache the others then read (data preparation and
        its tokenization cache, the built-in model's decoding). An error on rank 0 is raised on
        every rank, so none waits for ever."""
        if not self.distributed:
            yield
            return
        if not self.is_main:
            outcome = self.share_object(None)
            if outcome[0] == "error":
                raise _rebuild(outcome[1])
            yield
            return
        try:
            yield
        except BaseException as e:
            self.share_object(("error", _describe(e)))
            raise
        self.share_object(("ok", None))

    def device(self):
        import torch

        if torch.cuda.is_available():
            return torch.device("cuda", self.local_rank)
        return torch.device("cpu")


class Silent:
    """Stands in for metrics.jsonl, sessions.jsonl and the trackers on ranks other than 0: only
    rank 0 writes them (its numbers are every rank's, they are agreed)."""

    session = None

    def text(self) -> str:
        return ""

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def _describe(e: BaseException) -> dict:
    d = {"type": type(e).__name__, "message": str(e)}
    if isinstance(e, StoppedEarly):
        d.update(step=e.step, checkpoint=e.checkpoint, how=str(e.how))
    return d


def _rebuild(d: dict) -> BaseException:
    """The same kind of error on a rank that did not raise it, so every rank exits the same way."""
    if d["type"] == "StoppedEarly":
        return StoppedEarly(d["message"], d["step"], d["checkpoint"], d["how"])
    if d["type"] == "UserError":
        return UserError(d["message"])
    if d["type"] == "TrainingDiverged":
        return TrainingDiverged(d["message"])
    return RuntimeError(f"rank 0 failed: {d['type']}: {d['message']}")


_current = World()


def current() -> World:
    """This process's World (one process, rank 0, unless `joined` set it up)."""
    return _current


def local_size(env=None) -> int:
    """Processes on this host (torchrun's LOCAL_WORLD_SIZE; 1 when alone): local ranks 0..n-1 each take
    the GPU of their number."""
    env = os.environ if env is None else env
    return int(env.get("LOCAL_WORLD_SIZE") or 1)


def from_env(env=None) -> World:
    env = os.environ if env is None else env
    size = int(env.get("WORLD_SIZE") or 1)
    if size <= 1 or "RANK" not in env:
        return World()
    return World(rank=int(env["RANK"]), size=size, local_rank=int(env.get("LOCAL_RANK") or 0),
                 launched=env.get("RELAYTUNE_LAUNCHED") == "1")


@contextmanager
def joined():
    """Join the process group when this process is one of several (RANK/WORLD_SIZE set); leave
    it on the way out. With one process: nothing at all."""
    global _current
    world = from_env()
    if not world.distributed:
        yield world
        return
    import datetime

    import torch
    import torch.distributed as dist

    if not world.launched:  # relaytune's launcher's workers asked first thing (launch.worker)
        die_with_parent()
    if torch.cuda.is_available():
        torch.cuda.set_device(world.local_rank)  # the local rank picks the GPU
        backend = "nccl"
    else:
        backend = "gloo"
    timeout = datetime.timedelta(minutes=30)
    store = _attempt_store(world, timeout)
    if store is None:
        dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group(backend, store=store, rank=world.rank, world_size=world.size, timeout=timeout)
    _current = world
    try:
        yield world
    finally:
        _current = World()
        try:
            dist.destroy_process_group()
        except Exception:
            pass


def _attempt_store(world: World, timeout):
    """The process group's store for this restart attempt, when the elastic agent shares its own.

    torchrun's agent keeps one TCP store for every round (TORCHELASTIC_USE_AGENT_STORE), and torch
    adds no per-attempt prefix to it, so after a restart the process group's keys of the crashed round
    are still there: a new rank could read a dead rank's address and fail with "Connection refused" in
    gloo's connectFullMesh. A prefix per attempt keeps each round's keys apart. None: torch's default.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    import torch.distributed as dist

    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    shared = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world.size,
                           is_master=False, timeout=timeout)
    return dist.PrefixStore(f"relaytune/attempt-{attempt}", shared)


LAUNCHER_PID = "RELAYTUNE_LAUNCHER_PID"  # set by relaytune's launcher for the workers it starts


def die_with_parent() -> None:
    """A worker whose launcher is killed (SIGKILL leaves no time to stop it) must not go on
    training beside the re-run, nor hold the run's lock: ask the kernel to SIGKILL it when its
    parent dies (Linux).

    A launcher killed between starting a worker and this request has already left the worker
    re-parented (to init or a subreaper), and getppid() alone cannot tell: the worker would wait
    for its dead peers for the process group's timeout, holding the lock it inherited. So under
    relaytune's launcher the parent must be the launcher's pid, which it passes in the environment."""
    import signal

    prctl = libc_prctl()
    if prctl is None:
        return
    try:
        parent = int(os.environ.get(LAUNCHER_PID) or os.getppid())
    except ValueError:
        return
    prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before the request took effect
        os.kill(os.getpid(), signal.SIGKILL)


@functools.cache
def libc_prctl():
    """libc's prctl, looked up once (None where there is none: not Linux). The launcher looks it up
    before it forks the workers, whose copy of this cache then holds it: a child forked from a process
    with threads (the agent's) should call only async-signal-safe functions, and the lookup (dlopen,
    dlsym) is not one; a loader lock that another thread held at the fork would never be released."""
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


__all__ = ["World", "current", "from_env", "joined"]
