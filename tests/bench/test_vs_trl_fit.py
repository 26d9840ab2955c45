"""bench/vs_trl.py's cap search stops relaytune at the first OOM that halved its micro-batch: an OOM
redone at the same micro-batch (CUDA graphs or the compiled checkpoint given up) still fits. Also what
else its report rests on: TRL's AdamW kernel, relaytune's notices, one random model per architecture, and
which run gets Liger's kernels (--relaytune-liger)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import vs_trl  # noqa: E402


def _metrics(run: Path, *records: dict, tail: str = "") -> Path:
    run.mkdir(parents=True, exist_ok=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + tail)
    return run


def _record_workers(monkeypatch, tmp_path) -> list:
    """vs_trl.spawn's worker processes replaced by ones that finish at once; returns their commands."""
    commands = []

    class Finished:
        returncode = 0

        def __init__(self, cmd, stdout, **kw):
            commands.append(cmd)
            stdout.write(vs_trl.RESULT + json.dumps({"system": cmd[cmd.index("--worker") + 1]}) + "\n")

        def poll(self):
            return 0

    monkeypatch.setattr(vs_trl, "WORK", tmp_path)
    monkeypatch.setattr(vs_trl.subprocess, "Popen", Finished)
    return commands


def test_only_an_oom_that_halved_the_micro_batch_means_it_did_not_fit(tmp_path):
    step = {"step": 0, "loss": 2.0}
    assert not vs_trl._has_oom_event(tmp_path / "none")
    assert not vs_trl._has_oom_event(_metrics(tmp_path / "a", step))
    kept = {"step": 3, "event": "oom", "micro_batch_size": 8, "was": 8, "released": ["compile_checkpoint"]}
    assert not vs_trl._has_oom_event(_metrics(tmp_path / "b", step, kept, tail='{"step": 4, "lo'))
    halved = {"step": 5, "event": "oom", "micro_batch_size": 4, "was": 8}
    assert vs_trl._has_oom_event(_metrics(tmp_path / "c", step, kept, halved))


def test_trl_runs_the_adamw_kernel_relaytune_runs():
    import vs_trl_workers

    assert vs_trl_workers.trl_optim("adamw_torch", cuda=True) == "adamw_torch_fused"
    assert vs_trl_workers.trl_optim("adamw_torch", cuda=False) == "adamw_torch"
    assert vs_trl_workers.trl_optim("paged_adamw_8bit", cuda=True) == "paged_adamw_8bit"


def test_relaytunes_notes_and_speed_ups_come_back_from_the_childs_log():
    """The child's stderr goes to a log the report does not show; its choices (a checkpoint kept
    outside the layers, the speed-ups in force) come back in the result, also where tqdm's carriage
    returns share their line."""
    log = ("Loading weights: 100%|##| 291/291\n"
           "relaytune: note: compile_checkpoint: off (micro-batch 8 is planned at 15.14 GiB)\n"
           "relaytune: speed-ups: FlexAttention; torch.compile on each of 32 decoder layers\n"
           "train:  14%|#  | 1/7 [00:18<01:48]\rrelaytune: note: OOM at step 1: redone\n"
           "relaytune: 24 training rows, global batch 2\n")
    assert vs_trl.relaytune_notices(log) == [
        "relaytune: note: compile_checkpoint: off (micro-batch 8 is planned at 15.14 GiB)",
        "relaytune: speed-ups: FlexAttention; torch.compile on each of 32 decoder layers",
        "relaytune: note: OOM at step 1: redone"]


def test_the_random_model_has_the_same_weights_in_every_invocation(tmp_path, monkeypatch):
    """Losses of two invocations (an A/B across leases) can be compared only if both built one model."""
    import gpu_bench
    import torch
    from safetensors.torch import load_file

    weights = []
    for name in ("one", "two"):
        monkeypatch.setattr(gpu_bench, "WORK", tmp_path / name)
        torch.rand(3)  # the global generator moved on, as any earlier work in the process moves it
        weights.append(load_file(gpu_bench.build_model("tiny") / "model.safetensors"))
    assert weights[0].keys() == weights[1].keys()
    assert all(weights[0][k].equal(weights[1][k]) for k in weights[0])


def test_relaytune_liger_sets_relaytunes_liger_kernels_only_when_asked(tmp_path):
    """--relaytune-liger: relaytune's own liger_kernels (both, or the ones listed, in their order);
    the bench patches nothing itself, so it measures what a user's config gets."""
    import vs_trl_workers

    parser = argparse.ArgumentParser()
    vs_trl.case_arguments(parser)
    kernels = []
    for flag in ([], ["--relaytune-liger"], ["--relaytune-liger", "swiglu, rms_norm"], ["--relaytune-liger", "swiglu"]):
        args = parser.parse_args(["--arch", "llama-3-8b", *flag])
        args.model, args.data, args.steps, args.warmup, args.save_steps = "m", "d", 2, 1, 0
        kernels.append(vs_trl_workers.relaytune_config(args, tmp_path).get("liger_kernels"))
    assert kernels == [None, ["rms_norm", "swiglu"], ["rms_norm", "swiglu"], ["swiglu"]]


def test_relaytune_liger_names_only_relaytunes_liger_kernels(capsys):
    parser = argparse.ArgumentParser()
    vs_trl.case_arguments(parser)
    assert parser.parse_args(["--relaytune-liger", "swiglu,rms_norm"]).relaytune_liger == ("rms_norm", "swiglu")
    assert parser.parse_args([]).relaytune_liger is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--relaytune-liger", "rope,rms_norm"])
    assert "expected a comma list of rms_norm, swiglu" in capsys.readouterr().err


def test_only_relaytunes_worker_is_told_to_run_with_liger(monkeypatch, tmp_path):
    commands = _record_workers(monkeypatch, tmp_path)
    parser = argparse.ArgumentParser()
    vs_trl.case_arguments(parser)
    args = parser.parse_args(["--relaytune-liger", "swiglu"])
    args.steps, args.warmup, args.save_steps, args.cap_gib = 2, 1, 0, 0.0
    for system in ("relaytune", "trl-liger"):
        assert vs_trl.spawn(args, system, 4, tmp_path / "model", tmp_path / "data.jsonl")["system"] == system
    assert [cmd[cmd.index("--relaytune-liger") + 1] for cmd in commands if "--relaytune-liger" in cmd] == ["swiglu"]
    assert ["--relaytune-liger" in cmd for cmd in commands] == [True, False]


def test_offload_stream_compute_puts_relaytunes_copies_on_the_compute_stream_in_its_worker(monkeypatch, tmp_path):
    """--relaytune-offload-stream compute: the A/B of offload_activations' side stream in one invocation;
    only relaytune's worker gets the flag, and only that setting touches relaytune's offload module."""
    import torch
    import vs_trl_workers

    from relaytune import activation_offload

    monkeypatch.setattr(activation_offload, "side_stream", activation_offload.side_stream)
    side = activation_offload.side_stream
    parser = argparse.ArgumentParser()
    vs_trl.case_arguments(parser)
    for flag, expected in (([], side), (["--relaytune-offload-stream", "compute"], torch.cuda.current_stream)):
        args = parser.parse_args(["--relaytune-set", "offload_activations=true", *flag])
        args.model, args.data, args.steps, args.warmup, args.save_steps = "m", "d", 2, 1, 0
        assert vs_trl_workers.relaytune_config(args, tmp_path)["offload_activations"] is True
        assert activation_offload.side_stream is expected
    commands = _record_workers(monkeypatch, tmp_path)
    args.cap_gib = 0.0
    for system in ("relaytune", "trl"):
        vs_trl.spawn(args, system, 4, tmp_path / "model", tmp_path / "data.jsonl")
    assert ["--relaytune-offload-stream" in cmd for cmd in commands] == [True, False]
    assert commands[0][commands[0].index("--relaytune-offload-stream") + 1] == "compute"
