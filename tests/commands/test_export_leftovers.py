"""What a killed export leaves behind (its temp folder, the size of a merged model) is removed by the
next export into the same folder, and only that: a running export's folder and other names stay."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from support.trained_run import finished_run, one_thread

from relaytune import atomic
from relaytune.cli import main

PREFIX = f"{atomic.TMP_PREFIX}export-"

# Holds an export's temp folder as a running export does, in another process, until its stdin closes.
HOLDER = """
import sys
from relaytune import atomic
with atomic.held_tmp_folder(sys.argv[1], "export-live") as folder:
    (folder / "model.safetensors").write_bytes(b"x" * 1000)
    print(folder, flush=True)
    sys.stdin.read()
"""


@pytest.fixture
def run(tmp_path_factory, tiny_model):
    return finished_run(tmp_path_factory, tiny_model)  # export only reads the run


def _leftovers(parent):
    return sorted(p for p in parent.iterdir() if p.name.startswith(PREFIX))


@pytest.fixture
def live_export(tmp_path):
    """The temp folder of an export that is still writing, held by another process."""
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    folder = holder.stdout.readline().strip()
    assert folder, "the holder process did not start"
    yield holder, folder
    holder.stdin.close()
    holder.wait(30)


def test_a_killed_merge_export_is_cleaned_up_by_the_next_export(run, tmp_path, fork_cli, live_export, capsys):
    holder, live = live_export
    killed = fork_cli.run("export", str(run), "--merge", "--out", str(tmp_path / "exp_k"),
                          env={"RELAYTUNE_CRASH_AT": "export:mid_file:1"})  # writing the last file
    assert killed.returncode == -9, killed.stderr[-2000:]
    left = [p for p in _leftovers(tmp_path) if str(p) != live]
    assert len(left) == 1 and left[0].name.startswith(f"{PREFIX}exp_k-") and not (tmp_path / "exp_k").exists()
    assert (left[0] / "model.safetensors").is_file()  # the merged weights: what filled a Kaggle disk
    with one_thread():
        assert main(["export", str(run), "--out", str(tmp_path / "other")]) == 0  # another --out, same folder
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if "interrupted export" in ln]
    assert len(lines) == 1 and left[0].name in lines[0] and "MiB freed" in lines[0], err
    assert not left[0].exists() and (tmp_path / "other" / "adapter_model.safetensors").is_file()
    assert os.path.isdir(live) and os.listdir(live) == ["model.safetensors"]  # the running one's stays
    assert live not in err
    holder.stdin.close()
    holder.wait(30)
    assert _leftovers(tmp_path) == []  # the holder removed its own on leaving


def test_a_leftover_named_as_export_names_it_is_removed_by_an_export_to_the_same_out(run, tmp_path, capsys):
    """The tester's case: a folder an earlier version left (no lock at all) beside --out."""
    stale = atomic.tmp_path(tmp_path, "export-exp_k")
    (stale / "sub").mkdir(parents=True)
    (stale / "sub" / "model-00001-of-00002.safetensors").write_bytes(b"\0" * 4096)
    others = [tmp_path / f"{atomic.TMP_PREFIX}best-1234abcd", tmp_path / "exp_k-notes"]
    for p in others:
        p.mkdir()
        (p / "keep").write_text("not an export's")
    with one_thread():
        assert main(["export", str(run), "--out", str(tmp_path / "exp_k")]) == 0
    assert not stale.exists() and stale.name in capsys.readouterr().err
    assert all((p / "keep").is_file() for p in others)  # only `.relaytune-tmp-export-*` names are ours
    assert _leftovers(tmp_path) == []


def test_clean_stale_tmp_keeps_locked_and_newborn_folders(tmp_path):
    with atomic.held_tmp_folder(tmp_path, "export-a") as held:
        (held / "f").write_bytes(b"1")
        newborn = atomic.tmp_path(tmp_path, "export-b")
        newborn.mkdir()  # empty and just made: its maker may be about to lock it
        dead = atomic.tmp_path(tmp_path, "export-c")
        dead.mkdir()
        old = time.time() - 2 * atomic.NEWBORN_SECONDS
        os.utime(dead, (old, old))  # empty, but long unlocked: a kill right after mkdir
        removed, unsure = atomic.clean_stale_tmp(tmp_path, "export")
        assert [p for p, _ in removed] == [dead] and unsure == []
        assert held.is_dir() and newborn.is_dir()
    assert not held.exists()  # removed on leaving
