"""In-run recovery (issue 5): OOM steps down and redoes the step; NaNs are skipped,
repeated NaNs roll back with a lower learning rate; train() releases what it built."""

from __future__ import annotations

import gc
import json
import weakref

import pytest
import torch
from conftest import make_config
from safetensors.torch import load_file

import relaytune
import relaytune.training.trainer as trainer_module
from relaytune.errors import StoppedEarly
from relaytune.observe.metrics import read_metrics


def _steps(run):
    return [r for r in read_metrics(run / "metrics.jsonl") if "event" not in r and "loss" in r]


def _events(run, name):
    return [r for r in read_metrics(run / "metrics.jsonl") if r.get("event") == name]


def test_oom_halves_micro_batch_and_matches_a_run_configured_that_way(tmp_path, tiny_model, chat_data, fork_cli):
    # Global batch 8 both ways: micro-batch 8 x 1 hitting an OOM at step 3, and 4 x 2 from the start.
    base = dict(lora_dropout=0.0, per_device_train_batch_size=8, gradient_accumulation_steps=1)
    a = make_config(tmp_path / "a", tiny_model, chat_data, **base)
    b = make_config(tmp_path / "b", tiny_model, chat_data, lora_dropout=0.0,
                    per_device_train_batch_size=4, gradient_accumulation_steps=2)
    ra = fork_cli.run("train", str(a), env={"RELAYTUNE_OOM_AT": "3:0"})
    rb = fork_cli.run("train", str(b))
    assert ra.returncode == 0 and rb.returncode == 0, ra.stderr + rb.stderr
    assert "out of memory at micro-batch 8; redoing step 4 with micro-batch 4 x 2" in ra.stderr
    assert _events(tmp_path / "a" / "run", "oom") == [
        {"step": 3, "event": "oom", "micro_batch_size": 4, "was": 8}]
    state = json.loads((tmp_path / "a/run/checkpoints/step-4/trainer_state.json").read_text())
    assert state["recovery"]["micro_batch_size"] == 4 and state["recovery"]["accumulation"] == 2
    wa = load_file(tmp_path / "a/run/final/adapter_model.safetensors")
    wb = load_file(tmp_path / "b/run/final/adapter_model.safetensors")
    # Same rows, same maths; only the float summation order differs (micro-batches of 8
    # vs 2x4, padded to different widths), so equality holds to float32 rounding.
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-4, atol=1e-6)


def test_an_oom_that_gives_up_the_compiled_checkpoint_redoes_the_step_at_the_same_micro_batch(
        tmp_path, tiny_model, chat_data, monkeypatch, one_thread, capsys):
    """An OOM that free_memory answered by giving something up (here the compiled checkpoint, as on a
    GPU) redoes the step at the same micro-batch, from the same RNG state: its loss and those before the
    next OOM are a run's without the OOM, bit for bit, dropout included. Nothing left to give up, the
    next OOM halves."""
    real, released = trainer_module.free_memory, []

    def free_memory(optimizer, model=None):
        real(optimizer, model)
        released.append("compile_checkpoint")
        return released[-1:] if len(released) == 1 else []

    monkeypatch.setattr(trainer_module, "free_memory", free_memory)
    base = dict(lora_dropout=0.1, per_device_train_batch_size=4, gradient_accumulation_steps=2)
    plain = make_config(tmp_path / "plain", tiny_model, chat_data, **base)
    relaytune.train(str(plain))
    monkeypatch.setenv("RELAYTUNE_OOM_AT", "3:1,5:0")
    hit = make_config(tmp_path / "hit", tiny_model, chat_data, **base)
    relaytune.train(str(hit))
    err = capsys.readouterr().err
    assert "redoing step 4 at the same micro-batch 4 without compile_checkpoint" in err
    assert _events(tmp_path / "hit" / "run", "oom") == [
        {"step": 3, "event": "oom", "micro_batch_size": 4, "was": 4, "released": ["compile_checkpoint"]},
        {"step": 5, "event": "oom", "micro_batch_size": 2, "was": 4}]
    assert "out of memory at micro-batch 4; redoing step 6 with micro-batch 2 x 4" in err
    same = [(a["step"], a["loss"]) for a in _steps(tmp_path / "plain" / "run")][:5]
    assert [(b["step"], b["loss"]) for b in _steps(tmp_path / "hit" / "run")][:5] == same


def test_oom_at_micro_batch_one_saves_and_exits_75_with_advice(tmp_path, tiny_model, chat_data, fork_cli):
    cfg = make_config(tmp_path, tiny_model, chat_data, per_device_train_batch_size=1,
                      gradient_accumulation_steps=8)
    r = fork_cli.run("train", str(cfg), env={"RELAYTUNE_OOM_AT": "2:3"})
    assert r.returncode == 75, r.stderr
    assert "out of memory even at micro-batch 1" in r.stderr
    assert "a shorter max_seq_length" in r.stderr and "load_in_4bit: true" in r.stderr
    assert "gradient_checkpointing: true" in r.stderr
    assert "Traceback" not in r.stderr
    assert (tmp_path / "run/checkpoints/step-2/manifest.json").is_file()
    again = fork_cli.run("train", str(cfg))  # the fault fired once; the run continues from step 2
    assert again.returncode == 0, again.stderr
    assert "continuing from step-2" in again.stderr


def test_a_nan_step_is_skipped_and_logged(tmp_path, tiny_model, chat_data, fork_cli):
    cfg = make_config(tmp_path, tiny_model, chat_data)
    r = fork_cli.run("train", str(cfg), env={"RELAYTUNE_NAN_AT": "5"})
    assert r.returncode == 0, r.stderr
    skipped = _events(tmp_path / "run", "skipped_step")
    assert [s["step"] for s in skipped] == [6] and skipped[0]["loss"] is None
    assert _events(tmp_path / "run", "finished")[0]["skipped_steps"] == 1
    assert [s["step"] for s in _steps(tmp_path / "run")] == list(range(1, 13))


def test_repeated_nans_roll_back_and_lower_the_learning_rate(tmp_path, tiny_model, chat_data, fork_cli):
    cfg = make_config(tmp_path, tiny_model, chat_data, lr_scheduler_type="constant")
    r = fork_cli.run("train", str(cfg), env={"RELAYTUNE_NAN_AT": "5,6,7"})
    assert r.returncode == 0, r.stderr
    assert "rolled back to step-4 and continue with the learning rate x0.5" in r.stderr
    run = tmp_path / "run"
    assert [e["step"] for e in _events(run, "skipped_step")] == [6, 7, 8]
    assert _events(run, "nan_rollback") == [
        {"step": 4, "event": "nan_rollback", "bad_steps_until": 8, "lr_scale": 0.5}]
    lrs = {s["step"]: s["learning_rate"] for s in _steps(run)}
    assert sorted(lrs) == list(range(1, 13))  # every step exactly once
    assert lrs[4] == pytest.approx(1e-3) and lrs[5] == pytest.approx(5e-4) and lrs[12] == pytest.approx(5e-4)


def test_repeated_nans_can_stop_with_a_diagnosis(tmp_path, tiny_model, chat_data, fork_cli):
    cfg = make_config(tmp_path, tiny_model, chat_data, on_repeated_nan="stop")
    r = fork_cli.run("train", str(cfg), env={"RELAYTUNE_NAN_AT": "5,6,7"})
    assert r.returncode == 1
    assert "3 steps in a row had a non-finite loss or gradient" in r.stderr
    assert "The run is intact at step-4" in r.stderr
    assert "Traceback" not in r.stderr


def test_train_releases_the_model_on_every_exit_path(tmp_path, tiny_model, chat_data, monkeypatch, one_thread):
    built = []
    real = trainer_module.load_model

    def tracking_load_model(*args, **kwargs):
        model = real(*args, **kwargs)
        built.append(weakref.ref(model))
        return model

    monkeypatch.setattr(trainer_module, "load_model", tracking_load_model)
    cfg = make_config(tmp_path / "ok", tiny_model, chat_data)
    relaytune.train(str(cfg))
    stop = make_config(tmp_path / "stop", tiny_model, chat_data, max_steps=10_000, time_limit="2")
    with pytest.raises(StoppedEarly):
        relaytune.train(str(stop))
    relaytune.train(str(make_config(tmp_path / "again", tiny_model, chat_data)))
    gc.collect()
    assert len(built) == 3
    assert [ref() is None for ref in built] == [True, True, True]


def test_after_an_oom_the_cached_gpu_and_pinned_host_memory_go_back(monkeypatch):
    """A smaller micro-batch fits none of the larger one's cached blocks: offload_activations' pinned layer
    inputs would otherwise stay on top of the new ones in host memory."""
    from relaytune.training.recovery import free_memory

    released = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: released.append("gpu"))
    monkeypatch.setattr(torch.accelerator, "empty_host_cache", lambda: released.append("pinned host"))
    weight = torch.nn.Parameter(torch.ones(2))
    weight.grad = torch.ones(2)
    assert free_memory(torch.optim.SGD([weight], lr=0.1)) == []
    assert released == ["gpu", "pinned host"] and weight.grad is None
