"""Issue 15 item 4: every JSONL (and JSON) file relaytune reads back survives a torn tail: a truncated
last line (a kill mid-write) or NUL padding (a crashed filesystem). The reader drops the tail with a
notice naming the file and line, never crashes, and the next append never glues onto the torn bytes."""

from __future__ import annotations

import json

import pytest
from conftest import chat_rows, make_config, run_until_done, write_jsonl
from support.trained_run import copy_run, finished_run

from relaytune.commands.status import format_status, run_status
from relaytune.data.read import read_file
from relaytune.observe.metrics import MetricsLog, SessionLog, parse_records, read_metrics
from relaytune.observe.progress import read_progress

RECORDS = [{"step": 1, "loss": 2.0, "learning_rate": 1e-3}, {"step": 2, "loss": 1.5, "learning_rate": 1e-3}]
TORN = {
    "truncated": lambda good: good + b'{"step": 3, "loss": 1.2, "lea',
    "nul_padded": lambda good: good + b"\0" * 4096,
    "nul_in_last_line": lambda good: good + b'{"step": 3, "lo' + b"\0" * 64,
}


def _good(records) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in records).encode()


@pytest.mark.parametrize("damage", sorted(TORN))
def test_metrics_readers_drop_a_torn_tail_with_a_notice(tmp_path, capsys, damage):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(TORN[damage](_good(RECORDS)))
    assert read_metrics(path) == RECORDS
    err = capsys.readouterr().err
    assert f"{path}: line 3 is torn" in err
    assert parse_records(path.read_bytes().decode("utf-8", "replace")) == RECORDS
    log = MetricsLog(path)
    assert log.text() == _good(RECORDS).decode()
    log.write({"step": 3, "loss": 1.1})  # rewrites the file without the torn bytes, then carries on
    assert path.read_bytes() == _good(RECORDS + [{"step": 3, "loss": 1.1}])
    log.reset_to(TORN[damage](_good(RECORDS)).decode("utf-8"))  # a torn copy: dropped as well
    assert path.read_bytes() == _good(RECORDS)


@pytest.mark.parametrize("damage", sorted(TORN))
def test_sessions_log_counts_and_appends_past_a_torn_tail(tmp_path, capsys, damage):
    path = tmp_path / "sessions.jsonl"
    good = _good([{"session": 1, "event": "start", "from_step": 0}, {"session": 1, "event": "end", "how": "signal"},
                  {"session": 2, "event": "start", "from_step": 4}])
    path.write_bytes(TORN[damage](good))
    log = SessionLog(path)  # crashed with JSONDecodeError before
    assert log.session == 3
    assert "sessions.jsonl: line 4 is torn" in capsys.readouterr().err
    log.start(from_step=8, total_steps=12)
    records = [json.loads(line) for line in path.read_text().splitlines()]  # every line parses
    assert [(r["session"], r["event"]) for r in records] == [(1, "start"), (1, "end"), (2, "start"), (3, "start")]


def test_sessions_append_starts_on_a_new_line_when_the_file_cannot_be_rewritten(tmp_path, monkeypatch):
    path = tmp_path / "sessions.jsonl"
    path.write_bytes(b'{"session": 1, "event": "start"}\n{"session": 1, "ev')
    from relaytune import atomic

    def refuse(*a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(atomic, "replace_file", refuse)
    log = SessionLog(path)
    log.start(from_step=0, total_steps=4)
    lines = path.read_text().splitlines()
    assert json.loads(lines[-1])["session"] == 2 and lines[-2] == '{"session": 1, "ev'


@pytest.mark.parametrize("damage", ["truncated", "nul_padded"])
def test_progress_file_torn_or_padded(tmp_path, capsys, damage):
    good = json.dumps({"1": {"step": 7, "time": 1.0}}, indent=1).encode()
    (tmp_path / "progress.json").write_bytes(good[:-5] if damage == "truncated" else good + b"\0" * 512)
    got = read_progress(tmp_path)
    assert got == ({} if damage == "truncated" else {"1": {"step": 7, "time": 1.0}})
    assert f"{tmp_path / 'progress.json'}: " in capsys.readouterr().err


def test_status_reads_torn_logs_and_caches(tmp_path_factory, tiny_model, tmp_path, capsys):
    run = copy_run(finished_run(tmp_path_factory, tiny_model), tmp_path / "run")
    for name in ("metrics.jsonl", "sessions.jsonl"):
        (run / name).write_bytes((run / name).read_bytes() + b'{"step": 99, "lo' + b"\0" * 100)
    (run / "progress.json").write_bytes((run / "progress.json").read_bytes() + b"\0" * 100)
    (run / "eval_cache.json").write_bytes(b'{"version": 1, "entries": {"ab' + b"\0" * 50)
    (run / "quarantine.jsonl").write_bytes(b'{"where": "x:1", "rea')
    st = run_status(run, plot=False)
    assert st.state == "finished" and st.step == 12 and [s.how for s in st.sessions] == ["finished"]
    assert "12 / 12" in format_status(st)
    err = capsys.readouterr().err
    assert "metrics.jsonl: line" in err and "sessions.jsonl: line" in err and "Traceback" not in err


def test_a_torn_sessions_log_does_not_stop_a_resumed_train(tmp_path, tiny_model, fork_cli):
    data = write_jsonl(tmp_path / "data.jsonl", chat_rows())
    cfg = make_config(tmp_path, tiny_model, data, max_steps=8)
    killed = fork_cli.run("train", str(cfg), env={"RELAYTUNE_CRASH_AT": "step:end:6"})  # a kill at step 6
    assert killed.returncode == -9, killed.stderr[-2000:]
    run = tmp_path / "run"
    for name in ("sessions.jsonl", "metrics.jsonl"):
        (run / name).write_bytes((run / name).read_bytes() + b'{"session": 9, "eve' + b"\0" * 300)
    (run / "progress.json").write_bytes((run / "progress.json").read_bytes() + b"\0" * 300)
    results = run_until_done(fork_cli, cfg, limit=2)
    err = results[-1].stderr
    assert "Traceback" not in err, err[-3000:]
    assert "sessions.jsonl: line 2 is torn" in err
    records = [json.loads(line) for line in (run / "sessions.jsonl").read_text().splitlines()]
    assert [(r["session"], r["event"]) for r in records] == [(1, "start"), (2, "start"), (2, "end")]
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(steps) and steps[-1] == 8


def test_quarantine_list_is_rewritten_whole(tmp_path):
    """quarantine.jsonl is never read back by relaytune: each run replaces it whole (atomically), so a
    torn one from a crash is simply replaced; its lines stay readable by the data reader itself."""
    from relaytune.config.loader import load_config
    from relaytune.data import prepare_data
    from relaytune.tiny import make_tokenizer

    data = write_jsonl(tmp_path / "data.jsonl", chat_rows(99) + [{"nope": 1}])
    run = tmp_path / "run"
    run.mkdir()
    (run / "quarantine.jsonl").write_bytes(b'{"where": "old:1", "reason": "x"}\n{"wh' + b"\0" * 40)
    prepare_data(load_config({"dataset": str(data), "output_dir": str(run), "max_bad_fraction": 0.05}),
                 make_tokenizer())
    rows = [json.loads(line) for line in (run / "quarantine.jsonl").read_text().splitlines()]
    assert rows == [{"where": f"{data}:100", "reason": "`messages` is missing"}]
    assert [r.origin for r in read_file(run / "quarantine.jsonl")] == [f"{run / 'quarantine.jsonl'}:1"]
