"""Preemption (issue 4): signals and time limits end in a committed checkpoint and exit 75,
and re-running continues to a byte-identical adapter."""

from __future__ import annotations

import json
import os
import random
import signal
import threading
from pathlib import Path

import pytest
from conftest import make_config
from support.gate import Gate, stderr_says, wait_for

import relaytune
from relaytune.atomic import verify
from relaytune.errors import StoppedEarly
from relaytune.training import stops


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
    gate = Gate(tmp_path, random.Random(signame).randint(3, 20))
    child = fork_cli.start("train", str(cfg), env=gate.env)
    gate.wait_reached(child.pid)  # held after that step's record, mid-run
    os.kill(child.pid, getattr(signal, signame))
    wait_for(stderr_says(child, f"{signame} received"), child.pid)
    gate.open()
    result = child.wait(120)
    err = result.stderr
    assert result.returncode == 75, err
    assert "committed" in err and "after the request" in err
    committed = [p for p in (run / "checkpoints").iterdir() if verify(p) is None]
    assert [p.name for p in committed] == [f"step-{gate.step}"]  # the step the signal came after
    step = gate.step
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
    gate = Gate(tmp_path, 3)
    monkeypatch.setenv("RELAYTUNE_PAUSE_AT", gate.env["RELAYTUNE_PAUSE_AT"])
    cfg = make_config(tmp_path, tiny_model, chat_data, max_steps=100_000, save_steps=100_000)
    returned = threading.Event()

    def interrupt_at_the_pause():
        while not gate.reached_file.exists():
            if returned.wait(0.01):
                return  # train() ended without pausing: the assertions below say how
        os.kill(os.getpid(), signal.SIGINT)  # what Ctrl-C or a notebook's interrupt sends
        while not stops.StopRequest.adopt().requested and not returned.wait(0.01):
            pass  # the main thread's handler has seen it before the run goes on
        gate.open()

    before = signal.getsignal(signal.SIGINT)  # Python's default, or SIG_IGN under a background shell job
    threading.Thread(target=interrupt_at_the_pause, daemon=True).start()
    try:
        with pytest.raises(StoppedEarly) as info:
            relaytune.train(str(cfg))
    finally:
        returned.set()
    assert info.value.how == "signal" and info.value.checkpoint is not None
    assert verify(Path(info.value.checkpoint)) is None
    # The handlers are ours only while train() runs.
    assert signal.getsignal(signal.SIGINT) is before
