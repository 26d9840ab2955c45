"""`relaytune status`: on a finished run, and on a live one from outside the training process."""

from __future__ import annotations

import errno
import json
import os
import signal
import time

import pytest
from conftest import chat_rows, make_config, write_jsonl
from support.gate import Gate
from support.read_only import files, make_read_only
from support.trained_run import copy_run, finished_run

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
    gate = Gate(tmp_path, 12)  # held there, after an evaluation and a checkpoint, until it is killed
    live = fork_cli.start("train", str(cfg), env={"OMP_NUM_THREADS": "1", **gate.env})
    try:
        gate.wait_reached(live.pid)
        st = _wait_for(lambda: _running(run))
        assert st.state == f"running (pid {live.pid})" and st.total == 40 and st.step == 12
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
    assert sessions[0].reached >= resumed_from  # the heartbeat tells how far the killed session got
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


def test_status_shows_the_newest_step_of_progress_metrics_and_checkpoints(tmp_path_factory, tiny_model, tmp_path):
    """Issue 14 item 6: "steps 10/20" beside checkpoint step-13; the newest truth wins."""
    import shutil

    run = copy_run(finished_run(tmp_path_factory, tiny_model), tmp_path / "run")
    shutil.rmtree(run / "final")  # an unfinished run: its newest checkpoint is step-8
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("".join(line + "\n" for line in lines
                                               if json.loads(line).get("step", 0) <= 5))
    progress = json.loads((run / "progress.json").read_text())
    for entry in progress.values():
        entry["step"] = 6  # lags the checkpoint (it is written on logging steps only)
    (run / "progress.json").write_text(json.dumps(progress))
    sessions = [json.loads(line) for line in (run / "sessions.jsonl").read_text().splitlines()]
    (run / "sessions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sessions if r["event"] == "start"))
    st = run_status(run, plot=False)
    assert st.step == 8 and "steps    8 / 12" in format_status(st)


def test_plot_has_title_log_scale_warmup_and_checkpoint_markers(tmp_path_factory, tiny_model, tmp_path):
    pytest.importorskip("matplotlib")
    from relaytune.commands.status import plot_figure

    run = copy_run(finished_run(tmp_path_factory, tiny_model), tmp_path / "run")
    state_file = run / "checkpoints" / "step-8" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    state["config"]["warmup_steps"] = 3
    state_file.write_text(json.dumps(state))
    st = run_status(run)
    assert st.plot.read_bytes()[:8] == PNG
    records = st.records
    fig = plot_figure(records, title=f"{run.name}: step 12 / 12", warmup=3, checkpoints=[4, 8, 12])
    assert fig._suptitle.get_text() == "run: step 12 / 12"
    top, bottom = fig.axes
    assert top.get_yscale() == "log"
    marks = sorted(line.get_xdata()[0] for line in top.lines if line.get_gid() == "checkpoint")
    assert marks == [4, 8, 12]
    [span] = [p for p in top.patches if p.get_gid() == "warmup"]
    assert span.get_x() == 0 and span.get_width() == 3  # axvspan's Rectangle, in data x
    assert [line.get_gid() for line in bottom.lines].count("checkpoint") == 3
    # what `status` itself draws: the run's own title, warm-up from its config, its checkpoints
    from relaytune.commands import status as status_mod

    seen = {}
    real = status_mod.plot_figure

    def spy(records, title=None, warmup=0, checkpoints=()):
        seen.update(title=title, warmup=warmup, checkpoints=list(checkpoints))
        return real(records, title, warmup, checkpoints)

    status_mod.plot_figure = spy
    try:
        run_status(run)
    finally:
        status_mod.plot_figure = real
    assert seen["title"] == "run: step 12 / 12" and seen["warmup"] == 3 and seen["checkpoints"] == [4, 8]


def test_status_refuses_a_checkpoint_or_final_and_never_writes_into_it(tmp_path_factory, tiny_model, tmp_path,
                                                                        capsys):
    """A checkpoint holds metrics.jsonl, so status took it for a run and wrote its plot there: the next
    resume then rejected the checkpoint (a file its manifest does not list) and lost its steps."""
    import shutil

    from support.trained_run import BASE, one_thread

    import relaytune.training.recipe

    shared = finished_run(tmp_path_factory, tiny_model)
    run = copy_run(shared, tmp_path / "run")
    (tmp_path / "empty").mkdir()
    cases = {run / "checkpoints" / "step-4": "is checkpoint step-4 of the run in",
             run / "final": "is the final adapter (final/) of the run in",
             run / "checkpoints": "is the checkpoints folder of the run in"}
    for folder, says in cases.items():
        before = files(folder)
        assert main(["status", str(folder)]) == 2
        err = capsys.readouterr().err
        assert says in err and f"use `relaytune status {run}`" in err and "Traceback" not in err
        assert files(folder) == before
    assert main(["status", str(tmp_path / "empty")]) == 2
    assert "does not look like a relaytune run" in capsys.readouterr().err
    assert list((tmp_path / "empty").iterdir()) == []
    # the checkpoint is still the one a resume continues from
    shutil.rmtree(run / "final")
    for step in (8, 12):
        shutil.rmtree(run / "checkpoints" / f"step-{step}", ignore_errors=True)
    with one_thread():
        relaytune.training.recipe.train({**BASE, "model": str(tiny_model), "dataset": str(shared.parent / "data.jsonl"),
                                         "output_dir": str(run)})
    assert read_sessions(run)[-1].from_step == 4
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if "." in p.name) == []  # nothing set aside


def test_status_of_a_read_only_run_folder_prints_the_report_without_the_plot(tmp_path_factory, tiny_model, tmp_path,
                                                                              capsys, monkeypatch):
    """Kaggle's /kaggle/input is read-only: the report still prints; the plot is skipped with one warning."""
    pytest.importorskip("matplotlib")
    run = copy_run(finished_run(tmp_path_factory, tiny_model), tmp_path / "run")
    make_read_only(run, monkeypatch)
    before = files(run)
    try:
        assert main(["status", str(run)]) == 0
    finally:
        run.chmod(0o755)
    out, err = capsys.readouterr()
    assert "state    finished" in out and "12 / 12" in out and "step-4" in out and "plot " not in out
    [line] = [ln for ln in err.splitlines() if "training_plot.png" in ln]
    assert "cannot write" in line and os.strerror(errno.EROFS if os.geteuid() == 0 else errno.EACCES) in line
    assert files(run) == before
