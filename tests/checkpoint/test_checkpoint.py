"""The checkpoint store: commit protocol, verification, recovery choices, retention, disk errors.

A folder is a checkpoint only once its manifest (sha256 and size of every file) is committed;
`verify` says why a folder is not one; `latest_valid` skips broken ones and says why; only our
own `.relaytune-tmp-*` folders are ever cleaned up. Ends with CLI runs: a corrupted newest
checkpoint, and a full disk during a save, both still end byte-identical.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
from pathlib import Path

import pytest
from conftest import chat_rows, make_config, step_records, write_jsonl

from relaytune import atomic, faults
from relaytune.atomic import MANIFEST, TMP_PREFIX, commit_folder, verify
from relaytune.checkpoint.store import CheckpointStore

FILES = {"adapter_model.safetensors": b"\x00\x01weights" * 100, "trainer_state.json": b'{"step": 1}',
         "rng.safetensors": b"rng" * 33, "adapter_config.json": b"{}", "metrics.jsonl": b""}


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tree_hashes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): sha(p) for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def store(tmp_path) -> CheckpointStore:
    return CheckpointStore(tmp_path / "checkpoints")


@pytest.fixture
def fresh_faults(monkeypatch):
    """Fault switches count occurrences per process: start this test from zero."""
    for name in ("RELAYTUNE_CRASH_AT", "RELAYTUNE_FAIL_AT"):
        monkeypatch.delenv(name, raising=False)
    faults.reset()
    yield monkeypatch
    faults.reset({})


def test_committed_folder_has_exactly_the_files_and_a_manifest(store, fresh_faults):
    path = store.save(FILES, 7, {"config_hash": "abc"})
    assert path == store.root / "step-7"
    assert sorted(p.name for p in path.iterdir()) == sorted([*FILES, MANIFEST])
    assert sorted(p.name for p in store.root.iterdir()) == ["step-7"], "no tmp folder is left"
    manifest = json.loads((path / MANIFEST).read_text())
    assert manifest["format"] == atomic.FORMAT
    assert manifest["step"] == 7 and manifest["config_hash"] == "abc"
    assert manifest["files"] == {name: {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
                                 for name, data in FILES.items()}
    for name, data in FILES.items():
        assert (path / name).read_bytes() == data
    assert verify(path) is None


@pytest.mark.parametrize("damage,reason", [
    ("truncate", "adapter_model.safetensors has 500 bytes, the manifest says 900"),
    ("flip", "adapter_model.safetensors does not match its sha256 (corrupted)"),
    ("no_manifest", "no manifest (an unfinished or foreign folder)"),
    ("missing", "missing file rng.safetensors"),
    ("bad_manifest", "unreadable manifest"),
])
def test_verify_names_what_is_wrong(store, fresh_faults, damage, reason):
    path = store.save(FILES, 3, {})
    target = path / "adapter_model.safetensors"
    if damage == "truncate":
        target.write_bytes(target.read_bytes()[:500])
    elif damage == "flip":
        data = bytearray(target.read_bytes())
        data[500] ^= 0x04
        target.write_bytes(bytes(data))
    elif damage == "no_manifest":
        (path / MANIFEST).unlink()
    elif damage == "missing":
        (path / "rng.safetensors").unlink()
    else:
        (path / MANIFEST).write_text('{"files": ')
    assert verify(path) == reason


def test_latest_valid_skips_broken_newer_checkpoints_and_says_why(store, fresh_faults):
    for step in (2, 4, 6, 8):
        store.save(FILES, step, {})
    data = bytearray((store.root / "step-8" / "trainer_state.json").read_bytes())
    data[0] ^= 1
    (store.root / "step-8" / "trainer_state.json").write_bytes(bytes(data))
    (store.root / "step-6" / MANIFEST).unlink()
    _, path, skipped = store.latest_valid()
    assert path == store.root / "step-4"
    assert skipped == ["step-8: trainer_state.json does not match its sha256 (corrupted)",
                       "step-6: no manifest (an unfinished or foreign folder)"]
    assert CheckpointStore(store.root.parent / "nothing").latest_valid() == (None, None, [])


def test_latest_valid_orders_by_number_not_by_name(store, fresh_faults):
    for step in (9, 10, 100):
        store.save(FILES, step, {})
    assert store.latest_valid() == (100, store.root / "step-100", [])


def test_startup_cleanup_removes_only_our_tmp_folders(store, fresh_faults, tmp_path, capsys):
    store.save(FILES, 4, {})
    ours = store.root / f"{TMP_PREFIX}step-8-1a2b3c4d"
    ours.mkdir()
    (ours / "adapter_model.safetensors").write_bytes(b"half")
    foreign = store.root / "my-notes"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("mine")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.txt").write_text("do not delete")
    link = store.root / f"{TMP_PREFIX}link"
    link.symlink_to(outside, target_is_directory=True)
    before = tree_hashes(store.root / "step-4")

    store.startup_cleanup()
    err = capsys.readouterr().err
    assert not ours.exists()
    assert f"removed an unfinished save of ours: {ours.name}" in err
    assert (foreign / "keep.txt").read_text() == "mine"
    assert f"{foreign} is not ours; leaving it alone" in err
    assert (outside / "precious.txt").read_text() == "do not delete", "a symlink is never followed"
    assert tree_hashes(store.root / "step-4") == before


def test_retention_keeps_newest_k_plus_protected_and_never_uncommitted(store, fresh_faults):
    (store.root / "step-1").mkdir(parents=True)  # not ours to delete: no manifest
    (store.root / "step-1" / "x").write_text("?")
    for step in range(2, 9):
        store.save(FILES, step, {})
        store.prune(2, protect={3})
    names = sorted((p.name for p in store.root.iterdir()), key=lambda n: int(n.split("-")[1]))
    assert names == ["step-1", "step-3", "step-7", "step-8"]
    assert (store.root / "step-1" / "x").read_text() == "?"
    store.prune(None)  # unset keeps everything
    assert len(list(store.root.iterdir())) == 4


def test_commit_over_an_existing_folder_sets_it_aside(store, fresh_faults):
    store.save(FILES, 5, {})
    (store.root / "step-5" / MANIFEST).unlink()  # broken
    store.save({"a": b"new"}, 5, {})
    names = sorted(p.name for p in store.root.iterdir())
    assert names[0] == "step-5" and names[1].startswith("step-5.invalid-") and len(names) == 2
    assert verify(store.root / "step-5") is None
    assert (store.root / names[1] / "adapter_model.safetensors").read_bytes() == FILES["adapter_model.safetensors"]


def test_enospc_mid_file_leaves_the_previous_checkpoint_intact(store, fresh_faults):
    store.save(FILES, 4, {})
    before = tree_hashes(store.root)
    fresh_faults.setenv("RELAYTUNE_FAIL_AT", "save:mid_file:1:28")
    faults.reset()
    with pytest.raises(OSError) as info:
        store.save({**FILES, "optimizer.safetensors": b"o" * 4096}, 8, {})
    assert info.value.errno == errno.ENOSPC
    assert "injected at save:mid_file, occurrence 1" in str(info.value)
    assert sorted(p.name for p in store.root.iterdir()) == ["step-4"], "no step-8, no tmp folder"
    assert tree_hashes(store.root) == before
    assert store.latest_valid() == (4, store.root / "step-4", [])


@pytest.mark.parametrize("point", ["save:begin", "save:mid_file", "save:before_manifest",
                                   "save:after_manifest", "save:before_rename"])
def test_any_failing_write_is_all_or_nothing(store, fresh_faults, point):
    """SQLite style: an I/O error (EIO) at each point of the commit leaves the old state."""
    store.save(FILES, 4, {})
    before = tree_hashes(store.root)
    for n in range(1, 4 if point == "save:mid_file" else 2):
        fresh_faults.setenv("RELAYTUNE_FAIL_AT", f"{point}:{n}:{errno.EIO}")
        faults.reset()
        with pytest.raises(OSError):
            store.save(FILES, 8, {})
        assert tree_hashes(store.root) == before
        assert sorted(p.name for p in store.root.iterdir()) == ["step-4"]
    fresh_faults.delenv("RELAYTUNE_FAIL_AT")
    store.save(FILES, 8, {})
    assert store.latest_valid() == (8, store.root / "step-8", [])


def test_final_folder_commit(tmp_path, fresh_faults):
    path = commit_folder({"adapter_model.safetensors": b"w", "adapter_config.json": b"{}"},
                         tmp_path / "final", {"kind": "final"})
    assert sorted(p.name for p in path.iterdir()) == ["adapter_config.json", "adapter_model.safetensors",
                                                      MANIFEST]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]


# --- through the CLI ---------------------------------------------------------------------------

SETTINGS = dict(max_steps=12, save_steps=4, save_total_limit=3, lora_dropout=0.1, lora_r=8,
                logging_steps=1, save_every_seconds=0)


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("ckdata") / "data.jsonl", chat_rows(40, seed=3))


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_model, data_file, fork_cli):
    tmp = tmp_path_factory.mktemp("ckref")
    r = fork_cli.run("train", str(make_config(tmp, tiny_model, data_file, **SETTINGS)))
    assert r.returncode == 0, r.stderr[-3000:]
    return tmp / "run"


def test_corrupted_newest_checkpoint_is_skipped_and_the_run_still_ends_exact(
        tmp_path, tiny_model, data_file, fork_cli, reference):
    cfg = make_config(tmp_path, tiny_model, data_file, **SETTINGS)
    run = tmp_path / "run"
    # Killed as the final commit begins: step-4 and step-8 are committed.
    r = fork_cli.run("train", str(cfg), env={"RELAYTUNE_CRASH_AT": "save:begin:3"})
    assert r.returncode == -9, r.stderr[-3000:]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-4", "step-8"]
    victim = run / "checkpoints" / "step-8" / "adapter_model.safetensors"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x10
    victim.write_bytes(bytes(data))
    corrupted = bytes(data)

    again = fork_cli.run("train", str(cfg))
    assert again.returncode == 0, again.stderr[-3000:]
    assert "skipped checkpoint step-8: adapter_model.safetensors does not match its sha256 (corrupted)" \
        in again.stderr
    assert "continuing from step-4 (the newest valid one)" in again.stderr
    assert (run / "final" / "adapter_model.safetensors").read_bytes() == \
        (reference / "final" / "adapter_model.safetensors").read_bytes()
    assert [x["step"] for x in step_records(run / "metrics.jsonl")] == list(range(1, 13))
    # The broken folder is kept aside, never deleted; a new step-8 was committed in its place.
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names[:2] == ["step-4", "step-8"] and names[2].startswith("step-8.invalid-") and len(names) == 3
    assert (run / "checkpoints" / names[2] / "adapter_model.safetensors").read_bytes() == corrupted
    assert verify(run / "checkpoints" / "step-8") is None


def test_disk_full_during_a_save_keeps_training_and_ends_exact(tmp_path, tiny_model, data_file, fork_cli,
                                                               reference):
    per_checkpoint = len(list((reference / "checkpoints" / "step-4").iterdir()))  # files incl. manifest
    cfg = make_config(tmp_path, tiny_model, data_file, **SETTINGS)
    run = tmp_path / "run"
    # ENOSPC in the 2nd file of the 2nd checkpoint (step 8).
    r = fork_cli.run("train", str(cfg), env={"RELAYTUNE_FAIL_AT": f"save:mid_file:{per_checkpoint + 2}:28"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "checkpoint at step 8 failed (the disk is full); the previous checkpoint is intact" in r.stderr
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-4"]
    assert (run / "final" / "adapter_model.safetensors").read_bytes() == \
        (reference / "final" / "adapter_model.safetensors").read_bytes()
    assert not list(run.rglob(f"{TMP_PREFIX}*"))


def test_checkpoint_layout_of_a_real_run(reference):
    ckpts = reference / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-4", "step-8"]
    for step in ("step-4", "step-8"):
        folder = ckpts / step
        names = {p.name for p in folder.iterdir()}
        assert {"adapter_config.json", "adapter_model.safetensors", "optimizer.safetensors",
                "rng.safetensors", "trainer_state.json", "metrics.jsonl", MANIFEST} <= names
        manifest = json.loads((folder / MANIFEST).read_text())
        assert set(manifest["files"]) == names - {MANIFEST}, "the manifest covers every file"
        assert manifest["step"] == int(step[5:])
        assert verify(folder) is None
        state = json.loads((folder / "trainer_state.json").read_text())
        assert state["progress"]["step"] == int(step[5:])
        assert not [n for n in names if n.endswith((".pt", ".pth", ".bin", ".pkl"))], "no pickle files"
    assert sorted(p.name for p in (reference / "final").iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors", MANIFEST]
    assert os.path.getsize(reference / "final" / "adapter_model.safetensors") > 0


def test_retention_never_deletes_the_newest_valid_checkpoint_for_a_corrupted_newer_one(store, fresh_faults,
                                                                                         tmp_path):
    """save_total_limit 1; step-8 got corrupted, so the run resumed from step-4 and (save_steps lowered
    to 3, a harmless change) commits step-6. Retention must leave a valid checkpoint to resume from."""
    from relaytune.checkpoint.saver import Saver
    from relaytune.config.schema import TrainConfig

    for step in (4, 8):
        store.save(FILES, step, {})
    victim = store.root / "step-8" / "adapter_model.safetensors"
    data = bytearray(victim.read_bytes())
    data[10] ^= 1
    victim.write_bytes(bytes(data))
    assert store.latest_valid()[:2] == (4, store.root / "step-4")
    cfg = TrainConfig(dataset="d.jsonl", output_dir=str(tmp_path), save_total_limit=1, save_steps=3)
    saver = Saver(cfg, store, "cafe")
    assert saver.save(lambda: dict(FILES), 6, wait=True) == store.root / "step-6"
    assert verify(store.root / "step-6") is None, "the checkpoint just committed was deleted"
    assert store.latest_valid()[:2] == (6, store.root / "step-6")
