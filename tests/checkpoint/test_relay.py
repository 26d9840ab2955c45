"""The relay (issue 13 item 2): a run continues another run folder's state, read only, with no
path typed on Kaggle, ends byte-identical to an uninterrupted run, and does not tokenize again."""

from __future__ import annotations

import hashlib
import os
import signal
from pathlib import Path

import pytest
from conftest import chat_rows, make_config, write_jsonl
from support.gate import Gate, stderr_says, wait_for

from relaytune.checkpoint.resume import find_relay
from relaytune.config import load_config

STEPS = 30
SETTINGS = {"max_steps": STEPS, "save_steps": 1000, "lora_dropout": 0.1}
KAGGLE = {"KAGGLE_KERNEL_RUN_TYPE": "Batch"}


def _tree_hash(root: Path) -> str:
    """Names, contents and modification times of everything under `root`."""
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        h.update(f"{p.relative_to(root)}|{st.st_mode}|{st.st_mtime_ns}".encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def stopped(tmp_path_factory, tiny_model, fork_cli):
    """(data, the input root holding run A stopped by SIGTERM, the reference final adapter)."""
    tmp = tmp_path_factory.mktemp("relay")
    data = write_jsonl(tmp / "data.jsonl", chat_rows(64))
    ref = fork_cli.run("train", str(make_config(tmp / "ref", tiny_model, data, **SETTINGS)))
    assert ref.returncode == 0, ref.stderr
    inputs = tmp / "input"
    cfg_a = make_config(inputs / "my-notebook", tiny_model, data, **SETTINGS)  # run A: input/my-notebook/run
    run_a = inputs / "my-notebook" / "run"
    gate = Gate(tmp, 6)
    child = fork_cli.start("train", str(cfg_a), env=gate.env)
    gate.wait_reached(child.pid)
    os.kill(child.pid, signal.SIGTERM)
    wait_for(stderr_says(child, "SIGTERM received"), child.pid)
    gate.open()
    result = child.wait(120)
    assert result.returncode == 75, result.stderr
    assert not (run_a / "final").exists()
    (inputs / "my-notebook" / "config.yaml").unlink()  # Kaggle's output holds the run folder only
    return data, inputs, (tmp / "ref/run/final/adapter_model.safetensors").read_bytes()


def test_kaggle_continues_an_input_run_read_only_exactly_without_tokenizing(stopped, tmp_path, tiny_model,
                                                                           fork_cli):
    data, inputs, ref = stopped
    run_a = inputs / "my-notebook" / "run"
    before = _tree_hash(inputs)
    cfg_b = make_config(tmp_path, tiny_model, data, **SETTINGS)  # an empty output_dir B, nothing typed
    r = fork_cli.run("train", str(cfg_b), env={**KAGGLE, "RELAYTUNE_KAGGLE_INPUT": str(inputs)})
    assert r.returncode == 0, r.stderr
    assert f"continuing from {run_a / 'checkpoints'}" in r.stderr
    assert "tokenizing the data" not in r.stderr  # zero tokenizer calls: the source's cache was used
    assert "loaded from the cache of the run this one continues" in r.stderr
    assert (tmp_path / "run/final/adapter_model.safetensors").read_bytes() == ref
    assert _tree_hash(inputs) == before  # nothing written into, or beside, the source
    assert any((tmp_path / "run/data-cache").iterdir())  # the cache now lives in B too
    # B's next session continues B itself (its own final/), never the source again
    again = fork_cli.run("train", str(cfg_b), env={**KAGGLE, "RELAYTUNE_KAGGLE_INPUT": str(inputs)})
    assert again.returncode == 0 and "nothing to do" in again.stderr


def test_explicit_run_folder_outside_kaggle(stopped, tmp_path, tiny_model, fork_cli):
    data, inputs, ref = stopped
    run_a = inputs / "my-notebook" / "run"
    before = _tree_hash(inputs)
    cfg_b = make_config(tmp_path, tiny_model, data, resume_from_checkpoint=str(run_a), **SETTINGS)
    r = fork_cli.run("train", str(cfg_b), env={"RELAYTUNE_KAGGLE_INPUT": str(inputs)})
    assert r.returncode == 0, r.stderr
    assert f"continuing from {run_a / 'checkpoints'}" in r.stderr and "tokenizing the data" not in r.stderr
    assert (tmp_path / "run/final/adapter_model.safetensors").read_bytes() == ref
    assert _tree_hash(inputs) == before


def test_a_mismatch_says_what_differs_and_starts_fresh(stopped, tmp_path, tiny_model, capsys):
    data, inputs, _ = stopped
    cfg = load_config(str(make_config(tmp_path, tiny_model, data, **{**SETTINGS, "learning_rate": 5e-4})))
    assert find_relay(cfg, inputs) is None
    err = capsys.readouterr().err
    assert "`learning_rate`: 0.001 -> 0.0005" in err and "starting from the beginning" in err
    same = load_config(str(make_config(tmp_path / "same", tiny_model, data, **SETTINGS)))
    relay = find_relay(same, inputs)
    assert relay is not None and relay.pick("another fingerprint") is None  # other data: fresh, with why
    assert "the training data differs" in capsys.readouterr().err


def test_explicit_mismatch_is_refused_with_the_difference(stopped, tmp_path, tiny_model, fork_cli):
    data, inputs, _ = stopped
    cfg_b = make_config(tmp_path, tiny_model, data, resume_from_checkpoint=str(inputs / "my-notebook/run"),
                        **{**SETTINGS, "lora_r": 4})
    r = fork_cli.run("train", str(cfg_b))
    assert r.returncode == 2 and "`lora_r`" in r.stderr, r.stderr
