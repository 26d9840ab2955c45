"""Issue 15 items 6-7 and issue 14 item 6 (data): caps on messages per row and bytes per line, the
`dataset_columns` advice, missing paths named absolutely, output_dir inside the dataset folder, and
a data cache in a read-only run folder."""

from __future__ import annotations

import csv
import json
import os
import stat
from types import SimpleNamespace

import pytest
from conftest import chat_rows, write_jsonl

from relaytune.config.loader import load_config
from relaytune.data import prepare_data
from relaytune.data import read as data_read
from relaytune.data.formats import MAX_MESSAGES
from relaytune.data.read import MAX_ROW_BYTES, read_rows
from relaytune.errors import UserError
from relaytune.tiny import make_tokenizer


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def _cfg(tmp_path, data, **kw):
    return load_config({"dataset": str(data), "output_dir": str(tmp_path / "run"), **kw})


def _quarantine(tmp_path):
    return [json.loads(line) for line in (tmp_path / "run" / "quarantine.jsonl").read_text().splitlines()]


def test_a_row_with_too_many_messages_is_quarantined_with_the_cap(tmp_path, tok):
    long = [{"role": "user" if i % 2 == 0 else "assistant", "content": "hi"} for i in range(MAX_MESSAGES + 2)]
    data = write_jsonl(tmp_path / "data.jsonl", chat_rows(99) + [{"messages": long}])
    prepared = prepare_data(_cfg(tmp_path, data, max_bad_fraction=0.05), tok)  # quick: never rendered
    assert len(prepared.train) == 99
    [row] = _quarantine(tmp_path)
    assert row["where"] == f"{data}:100"
    assert f"{MAX_MESSAGES + 2} messages, more than the 10,000" in row["reason"] and "quadratic" in row["reason"]


def test_a_line_over_the_byte_cap_is_quarantined_without_reading_it_whole(tmp_path, tok, monkeypatch):
    monkeypatch.setattr(data_read, "MAX_ROW_BYTES", 4096)
    data = tmp_path / "data.jsonl"
    big = json.dumps({"messages": [{"role": "user", "content": "x" * 50_000}, {"role": "assistant", "content": "y"}]})
    data.write_text("".join(json.dumps(r) + "\n" for r in chat_rows(50)) + big + "\n"
                    + "".join(json.dumps(r) + "\n" for r in chat_rows(49, seed=1)))
    rows = read_rows(str(data))
    assert len(rows) == 100 and rows[50].origin == f"{data}:51" and rows[51].origin == f"{data}:52"
    assert "the row is longer than the 4,096 bytes that relaytune reads per row" in rows[50].error
    assert all(r.error is None for i, r in enumerate(rows) if i != 50)
    prepared = prepare_data(_cfg(tmp_path, data, max_bad_fraction=0.05), tok)
    assert len(prepared.train) == 99 and _quarantine(tmp_path)[0]["where"] == f"{data}:51"
    assert MAX_ROW_BYTES == 10 * 2**20  # the real cap: generous for real data


def test_csv_row_over_the_byte_cap(tmp_path, monkeypatch):
    monkeypatch.setattr(data_read, "MAX_ROW_BYTES", 1000)
    path = tmp_path / "d.csv"
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerows([["instruction", "output"], ["a", "b"], ["x" * 2000, "y"], ["c", "d"]])
    rows = read_rows(str(path))
    assert [r.error is None for r in rows] == [True, False, True] and "per row" in rows[1].error


def test_unknown_columns_suggest_dataset_columns(tmp_path, tok):
    path = tmp_path / "qa.csv"
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["question", "answer"])
        w.writerows([[f"{a} plus {a}?", str(2 * a)] for a in range(200)])
    with pytest.raises(UserError) as e:
        prepare_data(_cfg(tmp_path, path), tok)
    msg = str(e.value)
    assert "200 of 200 rows are unusable" in msg
    assert "dataset_columns: {instruction: question, output: answer}" in msg
    assert "raise max_bad_fraction" not in msg
    prepared = prepare_data(_cfg(tmp_path, path, dataset_columns={"instruction": "question", "output": "answer"}), tok)
    assert len(prepared.train) == 200  # the advice works as given


def test_missing_dataset_names_the_absolute_path_and_the_folder(tmp_path, tok, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError) as e:
        read_rows("./nowhere/data.jsonl")
    msg = str(e.value)
    assert str(tmp_path / "nowhere" / "data.jsonl") in msg and f"working directory {tmp_path}" in msg
    with pytest.raises(UserError) as e:
        read_rows(str(tmp_path / "gone.jsonl"))
    assert f"{tmp_path / 'gone.jsonl'} does not exist" in str(e.value)


def test_missing_model_names_the_absolute_path(tmp_path, monkeypatch):
    from relaytune.model import resolve_source

    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError) as e:
        resolve_source(SimpleNamespace(model="./models/mine"))  # as a caller without config resolution
    msg = str(e.value)
    assert str(tmp_path / "models" / "mine") in msg and f"against the working directory {tmp_path}" in msg
    with pytest.raises(UserError) as e:
        resolve_source(load_config({"model": "./models/mine", "dataset": "x.jsonl", "output_dir": "run"}))
    assert f"{tmp_path / 'models' / 'mine'} does not exist" in str(e.value)


def test_output_dir_inside_the_dataset_folder_is_not_read_as_data(tmp_path, tok, capsys):
    folder = tmp_path / "data"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", chat_rows(40))
    cfg = load_config({"dataset": str(folder), "output_dir": str(folder / "run")})
    first = prepare_data(cfg, tok)
    run = folder / "run"
    write_jsonl(run / "metrics.jsonl", [{"step": 1, "loss": 2.0}])  # what a run leaves there
    write_jsonl(run / "sessions.jsonl", [{"session": 1, "event": "start"}])
    (run / "progress.json").write_text("{}")
    again = prepare_data(cfg, tok)  # read the run's own files as 2 bad rows of 42 before: exit 2
    assert len(again.train) == len(first.train) == 40 and again.fingerprint == first.fingerprint
    assert not (run / "quarantine.jsonl").exists()
    assert "tokenized data loaded from the cache" in capsys.readouterr().err  # same content key
    capsys.readouterr()
    prepare_data(cfg, tok)
    assert f"output_dir {run} lies inside the dataset folder {folder}" in capsys.readouterr().err


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores file permissions")
def test_read_only_run_folder_uses_an_intact_cache_and_deletes_nothing(tmp_path, tok, capsys):
    _read_only_case(tmp_path, tok, capsys)


def test_read_only_cache_simulated(tmp_path, tok, capsys, monkeypatch):
    """The same as root (which ignores permissions): every write into the run folder fails EROFS."""
    import relaytune.atomic as atomic

    data = write_jsonl(tmp_path / "data.jsonl", chat_rows(40))
    cfg = _cfg(tmp_path, data)
    first = prepare_data(cfg, tok)
    capsys.readouterr()
    cache = tmp_path / "run" / "data-cache"
    before = sorted(p.relative_to(cache) for p in cache.rglob("*"))

    def read_only(*a, **k):
        raise OSError(30, "Read-only file system")

    for name in ("remove_folder", "commit_folder", "replace_file"):
        monkeypatch.setattr(atomic, name, read_only)
    monkeypatch.setattr(os, "utime", read_only)
    again = prepare_data(cfg, tok)
    err = capsys.readouterr().err
    assert again.fingerprint == first.fingerprint and "damaged" not in err
    assert "loaded from the cache" in err
    assert sorted(p.relative_to(cache) for p in cache.rglob("*")) == before
    # a miss (other data) in a read-only folder: tokenized in memory, with a notice, nothing crashes
    write_jsonl(tmp_path / "data.jsonl", chat_rows(41))
    third = prepare_data(cfg, tok)
    assert len(third.train) == 41 and "could not write the data cache" in capsys.readouterr().err


def _read_only_case(tmp_path, tok, capsys):
    data = write_jsonl(tmp_path / "data.jsonl", chat_rows(40))
    cfg = _cfg(tmp_path, data)
    first = prepare_data(cfg, tok)
    capsys.readouterr()
    run = tmp_path / "run"
    folders = [run] + [p for p in run.rglob("*") if p.is_dir()]
    try:
        for p in folders:
            p.chmod(stat.S_IRUSR | stat.S_IXUSR)
        again = prepare_data(cfg, tok)
        err = capsys.readouterr().err
        assert again.fingerprint == first.fingerprint and "damaged" not in err
    finally:
        for p in folders:
            p.chmod(0o755)


def test_a_torn_cache_file_is_proved_bad_and_rebuilt(tmp_path, tok, capsys):
    """The data cache's JSON files are covered by its manifest: a truncated or NUL-padded one fails
    `atomic.verify`, so the entry is damaged beyond doubt and rebuilt; nothing crashes."""
    data = write_jsonl(tmp_path / "data.jsonl", chat_rows(40))
    cfg = _cfg(tmp_path, data)
    first = prepare_data(cfg, tok)
    [entry] = [p for p in (tmp_path / "run" / "data-cache").iterdir() if p.is_dir()]
    for damage in (lambda b: b[:-7], lambda b: b + b"\0" * 64):
        for name in ("table.json", "origins.json"):
            target = entry / name
            good = target.read_bytes()
            target.write_bytes(damage(good))
            capsys.readouterr()
            again = prepare_data(cfg, tok)
            assert again.fingerprint == first.fingerprint
            assert "is damaged" in capsys.readouterr().err
