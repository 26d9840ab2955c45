"""Platform detection, time budgets and storage warnings, with the environment faked."""

from __future__ import annotations

from pathlib import Path

import pytest

from relaytune.config.loader import load_config
from relaytune.errors import UserError
from relaytune.training.environment import platform, storage_warnings, time_budget

NOW = 1_800_000_000.0


def cfg(**kw):
    return load_config({"dataset": "d.jsonl", "output_dir": "out", **kw})


def test_platforms_are_recognised():
    assert platform({"KAGGLE_KERNEL_RUN_TYPE": "Interactive"}) == "kaggle"
    assert platform({"COLAB_RELEASE_TAG": "release-colab_2026"}) == "colab"
    assert platform({"SLURM_JOB_ID": "42"}) == "slurm"
    assert platform({}) == "local"


def test_kaggle_warns_outside_kaggle_working():
    env = {"KAGGLE_KERNEL_RUN_TYPE": "Interactive"}
    [message] = storage_warnings(Path("/tmp/outputs"), env)
    assert "output_dir is /tmp/outputs, outside /kaggle/working" in message
    assert "output_dir: /kaggle/working/run" in message
    assert storage_warnings(Path("/kaggle/working/outputs"), env) == []


def test_relative_output_dir_is_reported_as_its_absolute_path(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    [message] = storage_warnings(Path("outputs"), {"KAGGLE_URL_BASE": "https://kaggle"})
    assert f"output_dir is {tmp_path / 'outputs'}" in message


def test_colab_suggests_the_drive_mount():
    env = {"COLAB_RELEASE_TAG": "x"}
    [message] = storage_warnings(Path("/content/run"), env)
    assert "drive.mount('/content/drive')" in message and "/content/drive/MyDrive/run" in message
    assert storage_warnings(Path("/content/drive/MyDrive/run"), env) == []


def test_no_warning_on_a_plain_machine():
    assert storage_warnings(Path("/tmp/x"), {}) == []


def test_time_limit_budget():
    budget = time_budget(cfg(time_limit="11h30m"), env={}, now=NOW)
    assert budget.end == NOW + 11.5 * 3600 and budget.source == "time_limit 11h30m"


def test_kaggle_session_limit_counts_from_the_session_start():
    budget = time_budget(cfg(), env={"KAGGLE_KERNEL_RUN_TYPE": "Batch"}, now=NOW, session_start=NOW - 3600)
    assert budget.end == NOW + 11 * 3600 and "Kaggle" in budget.source


def test_slurm_end_time_from_the_environment():
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_END_TIME": str(int(NOW + 600))}
    budget = time_budget(cfg(time_limit="2h"), env=env, now=NOW)
    assert budget.end == NOW + 600 and budget.source == "SLURM job 7 time limit"


def test_the_earliest_limit_wins():
    # NOW is 2027-01-15T08:00:00Z; the deadline is two hours later.
    budget = time_budget(cfg(time_limit="1h", deadline="2027-01-15T10:00:00Z"), env={}, now=NOW)
    assert (budget.end, budget.source) == (NOW + 3600, "time_limit 1h")
    late = time_budget(cfg(time_limit="3h", deadline="2027-01-15T10:00:00Z"), env={}, now=NOW)
    assert (late.end, late.source) == (NOW + 7200, "deadline 2027-01-15T10:00:00Z")


def test_no_limit():
    assert time_budget(cfg(), env={}, now=NOW).end is None


@pytest.mark.parametrize("key,value,expected", [
    ("time_limit", "soon", "is not a duration"),
    ("deadline", "tomorrow", "is not an ISO 8601 time"),
])
def test_bad_time_values_are_config_errors(key, value, expected):
    with pytest.raises(UserError) as e:
        cfg(**{key: value})
    assert f"`{key}`" in str(e.value) and expected in str(e.value)
