"""Issue 15 item 3: a manifest of the wrong shape, a file set that does not vouch for a checkpoint,
and a checkpoint that fails to restore are all set aside (never a crash), and the run falls back
to the previous one and still ends byte-identical."""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from conftest import chat_rows, make_config, write_jsonl

from relaytune.atomic import MANIFEST, verify
from relaytune.checkpoint.load import Damaged, apply, capture
from relaytune.checkpoint.store import CheckpointStore, verify_checkpoint

FILES = {"adapter_model.safetensors": b"w" * 300, "adapter_config.json": b"{}", "rng.safetensors": b"r" * 40,
         "trainer_state.json": b"{}", "metrics.jsonl": b""}


@pytest.fixture
def folder(tmp_path) -> Path:
    return CheckpointStore(tmp_path / "checkpoints").save(FILES, 4, {"config_hash": "ab", "versions": {"x": "1"}})


def _edit(folder: Path, fn) -> None:
    m = json.loads((folder / MANIFEST).read_text())
    fn(m)
    (folder / MANIFEST).write_text(json.dumps(m))


@pytest.mark.parametrize("edit", [
    lambda m: m.update(files=None),
    lambda m: m["files"].update({"rng.safetensors": None}),
    lambda m: m["files"]["rng.safetensors"].update(bytes=m["files"]["rng.safetensors"].pop("size")),
    lambda m: m["files"]["rng.safetensors"].update(sha=m["files"]["rng.safetensors"].pop("sha256")),
    lambda m: m["files"]["rng.safetensors"].update(size="40"),
    lambda m: m["files"]["rng.safetensors"].update(size=-1),
    lambda m: m["files"]["rng.safetensors"].update(sha256="XYZ"),
    lambda m: m["files"].update({"../../etc/passwd": m["files"]["rng.safetensors"]}),
    lambda m: m.update(step="4"),
    lambda m: m.pop("created"),
    lambda m: m.clear(),
], ids=["files-null", "entry-null", "size-renamed", "sha-renamed", "size-str", "size-negative", "sha-short",
        "escaping-name", "step-str", "no-created", "empty-object"])
def test_a_manifest_of_the_wrong_shape_is_a_reason_never_an_exception(folder, edit):
    _edit(folder, edit)
    reason = verify(folder)
    assert reason is not None and reason.startswith(("malformed manifest", "unknown format"))
    assert verify_checkpoint(folder) == reason


def test_every_single_bit_flip_of_a_manifest_is_a_reason_never_an_exception(folder):
    raw = (folder / MANIFEST).read_bytes()
    for i in range(len(raw) * 8):
        data = bytearray(raw)
        data[i // 8] ^= 1 << (i % 8)
        (folder / MANIFEST).write_bytes(bytes(data))
        reason = verify_checkpoint(folder)  # never raises; a flip may leave valid JSON that still vouches
        assert reason is None or isinstance(reason, str)


def test_an_empty_files_map_vouches_for_nothing(folder):
    _edit(folder, lambda m: m.update(files={}))
    assert verify(folder) is None  # a folder with no files is intact as a folder...
    assert verify_checkpoint(folder) == "the manifest does not list adapter_config.json"  # ...not as a checkpoint


def test_the_step_must_match_the_folder(folder):
    _edit(folder, lambda m: m.update(step=8))
    assert verify_checkpoint(folder) == "the manifest is for step 8, the folder for step 4"


def test_files_beside_the_manifest_must_be_listed(folder):
    (folder / "notes.txt").write_text("?")
    assert verify_checkpoint(folder) == "notes.txt is not in the manifest"


def test_a_failing_apply_puts_the_live_objects_back_exactly(tiny_model, one_thread):
    """Applying is all or nothing: the optimizer refuses the state after the adapter went in."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from relaytune.checkpoint.state import Live

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model), LoraConfig(r=4, lora_dropout=0.0))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    model(torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]])).loss.backward()
    opt.step()
    live = Live(model, opt, sched, None)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    bad = capture(live)
    bad.adapter = {k: v + 1 for k, v in bad.adapter.items()}
    bad.optimizer = {"state": {}, "param_groups": []}  # load_state_dict raises after the adapter is in
    rng = torch.get_rng_state()
    with pytest.raises(Damaged):
        apply(bad, live)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert len(opt.state) == len([p for p in model.parameters() if p.requires_grad])
    assert torch.equal(torch.get_rng_state(), rng)


# --- through the CLI ---------------------------------------------------------------------------

SETTINGS = dict(max_steps=8, save_steps=3, lora_dropout=0.1, lora_r=8, logging_steps=1, save_every_seconds=0)


@pytest.fixture(scope="module")
def stopped(tmp_path_factory, tiny_model, fork_cli):
    """(data, a run folder killed as the final commit began (step-3 and step-6 committed), reference bytes)."""
    tmp = tmp_path_factory.mktemp("restore-damage")
    data = write_jsonl(tmp / "data.jsonl", chat_rows(40, seed=5))
    ref = make_config(tmp / "ref", tiny_model, data, **SETTINGS)
    assert fork_cli.run("train", str(ref)).returncode == 0
    cfg = make_config(tmp / "cut", tiny_model, data, **SETTINGS)
    r = fork_cli.run("train", str(cfg), env={"RELAYTUNE_CRASH_AT": "save:begin:3"})
    assert r.returncode == -9 and verify(tmp / "cut/run/checkpoints/step-6") is None
    return data, tmp / "cut/run", (tmp / "ref/run/final/adapter_model.safetensors").read_bytes()


def _rehash(folder: Path, name: str) -> None:
    data = (folder / name).read_bytes()
    _edit(folder, lambda m: m["files"].update({name: {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}}))


def _header_edit(path: Path) -> None:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    key = next(k for k in header if k != "__metadata__")
    header[key]["shape"] = [d + 1 for d in header[key]["shape"]]
    body = json.dumps(header).encode().ljust(n)
    path.write_bytes(raw[:8] + body[:n] + raw[8 + n:] if len(body) == n else
                     len(body).to_bytes(8, "little") + body + raw[8 + n:])


DAMAGES = {
    "state-json-wrong-shape": ("trainer_state.json", lambda p: p.write_text(json.dumps(
        {**json.loads(p.read_text()), "progress": {"step": "four"}}))),
    "state-truncated": ("trainer_state.json", lambda p: p.write_bytes(p.read_bytes()[:100])),
    "adapter-header-edit": ("adapter_model.safetensors", _header_edit),
    "optimizer-truncated": ("optimizer.safetensors", lambda p: p.write_bytes(p.read_bytes()[:-64])),
    "rng-emptied": ("rng.safetensors", lambda p: p.write_bytes(b"")),
    "metrics-garbage": ("metrics.jsonl", lambda p: p.write_text("[1, 2]\n")),
    "files-map-emptied": (None, lambda folder: _edit(folder, lambda m: m.update(files={}))),
}


@pytest.mark.parametrize("name", sorted(DAMAGES))
def test_damage_whose_hash_was_rewritten_is_set_aside_and_the_run_ends_exact(name, stopped, tmp_path, tiny_model,
                                                                             fork_cli):
    data, template, reference = stopped
    cfg = make_config(tmp_path, tiny_model, data, **SETTINGS)
    run = tmp_path / "run"
    shutil.copytree(template, run)
    victim = run / "checkpoints" / "step-6"
    file, damage = DAMAGES[name]
    if file is None:
        damage(victim)
    else:
        damage(victim / file)
        _rehash(victim, file)
    r = fork_cli.run("train", str(cfg))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    assert (run / "final/adapter_model.safetensors").read_bytes() == reference
    aside = [p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step-6.invalid-")]
    assert len(aside) == 1, sorted(p.name for p in (run / "checkpoints").iterdir())
    assert "step-6" in r.stderr and ("cannot be restored" in r.stderr or "skipped checkpoint step-6" in r.stderr)


def test_random_bit_flips_of_the_manifest_never_crash_train(stopped, tmp_path, tiny_model, fork_cli):
    data, template, reference = stopped
    rng = random.Random(15)
    cfg = make_config(tmp_path, tiny_model, data, **SETTINGS)
    run = tmp_path / "run"
    for _ in range(3):
        shutil.rmtree(run, ignore_errors=True)
        shutil.copytree(template, run)
        m = run / "checkpoints/step-6" / MANIFEST
        raw = bytearray(m.read_bytes())
        bit = rng.randrange(len(raw) * 8)
        raw[bit // 8] ^= 1 << (bit % 8)
        m.write_bytes(bytes(raw))
        r = fork_cli.run("train", str(cfg))
        assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
        assert (run / "final/adapter_model.safetensors").read_bytes() == reference
