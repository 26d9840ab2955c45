"""Issue 15 item 2: no checkpoint with non-finite state is ever committed, and rollbacks are capped:
a rollback whose state fails again steps back further, then stops with a diagnosis (exit 1)."""

from __future__ import annotations

import math

import torch
from conftest import make_config
from safetensors.torch import load_file

from relaytune.observe.metrics import read_metrics


def test_a_huge_learning_rate_stops_with_a_diagnosis_instead_of_looping(tmp_path, tiny_model, chat_data, fork_cli):
    cfg = make_config(tmp_path, tiny_model, chat_data, learning_rate=1e30, save_steps=1)
    r = fork_cli.run("train", str(cfg), timeout=120)  # looped for ever before
    assert r.returncode == 1, r.stderr[-3000:]
    assert "non-finite loss or gradient" in r.stderr and "re-running will stop the same way" in r.stderr
    assert "Traceback" not in r.stderr
    events = [e for e in read_metrics(tmp_path / "run/metrics.jsonl") if e.get("event") == "nan_stop"]
    assert len(events) == 1 and events[0]["rollbacks"] >= 1
    again = fork_cli.run("train", str(cfg), timeout=120)  # a re-run also ends, the same way
    assert again.returncode == 1 and "Traceback" not in again.stderr, again.stderr[-3000:]
    for folder in (tmp_path / "run/checkpoints").iterdir():
        for name in ("adapter_model.safetensors", "optimizer.safetensors"):
            for t in load_file(folder / name).values():
                assert not t.is_floating_point() or bool(torch.isfinite(t).all()), folder


def test_a_non_finite_state_is_never_committed(tmp_path, capsys):
    """Weights turned non-finite by an update are seen at the step boundary: the save is skipped,
    with a warning and an event; the last committed checkpoint stays the one to return to."""
    from types import SimpleNamespace

    from relaytune.checkpoint.state import TrainState
    from relaytune.observe.metrics import MetricsLog
    from relaytune.training.trainer import Trainer

    saves = []
    model = torch.nn.Linear(2, 2)
    trainer = Trainer.__new__(Trainer)
    trainer.live = SimpleNamespace(model=model, optimizer=torch.optim.AdamW(model.parameters()))
    trainer.state = TrainState(step=4)
    trainer.total = 10
    trainer.metrics = MetricsLog(tmp_path / "metrics.jsonl")
    trainer.checkpointer = SimpleNamespace(due=lambda step, total: True, raise_if_failing=lambda step: None,
                                           save=lambda fn, step: saves.append(step), blocked_seconds=0.0)
    trainer.maybe_save()
    assert saves == [4]
    with torch.no_grad():
        model.weight[1, 1] = math.nan
    trainer.state.step = 5
    trainer.maybe_save()
    assert saves == [4], "a NaN weight was committed"
    assert "not saving a checkpoint at step 5: weight weight is not finite" in capsys.readouterr().err
    assert [e for e in read_metrics(tmp_path / "metrics.jsonl") if e.get("event") == "checkpoint_skipped"] == [
        {"step": 5, "event": "checkpoint_skipped", "reason": "non-finite weight weight"}]


def test_nonfinite_names_the_tensor():
    from types import SimpleNamespace

    from relaytune.checkpoint.state import nonfinite

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    live = SimpleNamespace(model=model, optimizer=opt)
    assert nonfinite(live) is None
    with torch.no_grad():
        model.weight[0, 0] = math.inf
    assert nonfinite(live) == "weight weight"
    with torch.no_grad():
        model.weight[0, 0] = 0.0
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    opt.state[model.bias]["exp_avg"][0] = math.nan
    assert nonfinite(live) == "optimizer state exp_avg of parameter 1"
