"""Shared by the multi-process tests (tests/distributed): the tiny run's data and settings, the
uninterrupted 1- and 2-process runs every fault test compares against, and process helpers.

Tolerance between process counts. With a share per rank that is a multiple of the micro-batch
(the default settings here: global batch 8 = 2 ranks x 4 rows, micro-batch 4) each rank's
micro-batch holds exactly the rows one process would put in it, and the sum of two per-rank
gradients is the same single addition one process does while accumulating: the final adapters
are byte-identical. When the split regroups rows (3 rows per rank cut 2 + 1 against one
process's 2 + 2 + 2), padding widths and the order of float summation change: same rows, same
maths, different rounding. Adam then carries those 1e-7-relative differences over the steps, so
the comparison allows RTOL/ATOL below (measured differences are about 1e-6 absolute).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support.run_helpers import chat_rows, make_config, step_records, write_jsonl

from relaytune.data.batches import DataOrder

RTOL, ATOL = 1e-4, 1e-5
ADAPTER = "final/adapter_model.safetensors"
# 12 steps of 8 rows over 40 rows; a checkpoint every 2 steps.
BASE = dict(max_steps=12, save_steps=2, logging_steps=1, save_every_seconds=0, lora_r=8)


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("ddpdata") / "data.jsonl", chat_rows(40))


def config(tmp: Path, tiny_model, data_file, **kw) -> Path:
    return make_config(tmp, tiny_model, data_file, **{**BASE, **kw})


def adapter(run_root: Path) -> dict[str, torch.Tensor]:
    return load_file(run_root / ADAPTER)


def assert_close(a: Path, b: Path) -> float:
    x, y = adapter(a), adapter(b)
    assert x.keys() == y.keys()
    worst = 0.0
    for k in x:
        torch.testing.assert_close(x[k], y[k], rtol=RTOL, atol=ATOL)
        worst = max(worst, (x[k] - y[k]).abs().max().item())
    return worst


def rows_by_step(prefix: Path) -> dict[int, list[int]]:
    """The global batch of each step, as the ranks recorded their shares (rank order; a step
    recorded twice, e.g. redone after an OOM or a restart, keeps its last record)."""
    shares: dict[int, dict[int, list[int]]] = {}
    for f in sorted(prefix.parent.glob(prefix.name + ".rank*.jsonl")):
        for line in f.read_text().splitlines():
            r = json.loads(line)
            shares.setdefault(r["step"], {})[r["rank"]] = r["rows"]
    return {s: [i for rank in sorted(d) for i in d[rank]] for s, d in shares.items()}


def expected_rows(steps: int = 12) -> dict[int, list[int]]:
    order = DataOrder(40, 8, 42)
    return {s: order.batch_rows(s) for s in range(steps)}


def run_ok(cli, cfg: Path, *extra: str, env: dict | None = None):
    r = cli.run("train", str(cfg), *extra, env=env)
    assert r.returncode == 0, r.stderr[-4000:]
    return r


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, tiny_model, data_file, fork_cli) -> Path:
    """An uninterrupted 1-process run without dropout (the maths to match across counts)."""
    tmp = tmp_path_factory.mktemp("one")
    rows = tmp / "rows"
    run_ok(fork_cli, config(tmp, tiny_model, data_file, lora_dropout=0.0), env={"RELAYTUNE_RECORD_ROWS": str(rows)})
    assert rows_by_step(rows) == expected_rows()
    return tmp / "run"


@pytest.fixture(scope="module")
def two_process(tmp_path_factory, tiny_model, data_file, fork_cli) -> tuple[Path, Path]:
    """An uninterrupted 2-process run with dropout 0.1 (the per-rank RNG streams matter):
    (run folder, config) for the fault tests that must end byte-identical to it."""
    tmp = tmp_path_factory.mktemp("two")
    cfg = config(tmp, tiny_model, data_file, num_gpus=2, lora_dropout=0.1)
    run_ok(fork_cli, cfg)
    records = step_records(tmp / "run/metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 13)), "only rank 0 writes metrics.jsonl, once a step"
    return tmp / "run", cfg



def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False


def children(pid: int) -> list[int]:
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def wait_unlocked(run: Path, timeout: float = 30) -> None:
    """Waits until no process holds the run's lock (AssertionError after `timeout`). A worker
    forked after the test listed the launcher's children is not in `wait_gone`'s list: killed with
    its launcher (PR_SET_PDEATHSIG), it can still hold the inherited lock for a moment, and a round
    started at once would be refused (exit 2)."""
    import fcntl

    lock = run / ".relaytune.lock"
    deadline = time.monotonic() + timeout
    while lock.exists():
        fd = os.open(lock, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except OSError:
            if time.monotonic() > deadline:
                raise AssertionError(f"{lock} still locked after {timeout:g} s: a process of the "
                                     "killed run outlived its launcher") from None
            time.sleep(0.02)
        finally:
            os.close(fd)  # closing drops the lock taken just now


def wait_gone(pids: list[int], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    for pid in pids:
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            try:  # a zombie of the (dead) launcher's: reaped by init soon
                if Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
                    break
            except OSError:
                break
            time.sleep(0.02)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

