"""A finished run explains itself (issue 14 item 5), and a run that fails before its first step leaves
no folder behind (issue 14 item 1)."""

from __future__ import annotations

import json

import pytest
from conftest import chat_rows, make_config, step_records, write_jsonl


@pytest.fixture(scope="module")
def finished(tmp_path_factory, tiny_model, fork_cli):
    tmp = tmp_path_factory.mktemp("finished")
    data = write_jsonl(tmp / "data.jsonl", chat_rows())
    cfg = make_config(tmp, tiny_model, data)  # 12 steps, a checkpoint every 4
    r = fork_cli.run("train", str(cfg))
    assert r.returncode == 0, r.stderr
    return tmp, cfg


def test_rerun_of_a_finished_run_does_nothing(finished, fork_cli):
    _, cfg = finished
    r = fork_cli.run("train", str(cfg))
    assert r.returncode == 0 and "nothing to do" in r.stderr


def test_fresh_on_a_finished_run_is_refused_with_the_reason(finished, fork_cli):
    tmp, cfg = finished
    r = fork_cli.run("train", str(cfg), "--fresh")
    assert r.returncode == 2, r.stderr
    assert "already holds a finished run" in r.stderr and "nothing to do" not in r.stderr
    assert f"output_dir={tmp / 'run-new'}" in r.stderr and "--fresh" in r.stderr


def test_a_longer_schedule_names_the_change_and_both_commands_and_the_first_works(finished, fork_cli):
    tmp, cfg = finished
    before = (tmp / "run/final/adapter_model.safetensors").read_bytes()
    r = fork_cli.run("train", str(cfg), "max_steps=16")
    assert r.returncode == 0, r.stderr
    err = " ".join(r.stderr.split())
    assert "nothing was trained" in err and "`max_steps`: 12 -> 16" in err
    longer = (f"relaytune train {cfg} max_steps=16 output_dir={tmp / 'run-continued'} "
              f"resume_from_checkpoint={tmp / 'run'}")
    assert longer in err and "exactness to a single run no longer applies" in err
    assert f"relaytune train {cfg} max_steps=16 output_dir={tmp / 'run-new'}" in err
    assert (tmp / "run/final/adapter_model.safetensors").read_bytes() == before  # untouched
    # the first option, exactly as printed, trains on from the last checkpoint to the new end
    args = longer.split()[2:]
    done = fork_cli.run("train", *args)
    assert done.returncode == 0, done.stderr
    said = " ".join(done.stderr.split())
    assert "new schedule" in said and "exactness to a single run no longer applies" in said
    steps = [r["step"] for r in step_records(tmp / "run-continued/metrics.jsonl")]
    assert steps[-1] == 16 and (tmp / "run-continued/final/adapter_model.safetensors").is_file()
    info = json.loads((tmp / "run-continued/final/manifest.json").read_text())["run"]
    assert info["config"]["max_steps"] == 16 and info["step"] == 16


def test_a_run_that_fails_before_its_first_step_leaves_no_folder(tmp_path, tiny_model, fork_cli):
    cfg = make_config(tmp_path, tiny_model, tmp_path / "missing.jsonl", output_dir=str(tmp_path / "a/b/run"))
    r = fork_cli.run("train", str(cfg))
    assert r.returncode == 2, r.stderr
    assert not (tmp_path / "a").exists()  # every folder this call created is gone again


def test_a_folder_that_existed_is_left_in_place(tmp_path, tiny_model, fork_cli):
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    cfg = make_config(tmp_path, tiny_model, tmp_path / "missing.jsonl")
    r = fork_cli.run("train", str(cfg))
    assert r.returncode == 2, r.stderr
    assert (out / "notes.txt").read_text() == "mine"
