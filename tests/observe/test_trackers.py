"""Trackers (`report_to`): continuous across kills and resumes, never fatal."""

from __future__ import annotations

import glob
import json
import struct
import sys
from pathlib import Path

import pytest
from conftest import chat_rows, make_config, write_jsonl

from relaytune.config.loader import load_config
from relaytune.errors import UserError
from relaytune.observe.metrics import MetricsLog
from relaytune.observe.progress import read_progress
from relaytune.observe.trackers import Trackers, open_trackers, public_config, scalars


def _cfg(out: Path, **kw):
    return load_config({"dataset": "x.jsonl", "output_dir": str(out), **kw})


def _tb_steps(logdir: Path, tag: str):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_report_to_values():
    assert _cfg(Path("o")).report_to == "none"
    assert _cfg(Path("o"), report_to="tensorboard,wandb").report_to == ["tensorboard", "wandb"]
    assert _cfg(Path("o"), report_to=["none"]).report_to == "none"
    assert _cfg(Path("o"), report_to="all").report_to == ["tensorboard", "wandb", "trackio", "mlflow"]
    with pytest.raises(UserError, match="unknown tracker 'tb'"):
        _cfg(Path("o"), report_to="tb")
    with pytest.raises(UserError, match="needs eval data"):
        _cfg(Path("o"), load_best_model_at_end=True)


def test_scalars_and_public_config():
    assert scalars({"step": 3, "loss": 1.5, "learning_rate": 1e-4, "grad_norm": None}) == \
        {"train/loss": 1.5, "train/learning_rate": 1e-4}
    assert scalars({"step": 4, "eval_loss": 2.0}) == {"eval/loss": 2.0}
    assert scalars({"step": 5, "event": "skipped_step", "loss": 9.0}) == {}
    # The config refuses such a URL; public_config strips it anyway, should one get through.
    cfg = _cfg(Path("o")).model_copy(update={"mirror_to": "s3://AKIA:secret@bucket/run?token=abc"})
    assert public_config(cfg)["mirror_to"] == "s3://bucket/run"


def test_metrics_log_fans_out_and_a_failing_tracker_never_raises(tmp_path, capsys):
    seen, rewound = [], []

    class Good:
        log, rewind = seen.append, rewound.append

    class Broken:
        def log(self, record):
            raise ConnectionError("tracker server down")

        rewind = log

    plain = MetricsLog(tmp_path / "plain.jsonl")  # the old constructor still works
    plain.write({"step": 1, "loss": 1.0})
    log = MetricsLog(tmp_path / "m.jsonl", sinks=[Trackers([Broken(), Good()])])
    for step in (1, 2, 3):
        log.write({"step": step, "loss": float(step)})
    log.reset_to('{"step": 1, "loss": 1.0}\n{"step": 2, "eval_loss": 2.0}\n')
    assert [r["step"] for r in seen] == [1, 2, 3] and rewound == [2]
    assert capsys.readouterr().err.count("tracker server down") == 1  # warned once, then quiet
    assert len((tmp_path / "m.jsonl").read_text().splitlines()) == 2


def test_tensorboard_purges_the_killed_sessions_tail(tmp_path):
    pytest.importorskip("tensorboard")
    cfg = _cfg(tmp_path, report_to="tensorboard")
    log = MetricsLog(tmp_path / "metrics.jsonl")
    log.reset_to("")
    first = open_trackers(cfg, tmp_path, 0, session=1)
    log.add_sink(first)
    for step in range(1, 11):  # session 1 logs 1..10, then is "killed" (never closed)
        log.write({"step": step, "loss": float(step)})
        if step % 4 == 0:
            log.write({"step": step, "eval_loss": step / 10})
    checkpoint_text = "".join(ln + "\n" for ln in log.text().splitlines() if json.loads(ln)["step"] <= 8)
    log = MetricsLog(tmp_path / "metrics.jsonl")
    log.reset_to(checkpoint_text)  # what a resume from step-8 does
    second = open_trackers(cfg, tmp_path, 8, session=2)
    log.add_sink(second)
    for step in range(9, 13):
        log.write({"step": step, "loss": 100.0 + step})
    log.reset_to(log.text())  # a NaN rollback to the current state: rewind(12), nothing dropped
    second.close()
    losses = _tb_steps(tmp_path / "tensorboard", "train/loss")
    assert [s for s, _ in losses] == list(range(1, 13))
    assert [v for _, v in losses] == [float(s) for s in range(1, 9)] + [100.0 + s for s in range(9, 13)]
    assert [s for s, _ in _tb_steps(tmp_path / "tensorboard", "eval/loss")] == [4, 8]
    progress = read_progress(tmp_path)
    assert progress["1"]["step"] == 10 and progress["2"]["from_step"] == 8 and progress["2"]["step"] == 12


def test_tracker_that_cannot_import_only_warns(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    trackers = open_trackers(_cfg(tmp_path, report_to="wandb"), tmp_path, 0, session=1)
    assert "pip install wandb" in capsys.readouterr().err
    assert isinstance(trackers, Trackers) and len(trackers.sinks) == 1  # the heartbeat only
    trackers.log({"step": 1, "loss": 1.0})
    trackers.close()


def test_wandb_without_network_falls_back_to_offline_and_resumes_by_id(tmp_path, monkeypatch, capsys):
    """A fake wandb module: online init fails as without network; the points are kept offline."""
    import types

    calls, logged = [], []

    class FakeRun:
        step = 0

        def log(self, values, step):
            logged.append(step)

        def finish(self):
            calls.append("finish")

    def init(**kw):
        calls.append(kw)
        if kw.get("mode") != "offline":
            raise TimeoutError("api.wandb.ai unreachable")
        return FakeRun()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2)))
    cfg = _cfg(tmp_path, report_to="wandb")
    trackers = open_trackers(cfg, tmp_path, 2, session=2)  # a resume at step 2 with no prior wandb run
    trackers.log({"step": 3, "loss": 0.5})
    trackers.close()
    assert "logging offline" in capsys.readouterr().err
    assert [c.get("mode") for c in calls[:2]] == [None, "offline"] and calls[-1] == "finish"
    assert calls[0]["id"] == calls[1]["id"] == json.loads((tmp_path / "wandb_run.json").read_text())["id"]
    assert calls[0]["resume"] == "allow"
    assert logged == [1, 2, 3]  # back-filled from metrics.jsonl, then continued
    again = open_trackers(cfg, tmp_path, 3, session=3)
    assert calls[-1]["id"] == calls[0]["id"]  # the next session resumes the same run
    again.close()


def _kill_and_resume(fork_cli, tmp_path, tiny_model, env: dict, **overrides):
    data = write_jsonl(tmp_path / "data.jsonl", chat_rows())
    cfg = make_config(tmp_path, tiny_model, data, max_steps=12, val_set_size=8, eval_steps=4, **overrides)
    env = {"OMP_NUM_THREADS": "1", **env}
    killed = fork_cli.run("train", str(cfg), env={**env, "RELAYTUNE_CRASH_AT": "step:end:10"})
    assert killed.returncode == -9, killed.stderr[-2000:]
    done = fork_cli.run("train", str(cfg), env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    run = tmp_path / "run"
    return run, [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]


def test_tensorboard_steps_continuous_across_kill_and_resume(tmp_path, tiny_model, fork_cli):
    pytest.importorskip("tensorboard")
    run, records = _kill_and_resume(fork_cli, tmp_path, tiny_model, {}, report_to="tensorboard")
    assert len(list((run / "tensorboard").glob("events.out.tfevents.*"))) == 2  # one log dir, two sessions
    losses = _tb_steps(run / "tensorboard", "train/loss")
    assert [s for s, _ in losses] == list(range(1, 13))  # each step once: none missing, none doubled
    logged = {r["step"]: r["loss"] for r in records if "loss" in r and "event" not in r}
    assert [v for _, v in losses] == pytest.approx([logged[s] for s in range(1, 13)], rel=1e-6)
    assert [s for s, _ in _tb_steps(run / "tensorboard", "eval/loss")] == [4, 8, 12]


def _wandb_history_steps(path: str) -> list[int]:
    """History steps in a .wandb file (LevelDB-style log of protobuf Records, 32 KiB blocks)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, block, buf, steps = Path(path).read_bytes(), 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += block - pos % block
            continue
        buf, pos = buf + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = pb.Record()
            record.ParseFromString(buf)
            buf = b""
            if record.HasField("history"):
                steps.append(record.history.step.num)
    return steps


@pytest.mark.slow  # about 12 s: two wandb service start-ups and shutdowns
def test_wandb_offline_continues_the_same_run(tmp_path, tiny_model, fork_cli):
    pytest.importorskip("wandb")
    run, _ = _kill_and_resume(fork_cli, tmp_path, tiny_model, {"WANDB_MODE": "offline", "WANDB_SILENT": "true"},
                              report_to="wandb")
    run_id = json.loads((run / "wandb_run.json").read_text())["id"]
    sessions = sorted(glob.glob(str(run / "wandb" / "offline-run-*")))
    assert len(sessions) == 2 and all(s.endswith(f"-{run_id}") for s in sessions)  # resumed, not restarted
    first, second = (_wandb_history_steps(glob.glob(f"{s}/*.wandb")[0]) for s in sessions)
    # A SIGKILL loses what wandb had not written yet (offline: typically all of it). Offline there
    # is no server to ask what the run holds, so the resumed session re-sends everything up to the
    # checkpoint and continues: it alone holds every step once; `wandb sync` drops the repeats.
    assert first == list(range(1, len(first) + 1)) and len(first) <= 10
    assert second == list(range(1, 13))
