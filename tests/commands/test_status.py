"""`relaytune status`: on a finished run, and on a live one from outside the training process."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from conftest import chat_rows, make_config, write_jsonl
from support.trained_run import copy_run, finished_run, wired

from relaytune.cli import main
from relaytune.commands.status import format_status, read_sessions, run_status, sparkline

PNG = b"\x89PNG\r\n\x1a\n"


def test_status_of_a_finished_run_writes_the_plot(tmp_path_factory, tiny_model, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    run = copy_run(finished_run(tmp_path_factory, tiny_model), tmp_path / "run")
    (run / "mirror_state.json").write_text(json.dumps(
        {"url": "s3://KEY:SECRET@bucket/runs/a?sig=x", "last_mirrored_step": 8, "last_error": None,
         "time": time.time() - 90}))
    assert main(["status", str(run)]) == 0
    out = capsys.readouterr().out
    st = run_status(run, plot=False)
    assert st.state == "finished" and st.step == st.total == 12
    assert [c.name for c in st.checkpoints][:2] == ["step-4", "step-8"] and "final" in [c.name for c in st.checkpoints]
    assert all(c.problem is None and c.size > 0 for c in st.checkpoints)
    assert st.checkpoints[0].eval_loss is not None  # training's eval at step 4
    assert [(s.session, s.how) for s in st.sessions] == [(1, "finished")]
    plot = run / "training_plot.png"
    assert f"plot     {plot}" in out
    assert plot.stat().st_size > 1000 and plot.read_bytes()[:8] == PNG
    assert "12 / 12" in out and "finished" in out and "▁" in out  # the loss sparkline
    assert "s3://bucket/runs/a" in out and "SECRET" not in out and "last mirrored step 8" in out
    # a damaged checkpoint is reported, not hidden
    victim = run / "checkpoints" / "step-4" / "optimizer.safetensors"
    victim.write_bytes(victim.read_bytes()[:-1] + b"\0")
    assert "does not match its sha256" in format_status(run_status(run, plot=False))


def test_sparkline():
    assert sparkline([3, 2, 1]) == "█▅▁"
    assert len(sparkline(list(range(500)), width=40)) == 40
    assert sparkline([float("nan")]) == ""


def _wait_for(predicate, timeout=60.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError("timed out")


def test_status_of_a_live_run_then_killed_then_resumed(tmp_path, tiny_model, fork_cli):
    data = write_jsonl(tmp_path / "data.jsonl", chat_rows())
    cfg = make_config(tmp_path, tiny_model, data, max_steps=40, save_steps=5, val_set_size=8, eval_steps=10)
    run = tmp_path / "run"
    live = fork_cli.start("train", str(cfg), env={"OMP_NUM_THREADS": "1", "RELAYTUNE_SLOW_STEP": "0.1"})
    try:
        st = _wait_for(lambda: _running(run))
        assert st.state == f"running (pid {live.pid})" and st.total == 40 and 0 < st.step < 40
        assert st.seconds_per_step and st.eta_s and st.eta_s > 0
        text = format_status(st)
        assert "ETA" in text and "running" in text
    finally:
        os.kill(live.pid, signal.SIGKILL)
        assert live.wait().returncode == -9
    killed = run_status(run, plot=False)
    assert killed.state.startswith("interrupted") and killed.sessions[-1].how == "killed"
    done = fork_cli.run("train", str(cfg), env={"OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    sessions = read_sessions(run)
    assert [s.how for s in sessions] == ["killed", "finished"]
    resumed_from = sessions[1].from_step
    assert resumed_from % 5 == 0  # a committed checkpoint
    if wired("open_trackers("):  # the heartbeat tells how far the killed session got
        assert sessions[0].reached >= resumed_from
        assert sessions[1].recomputed == sessions[0].reached - resumed_from
    final = run_status(run)
    assert final.state == "finished" and final.plot and final.plot.stat().st_size > 0
    assert "killed" in format_status(final)


def _running(run):
    """The status once training is a few steps in, else None (the run folder may not exist yet)."""
    from relaytune.errors import UserError

    try:
        st = run_status(run, plot=False)
    except UserError:
        return None
    return st if st.state.startswith("running") and st.step >= 3 and st.total else None
