"""Issue 15 item 5: one training process per output_dir. A second `train` exits 2 naming the first
one's pid and start time, and touches nothing; a lock left by a killed process never blocks."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from conftest import ONE_THREAD_ENV, make_config, run_cli

from relaytune.checkpoint.lock import LOCK_NAME, RunLock
from relaytune.errors import UserError


def test_a_second_lock_on_the_same_folder_is_refused_with_the_holder(tmp_path):
    with RunLock(tmp_path):
        with pytest.raises(UserError) as info:
            RunLock(tmp_path).acquire()
        assert f"another relaytune process (pid {os.getpid()}, started " in str(info.value)
        assert f"is training in {tmp_path}" in str(info.value)
    with RunLock(tmp_path):  # released: taken again at once
        pass
    assert (tmp_path / LOCK_NAME).is_file()


def _sessions(run):
    path = run / "sessions.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def test_two_processes_on_one_output_dir(tmp_path, tiny_model, chat_data, fork_cli):
    cfg = make_config(tmp_path, tiny_model, chat_data, max_steps=10_000, save_steps=3)
    run = tmp_path / "run"
    first = fork_cli.start("train", str(cfg), env={"RELAYTUNE_SLOW_STEP": "0.2"})
    try:
        end = time.monotonic() + 120
        while not (run / "checkpoints" / "step-3" / "manifest.json").exists():
            assert time.monotonic() < end, "the first run made no progress"
            time.sleep(0.05)
        second = run_cli("train", str(cfg), env={**ONE_THREAD_ENV, "RELAYTUNE_SLOW_STEP": "0"}, timeout=300)
        assert second.returncode == 2, second.stderr[-3000:]
        assert f"another relaytune process (pid {first.pid}, started " in second.stderr
        assert f"is training in {run}" in second.stderr and "Traceback" not in second.stderr
        assert [s["event"] for s in _sessions(run)].count("start") == 1, "the second process touched the run"
    finally:
        os.kill(first.pid, signal.SIGKILL)
        assert first.wait(60).returncode == -9
    # The kernel dropped the killed process's lock: a re-run trains (and is killed after one step).
    again = fork_cli.run("train", str(cfg), env={"RELAYTUNE_CRASH_AT": "step:end:1"})
    assert again.returncode == -9, again.stderr[-3000:]
    assert "another relaytune process" not in again.stderr
    assert [s["event"] for s in _sessions(run)].count("start") == 2
