"""Preemption (issue 4): signals and time limits end in a committed checkpoint and exit 75,
and re-running continues to a byte-identical adapter."""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from pathlib import Path

import pytest
from conftest import make_config

import relaytune
from relaytune.atomic import verify
from relaytune.errors import StoppedEarly
from relaytune.observe.metrics import read_metrics


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def _wait_for_step(run: Path, step: int, pid: int, timeout: float = 120) -> None:
    """Wait until the child has logged `step` (metrics.jsonl), so a signal lands mid-training."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not _alive(pid):
            raise AssertionError("child ended early")
        records = read_metrics(run / "metrics.jsonl") if (run / "metrics.jsonl").exists() else []
        if any(r.get("step", 0) >= step for r in records if "loss" in r):
            return
        time.sleep(0.02)
    raise AssertionError("child made no progress")


def _last_logged_step(run: Path) -> int:
    return max(r["step"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r and "event" not in r)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_model, fork_cli):
    from conftest import chat_rows, write_jsonl

    tmp = tmp_path_factory.mktemp("ref")
    data = write_jsonl(tmp / "data.jsonl", chat_rows(64))
    cfg = make_config(tmp, tiny_model, data, max_steps=60, save_steps=1000, lora_dropout=0.1)
    r = fork_cli.run("train", str(cfg))
    assert r.returncode == 0, r.stderr
    return data, (tmp / "run/final/adapter_model.safetensors").read_bytes()


@pytest.mark.parametrize("signame", ["SIGTERM", pytest.param("SIGINT", marks=pytest.mark.slow),
                                     pytest.param("SIGUSR1", marks=pytest.mark.slow),
                                     pytest.param("SIGHUP", marks=pytest.mark.slow)])
def test_signal_commits_a_checkpoint_exits_75_and_resumes_exactly(signame, tmp_path, tiny_model, reference, fork_cli):
    data, ref = reference
    cfg = make_config(tmp_path, tiny_model, data, max_steps=60, save_steps=1000, lora_dropout=0.1)
    run = tmp_path / "run"
    rng = random.Random(signame)
    child = fork_cli.start("train", str(cfg), env={"RELAYTUNE_SLOW_STEP": "0.02"})
    _wait_for_step(run, rng.randint(3, 20), child.pid)
    sent_after = _last_logged_step(run)
    os.kill(child.pid, getattr(signal, signame))
    result = child.wait(120)
    err = result.stderr
    assert result.returncode == 75, err
    assert f"{signame} received" in err and "committed" in err and "after the request" in err
    committed = [p for p in (run / "checkpoints").iterdir() if verify(p) is None]
    assert len(committed) == 1
    step = int(committed[0].name[5:])
    assert step >= sent_after  # no older than the last completed step
    ends = [json.loads(line) for line in (run / "sessions.jsonl").read_text().splitlines()]
    assert ends[-1]["event"] == "end" and ends[-1]["how"] == "signal" and ends[-1]["at_step"] == step
    again = fork_cli.run("train", str(cfg))
    assert again.returncode == 0, again.stderr
    assert (run / "final/adapter_model.safetensors").read_bytes() == ref


def test_time_limit_stops_before_the_limit_with_a_checkpoint(tmp_path, tiny_model, chat_data, fork_cli):
    cfg = make_config(tmp_path, tiny_model, chat_data, max_steps=100_000, save_steps=100_000,
                      time_limit="6s")
    r = fork_cli.run("train", str(cfg), env={"RELAYTUNE_SLOW_STEP": "0.05"})
    assert r.returncode == 75, r.stderr
    assert "stopped by time limit" in r.stderr
    sessions = [json.loads(line) for line in (tmp_path / "run/sessions.jsonl").read_text().splitlines()]
    start, end = sessions[0], sessions[-1]
    assert end["how"] == "time_limit"
    assert end["time"] - start["time"] < 6.0  # saved and out before the limit, counted from the run's start
    step_dirs = list((tmp_path / "run/checkpoints").iterdir())
    assert len(step_dirs) == 1 and verify(step_dirs[0]) is None
    assert int(step_dirs[0].name[5:]) == end["at_step"] > 0


def test_python_api_interrupt_raises_stopped_early_with_the_checkpoint(tmp_path, tiny_model, chat_data, monkeypatch,
                                                                     one_thread):
    monkeypatch.setenv("RELAYTUNE_SLOW_STEP", "0.02")
    cfg = make_config(tmp_path, tiny_model, chat_data, max_steps=100_000, save_steps=100_000)
    run = tmp_path / "run"

    def interrupt_once_training():
        for _ in range(3000):
            if (run / "metrics.jsonl").exists() and (run / "metrics.jsonl").read_text().count("\n") >= 3:
                break
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGINT)  # what Ctrl-C or a notebook's interrupt sends

    before = signal.getsignal(signal.SIGINT)  # Python's default, or SIG_IGN under a background shell job
    threading.Thread(target=interrupt_once_training, daemon=True).start()
    with pytest.raises(StoppedEarly) as info:
        relaytune.train(str(cfg))
    assert info.value.how == "signal" and info.value.checkpoint is not None
    assert verify(Path(info.value.checkpoint)) is None
    # The handlers are ours only while train() runs.
    assert signal.getsignal(signal.SIGINT) is before
