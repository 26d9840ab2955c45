"""Which checkpoint a session continues from, on every rank, and what of the saved run still holds.

The trainer asks three things here before it restores: the checkpoint to load (rank 0 chooses,
a damaged one is set aside, the other ranks read the very one it took), whether the saved
config and data allow continuing (a changed config is the user's call: exit 2), and which
micro-batch is in force after an OOM forced one down in an earlier session.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch

from relaytune.checkpoint.load import Loaded, load
from relaytune.checkpoint.resume import check_compatible
from relaytune.log import notice


def load_resumable(checkpointer, path: Path | None, check: Callable[[dict], None]) -> Loaded | None:
    """The checkpoint to continue from, read and parsed (a damaged one is set aside and the one
    before it taken), and checked against the config."""
    loaded = checkpointer.load(path)
    if loaded is not None:
        check(loaded.state)
    return loaded


def load_agreed(world, checkpointer, path: Path | None, check: Callable[[dict], None]) -> Loaded | None:
    """load_resumable on rank 0 (which may set a damaged checkpoint aside); the other ranks then
    read the very checkpoint it took, so every rank continues from the same step."""
    if not world.distributed:
        return load_resumable(checkpointer, path, check)
    mine = load_resumable(checkpointer, path, check) if world.is_main else None
    chosen = world.share_object(str(mine.path) if mine is not None else None)
    if world.is_main or chosen is None:
        return mine
    loaded = load(Path(chosen))
    check(loaded.state)
    return loaded


def check_resumable(saved: dict, cfg, data_fingerprint: str, device: torch.device) -> None:
    check_compatible(saved["config"], cfg, data_fingerprint, saved["data_fingerprint"])
    threads = saved.get("torch_threads")
    if device.type == "cpu" and threads not in (None, torch.get_num_threads()):
        notice(f"the checkpoint was written with {threads} CPU threads, this session has "
               f"{torch.get_num_threads()}: the run continues correctly, but not bit for bit "
               "(set OMP_NUM_THREADS to match for an exact continuation)")


def follow_micro_batch_setting(recovery, auto, global_batch: int, saved_micro_batch: int | str,
                               saved_auto: dict | None = None) -> None:
    """Keep a micro-batch that an OOM forced down; otherwise follow the (harmless) new setting.
    A fresh `auto` choice (a new GPU, or auto newly set) holds as chosen; one kept from the checkpoint
    counts as the saved setting."""
    if saved_micro_batch == "auto":
        saved_micro_batch = (saved_auto or {}).get("micro_batch_size", recovery.micro_batch_size)
    was_forced = recovery.micro_batch_size < saved_micro_batch and not (auto.auto_micro and not auto.from_checkpoint)
    configured = auto.micro_batch
    recovery.micro_batch_size = min(recovery.micro_batch_size, configured) if was_forced else configured
    recovery.accumulation = math.ceil(global_batch / recovery.micro_batch_size)


def restart_after_oom(run, recovery, global_batch: int, step: int, error: BaseException):
    """Under FSDP (distributed/fsdp.py): write down the halved micro-batch, or 0 when micro-batch 1
    ran out too, and end this worker; the agent restarts every worker from the last checkpoint."""
    import copy

    from relaytune.distributed import fsdp
    from relaytune.training.recovery import NoSmallerBatch, shrink_after_oom

    try:
        _, new = shrink_after_oom(copy.copy(recovery), global_batch, step, error)
    except NoSmallerBatch:
        new = 0
    fsdp.oom_request(run.oom_request, step, new)
    raise RuntimeError(f"out of memory at step {step + 1} with the base sharded (FSDP): the workers restart from "
                       f"the last checkpoint with micro-batch {new or 'none smaller than 1'}") from error


def follow_oom_request(run, recovery, cfg, resumed_step: int, world, last_checkpoint) -> tuple[int, int, int] | None:
    """A micro-batch an OOM asked for under FSDP at or after the step this session resumes from:
    (step, old, new) once applied; None: nothing to do. When even micro-batch 1 ran out, the run
    stops with exit 75 as an unsharded one does (oom_advice), and the request is cleared so that
    the next session tries again (on another GPU, perhaps)."""
    from relaytune.distributed import fsdp
    from relaytune.errors import StoppedEarly
    from relaytune.training.recovery import oom_advice

    request = fsdp.read_oom_request(run.oom_request)
    if request is None or request["step"] < resumed_step:
        return None
    old, new = recovery.micro_batch_size, int(request["micro_batch_size"])
    if new >= old:
        return None
    if new == 0:
        if world.is_main:
            run.oom_request.unlink(missing_ok=True)
        last = last_checkpoint()
        raise StoppedEarly(f"{oom_advice(cfg)}\nThe last committed checkpoint is {last.name if last else 'none'}",
                           resumed_step, str(last) if last else None, how="oom")
    recovery.micro_batch_size = new
    recovery.accumulation = math.ceil(cfg.global_batch_size / new)
    return request["step"], old, new
