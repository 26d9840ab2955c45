"""An output_dir that cannot be a run folder gets a message naming it and exit 2, never a traceback."""

from __future__ import annotations

import os

import pytest
from conftest import make_config


@pytest.mark.parametrize("layout", ["a file", "a symlink loop", "under an unwritable parent"])
def test_an_unusable_output_dir_is_exit_2_with_its_path(layout, tmp_path, tiny_model, chat_data, fork_cli):
    if layout == "a file":
        target = tmp_path / "taken"
        target.write_text("not a folder\n")
        expect = "is a file, not a folder"
    elif layout == "a symlink loop":
        os.symlink(tmp_path / "b", tmp_path / "a")
        os.symlink(tmp_path / "a", tmp_path / "b")
        target = tmp_path / "a" / "run"
        expect = "cannot be used"
    else:  # root may write anywhere on a normal filesystem; /proc refuses new folders even to root
        target = "/proc/relaytune-test/run"
        expect = "cannot create /proc/relaytune-test/run"
    cfg = make_config(tmp_path, tiny_model, chat_data, output_dir=str(target))
    r = fork_cli.run("train", str(cfg))
    assert r.returncode == 2, r.stderr[-2000:]
    assert "`output_dir`" in r.stderr and expect in r.stderr
    assert "Traceback" not in r.stderr
    if layout == "a file":
        assert target.read_text() == "not a folder\n", "nothing of the user's is touched"
