"""Issue 15: the seeded corruption campaign. Hundreds of mutations of the newest checkpoint's content
and manifest; after each, `train` runs to completion with no traceback, the damaged checkpoint is
set aside or skipped, and the final adapter is byte-identical to an uninterrupted run's.

Fast by construction: the reference and an interrupted run (killed as the final commit began) are
made once; each mutation damages a copy of that folder and re-runs in a forked child (~1 s).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import time
from pathlib import Path

import pytest
from conftest import chat_rows, make_config, write_jsonl

from relaytune.atomic import MANIFEST
from relaytune.checkpoint.store import verify_checkpoint

SEED = int(os.environ.get("RELAYTUNE_CAMPAIGN_SEED", "1515"))
COUNT = int(os.environ.get("RELAYTUNE_CAMPAIGN_COUNT", "210"))
SETTINGS = dict(max_steps=4, save_steps=1, lora_dropout=0.1, lora_r=4, logging_steps=1, save_every_seconds=0,
                per_device_train_batch_size=4, gradient_accumulation_steps=1)
VICTIM = "step-3"
CONTENT = ("adapter_model.safetensors", "adapter_config.json", "optimizer.safetensors", "rng.safetensors",
           "trainer_state.json", "metrics.jsonl")
SAFETENSORS = ("adapter_model.safetensors", "optimizer.safetensors", "rng.safetensors")


def _manifest(folder: Path) -> dict:
    return json.loads((folder / MANIFEST).read_text())


def _write_manifest(folder: Path, m) -> None:
    (folder / MANIFEST).write_text(json.dumps(m))


def _rehash(folder: Path, name: str) -> None:
    data = (folder / name).read_bytes()
    m = _manifest(folder)
    m["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    _write_manifest(folder, m)


def _flip(data: bytes, rng: random.Random) -> bytes:
    if not data:
        return b"\x01"
    out = bytearray(data)
    bit = rng.randrange(len(out) * 8)
    out[bit // 8] ^= 1 << (bit % 8)
    return bytes(out)


def _header_edit(data: bytes, rng: random.Random) -> bytes:
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    key = rng.choice([k for k in header if k != "__metadata__"])
    how = rng.choice(["shape", "dtype", "offsets", "drop", "length"])
    if how == "length":
        return (n + rng.choice([-7, 1, 1000])).to_bytes(8, "little") + data[8:]
    if how == "shape":
        header[key]["shape"] = [d + 1 for d in header[key]["shape"]] or [2]
    elif how == "dtype":
        header[key]["dtype"] = rng.choice(["F16", "I64", "BOOL", "X9"])
    elif how == "offsets":
        a, b = header[key]["data_offsets"]
        header[key]["data_offsets"] = [a, b + rng.choice([-4, 4, 10**9])]
    else:
        del header[key]
    body = json.dumps(header).encode()
    return len(body).to_bytes(8, "little") + body + data[8 + n:]


def _json_shape_edit(data: bytes, rng: random.Random) -> bytes:
    doc = json.loads(data)
    if not isinstance(doc, dict) or not doc:
        return b"[]"
    key = rng.choice(sorted(doc))
    how = rng.choice(["null", "string", "drop", "list"])
    if how == "null":
        doc[key] = None
    elif how == "string":
        doc[key] = "x"
    elif how == "drop":
        del doc[key]
    else:
        doc[key] = [doc[key]]
    return json.dumps(doc).encode()


def mutate(folder: Path, rng: random.Random) -> str:
    """Apply one seeded mutation to a checkpoint folder; return its description."""
    kind = rng.choice(["flip", "truncate", "zero", "delete", "empty", "extra", "header", "manifest",
                       "manifest_flip", "rehash", "files_empty"])
    name = rng.choice(CONTENT)
    path = folder / name
    data = path.read_bytes()
    if kind == "flip":
        path.write_bytes(_flip(data, rng))
    elif kind == "truncate":
        path.write_bytes(data[:rng.randrange(len(data))] if data else b"")
        if not data:
            path.write_bytes(b"x")
    elif kind == "zero":
        a = rng.randrange(max(1, len(data)))
        b = min(len(data), a + rng.randint(1, 64))
        path.write_bytes(data[:a] + b"\0" * max(1, b - a) + data[b:])
    elif kind == "delete":
        path.unlink()
    elif kind == "empty":
        path.write_bytes(b"" if data else b"\n")
    elif kind == "extra":
        extra = rng.choice(["notes.txt", "model.safetensors", "optimizer.pt", ".hidden"])
        (folder / extra).write_bytes(b"extra")
        if rng.random() < 0.5:  # listed in the manifest too, with a matching hash
            _rehash(folder, extra)
        name = extra
    elif kind == "header":
        name = rng.choice(SAFETENSORS)
        (folder / name).write_bytes(_header_edit((folder / name).read_bytes(), rng))
        if rng.random() < 0.7:
            _rehash(folder, name)
    elif kind == "manifest":
        m = _manifest(folder)
        entry = rng.choice(sorted(m["files"]))
        edits = [
            lambda: m.update(files=None),
            lambda: m["files"].update({entry: None}),
            lambda: m["files"][entry].update(bytes=m["files"][entry].pop("size")),
            lambda: m["files"][entry].update(sha=m["files"][entry].pop("sha256")),
            lambda: m["files"][entry].update(size=str(m["files"][entry]["size"])),
            lambda: m["files"][entry].update(sha256=m["files"][entry]["sha256"].upper()),
            lambda: m["files"].pop(entry),
            lambda: m.update(step=m["step"] + 1),
            lambda: m.update(step=None),
            lambda: m.update(format="relaytune-checkpoint/2"),
            lambda: m.pop("created"),
            lambda: m["files"].update({"../evil": m["files"][entry]}),
        ]
        i = rng.randrange(len(edits))
        edits[i]()
        _write_manifest(folder, m)
        return f"manifest edit {i} ({entry})"
    elif kind == "manifest_flip":
        p = folder / MANIFEST
        p.write_bytes(_flip(p.read_bytes(), rng))
        return "manifest bit flip"
    elif kind == "rehash":  # damaged content whose hash was rewritten to match
        how = rng.choice(["truncate", "empty", "json", "header", "garbage"])
        if how == "truncate":
            path.write_bytes(data[:rng.randrange(max(1, len(data)))])
        elif how == "empty":
            path.write_bytes(b"")
        elif how == "garbage":
            path.write_bytes(b"\x00garbage\xff" * rng.randint(1, 10))
        elif how == "json" and name.endswith(".json"):
            path.write_bytes(_json_shape_edit(data, rng))
        elif name in SAFETENSORS:
            path.write_bytes(_header_edit(data, rng))
        else:
            path.write_bytes(b'{"step": "x"}\n' if name == "metrics.jsonl" else b"null")
        _rehash(folder, name)
        return f"rehash {how} {name}"
    else:
        m = _manifest(folder)
        m["files"] = {}
        _write_manifest(folder, m)
        return "files map emptied"
    return f"{kind} {name}"


@pytest.mark.slow
def test_seeded_corruption_campaign(tmp_path, tiny_model, fork_cli):
    t0 = time.monotonic()
    data = write_jsonl(tmp_path / "data.jsonl", chat_rows(16, seed=15))
    ref_cfg = make_config(tmp_path / "ref", tiny_model, data, **SETTINGS)
    assert fork_cli.run("train", str(ref_cfg)).returncode == 0
    reference = (tmp_path / "ref/run/final/adapter_model.safetensors").read_bytes()
    cut_cfg = make_config(tmp_path / "cut", tiny_model, data, **SETTINGS)
    r = fork_cli.run("train", str(cut_cfg), env={"RELAYTUNE_CRASH_AT": "save:begin:4"})  # the final commit
    template = tmp_path / "cut/run"
    assert r.returncode == -9 and verify_checkpoint(template / "checkpoints" / VICTIM) is None, r.stderr[-2000:]

    rng = random.Random(SEED)
    cfg = make_config(tmp_path / "m", tiny_model, data, **SETTINGS)
    run = tmp_path / "m/run"
    detected = harmless = 0
    for i in range(COUNT):
        shutil.rmtree(run, ignore_errors=True)
        shutil.copytree(template, run)
        victim = run / "checkpoints" / VICTIM
        what = mutate(victim, rng)
        damaged = verify_checkpoint(victim) is not None
        r = fork_cli.run("train", str(cfg), timeout=120)
        label = f"mutation {i} (seed {SEED}): {what}"
        assert r.returncode == 0, f"{label}\n{r.stderr[-3000:]}"
        assert "Traceback" not in r.stderr, f"{label}\n{r.stderr[-3000:]}"
        assert (run / "final/adapter_model.safetensors").read_bytes() == reference, label
        names = sorted(p.name for p in (run / "checkpoints").iterdir())
        aside = [n for n in names if n.startswith(f"{VICTIM}.invalid-")]
        said = f"skipped checkpoint {VICTIM}" in r.stderr or f"{VICTIM} cannot be restored" in r.stderr
        if aside or said:
            detected += 1
            assert said, f"{label}: set aside without saying why\n{r.stderr[-2000:]}"
        else:
            # Not detected: only a mutation that left a checkpoint fit to continue from (e.g. a flipped
            # digit of the manifest's `created` time) may pass, and the run must have used it.
            assert not damaged and f"continuing from {VICTIM}" in r.stderr, f"{label}: not set aside\n{names}"
            harmless += 1
    took = time.monotonic() - t0
    print(f"\ncorruption campaign: {COUNT} mutations, seed {SEED}: {detected} set aside or skipped, "
          f"{harmless} harmless (checkpoint still intact), all byte-identical; {took:.0f} s")
    assert detected + harmless == COUNT and detected >= COUNT * 0.9
