"""The fused AdamW update (GPUs): queued before the host reads the step's loss, skipped on the device
when the loss or the gradient is not finite, and a checkpoint of either optimizer resumes onto either.

These tests force torch's fused AdamW on the CPU, another implementation of the same kernel than
CUDA's: they check relaytune's skip, prefetch and resume logic, not the CUDA kernel, which ran on an
H200 (bench/results/vs-trl-h200.md, sixteenth session). relaytune itself picks the fused kernel on
CUDA only (optim.fusable), so the CPU's exact-resume tests keep the per-tensor path.
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest
import torch
from conftest import lora_model_with_gradients

from relaytune import faults
from relaytune.checkpoint.load import _check_optimizer, apply, capture
from relaytune.checkpoint.state import Live, restore, snapshot
from relaytune.data.rows import TokenRow
from relaytune.training.optim import build_optimizer, build_scheduler, fusable, skips_on_device
from relaytune.training.step import StepParts, optimizer_step


@pytest.fixture(scope="module")
def setup(tiny_model, tmp_path_factory):
    model, cfg, precision = lora_model_with_gradients(tiny_model, tmp_path_factory.mktemp("fused"))
    rng = np.random.default_rng(0)
    rows = [TokenRow(ids, ids) for ids in (rng.integers(3, 200, n) for n in (9, 13, 7, 11))]
    return cfg, precision, model, rows


@pytest.fixture(autouse=True)
def fresh_weights(request):
    """Every test starts from the module model's initial weights and leaves them so."""
    if "setup" not in request.fixturenames:
        yield
        return
    model = request.getfixturevalue("setup")[2]
    start = [p.detach().clone() for p in model.parameters()]
    yield
    _reset(model, start)


def _reset(model, start: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for p, s in zip(model.parameters(), start):
            p.copy_(s)


def _nan_step(parts: StepParts, rows: list):
    """Step 0, then a NaN step 1: (step 1's result, the state before it, the state after it)."""
    faults.reset({})
    optimizer_step(parts, rows, 2, 0)
    before = _state(parts.model, parts.optimizer)
    faults.reset({"RELAYTUNE_NAN_AT": "1"})
    try:
        bad = optimizer_step(parts, rows, 2, 1)
    finally:
        faults.reset({})
    return bad, before, _state(parts.model, parts.optimizer)


def _fused_adamw(model, cfg) -> torch.optim.AdamW:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=cfg.learning_rate, fused=True)


def _state(model, optimizer) -> list[torch.Tensor]:
    weights = [p.detach().clone() for p in model.parameters() if p.requires_grad]
    moments = [t.clone() for s in optimizer.state.values() for t in s.values()]
    return weights + moments


def _train(cfg, precision, model, rows, queued: bool, steps: int, nan_at: str = "") -> list:
    faults.reset({"RELAYTUNE_NAN_AT": nan_at} if nan_at else {})
    optimizer = _fused_adamw(model, cfg)
    parts = StepParts(model, optimizer, None, precision, 0, 1.0)
    assert parts.queues_update  # one process, no scaler, fused AdamW
    parts.queues_update = queued
    results = [optimizer_step(parts, rows, 2, s) for s in range(steps)]
    faults.reset({})
    return results, _state(model, optimizer), optimizer


def test_the_queued_update_is_the_update_read_first_bit_for_bit(setup):
    cfg, precision, model, rows = setup
    start = [p.detach().clone() for p in model.parameters()]
    first, queued_state, _ = _train(cfg, precision, model, rows, queued=True, steps=3)
    _reset(model, start)
    second, read_first_state, _ = _train(cfg, precision, model, rows, queued=False, steps=3)
    assert [(r.loss, r.grad_norm, r.updated) for r in first] == [(r.loss, r.grad_norm, r.updated) for r in second]
    assert all(torch.equal(a, b) for a, b in zip(queued_state, read_first_state))


def test_a_nan_step_leaves_weights_moments_and_step_count_as_they_were(setup):
    cfg, precision, model, rows = setup
    optimizer = _fused_adamw(model, cfg)
    parts = StepParts(model, optimizer, None, precision, 0, 1.0)
    bad, before, after = _nan_step(parts, rows)
    assert not bad.updated and bad.loss != bad.loss  # NaN, as the host path reports it
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert {float(s["step"]) for s in optimizer.state.values()} == {1.0}
    assert not hasattr(optimizer, "found_inf")  # the flag never outlives its step
    assert all(p.grad is None for p in parts.params)


def test_relaytune_fuses_adamw_on_cuda_tensors_only_unless_a_test_plan_asks_for_it_on_the_cpu(setup):
    cfg, precision, model, _ = setup
    params = [p for p in model.parameters() if p.requires_grad]
    try:
        faults.reset({})
        optimizer = build_optimizer(cfg, model)
        assert not fusable(params)  # this CPU
        assert all(g["fused"] is None for g in optimizer.param_groups) and not skips_on_device(optimizer)
        assert not StepParts(model, optimizer, None, precision, 0, 1.0).queues_update
        faults.reset({"RELAYTUNE_FUSED_ADAMW": "1"})  # CI's run of the GPU's update path on the CPU
        optimizer = build_optimizer(cfg, model)
        assert fusable(params) and skips_on_device(optimizer)
        assert StepParts(model, optimizer, None, precision, 0, 1.0).queues_update
    finally:
        faults.reset()


@pytest.mark.parametrize("saved_fused", [False, True])
def test_a_checkpoint_of_either_adamw_resumes_onto_the_kernel_this_machine_picked(setup, saved_fused, capsys):
    """A GPU run's checkpoint (fused) resumed on another machine's kind, and a checkpoint written
    before AdamW was fused resumed on a GPU: the live flags stay, the moments and steps carry over."""
    cfg, precision, model, rows = setup
    params = [p for p in model.parameters() if p.requires_grad]

    def adamw(fused: bool):
        groups = [{"params": params[:2], "weight_decay": 0.0}, {"params": params[2:], "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=cfg.learning_rate, fused=fused or None)

    writer = adamw(saved_fused)
    parts = StepParts(model, writer, None, precision, 0, 1.0)
    faults.reset({})
    for s in range(2):
        optimizer_step(parts, rows, 2, s)
    written = Live(model, writer, build_scheduler(cfg, writer, 10), None)
    files = snapshot(written, {"step": 2}, "")
    reader = adamw(not saved_fused)
    live = Live(model, reader, build_scheduler(cfg, reader, 10), None)
    _check_optimizer(writer.state_dict(), reader)  # no "optimizer param_groups: ... differ"
    apply(dataclasses.replace(capture(written), where="step-2"), live)  # a resume's checks and apply
    kernels = ("fused", "per-tensor") if saved_fused else ("per-tensor", "fused")
    assert (f"relaytune: note: step-2 was written with AdamW's {kernels[0]} kernel and this machine runs the "
            f"{kernels[1]} one: the same update up to float rounding, so the run continues its curve, not bit "
            "for bit") in capsys.readouterr().err
    restore(files, live)  # a roll-back
    assert [g["fused"] for g in reader.param_groups] == [None if saved_fused else True] * 2
    for p in params:
        saved, loaded = writer.state[p], reader.state[p]
        assert torch.equal(saved["exp_avg"], loaded["exp_avg"])
        assert float(saved["step"]) == float(loaded["step"]) == 2.0
    assert skips_on_device(reader) is (not saved_fused)
    optimizer_step(StepParts(model, reader, None, precision, 0, 1.0), rows, 2, 2)  # it runs


def test_a_run_that_queues_its_updates_and_makes_each_batch_ahead_trains_exactly_what_one_that_waits_does(
        tmp_path, tiny_model, chat_data, monkeypatch):
    """Both runs use the fused AdamW (forced on this CPU); one queues the update and makes the next
    step's micro-batches before it reads the loss, the other reads first. With an OOM that halves the
    micro-batch (the batch made ahead at the old size is dropped) and two NaN steps that roll the run
    back to its checkpoint (the batch made ahead for the next step is dropped), the curves, events
    and final adapters are the same bit for bit, and every step's micro-batches were collated once."""
    from conftest import make_config, step_records

    import relaytune
    from relaytune.training import optim, prefetch, step

    monkeypatch.setattr(optim, "fusable", lambda params: True)
    collated = []
    real = prefetch.micro_batches

    def counting(rows, *args, **kwargs):
        collated.append(len(rows))
        yield from real(rows, *args, **kwargs)

    monkeypatch.setattr(prefetch, "micro_batches", counting)
    monkeypatch.setenv("RELAYTUNE_OOM_AT", "2:1")
    monkeypatch.setenv("RELAYTUNE_NAN_AT", "0,5,6")  # a skipped first step, then a roll-back
    settings = dict(max_bad_steps=2, lora_dropout=0.1)
    runs = {}
    for name in ("queued", "waits"):
        if name == "waits":
            monkeypatch.setattr(step, "skips_on_device", lambda optimizer: False)
        collated.clear()
        relaytune.train(str(make_config(tmp_path / name, tiny_model, chat_data, **settings)))
        run = tmp_path / name / "run"
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        runs[name] = dict(
            curve=[(r["step"], r["loss"], r["grad_norm"]) for r in step_records(run / "metrics.jsonl")],
            events=[{k: v for k, v in r.items() if k not in ("time", "blocked_seconds")}
                    for r in records if "event" in r],
            adapter=(run / "final" / "adapter_model.safetensors").read_bytes(),
            collated=list(collated))
    queued, waits = runs["queued"], runs["waits"]
    assert [e["event"] for e in queued["events"]].count("oom") == 1
    assert [e["event"] for e in queued["events"]].count("nan_rollback") == 1
    assert [e["step"] for e in queued["events"] if e["event"] == "skipped_step"] == [1, 6, 7]
    assert queued.pop("curve") == waits.pop("curve")
    assert queued.pop("adapter") == waits.pop("adapter")
    assert queued.pop("events") == waits.pop("events")
    # Each step's micro-batches were made once: ahead, and used. The one exception is the batch made
    # ahead of the roll-back for the step after it, which was dropped.
    assert queued["collated"] == waits["collated"] + [8]


def test_running_out_of_memory_while_making_the_next_batch_never_redoes_an_update(setup, monkeypatch):
    """The next batch is made after this step's update is queued: an OOM there must not reach the
    trainer, whose redo of "this step" would apply the update twice. The next step makes its batch."""
    from relaytune.training import prefetch

    cfg, precision, model, rows = setup
    start = [p.detach().clone() for p in model.parameters()]
    faults.reset({})
    calls = []

    def oom_once(model, input_ids):
        calls.append(1)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    runs = {}
    for name in ("plain", "oom"):
        _reset(model, start)
        optimizer = _fused_adamw(model, cfg)
        parts = StepParts(model, optimizer, None, precision, 0, 1.0)
        parts.prefetch.rows_of, parts.prefetch.steps = (lambda step: (list(range(len(rows))), list(rows))), 3
        if name == "oom":
            monkeypatch.setattr(prefetch, "prefetch_rows", oom_once)
        results = []
        for step in range(3):
            _, step_rows = parts.prefetch.rows(step)
            results.append(optimizer_step(parts, step_rows, 2, step).loss)
        runs[name] = (results, _state(model, optimizer))
        assert {float(s["step"]) for s in optimizer.state.values()} == {3.0}
    assert runs["oom"][0] == runs["plain"][0]
    assert all(torch.equal(a, b) for a, b in zip(runs["oom"][1], runs["plain"][1]))


def test_fp16s_scaler_skips_an_inf_step_with_the_fused_adamw_and_an_oom_after_unscaling_can_be_redone(setup):
    """A T4 (fp16) runs the fused AdamW through the scaler, which reads the numbers first (no queued
    update). An inf gradient leaves the weights as they were and halves the scale; an OOM between the
    scaler's unscale_ and its update (AdamW making its state) leaves a record that recovery.forget_unscale
    clears, so the redo's unscale_ is accepted and the scale is untouched."""
    from relaytune.training.recovery import forget_unscale

    cfg, precision, model, rows = setup
    optimizer = _fused_adamw(model, cfg)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    parts = StepParts(model, optimizer, scaler, precision, 0, 1.0)
    assert not parts.queues_update
    bad, before, after = _nan_step(parts, rows)
    assert not bad.updated and scaler.get_scale() == 2.0 ** 7
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert not hasattr(optimizer, "found_inf") and not hasattr(optimizer, "grad_scale")

    scaler.scale(torch.stack([p.sum() for p in parts.params]).sum()).backward()
    scaler.unscale_(optimizer)  # then AdamW ran out of memory making its state, say
    with pytest.raises(RuntimeError, match="unscale_\\(\\) has already been called"):
        scaler.unscale_(optimizer)
    optimizer.zero_grad(set_to_none=True)
    forget_unscale(scaler)
    redo = optimizer_step(parts, rows, 2, 1)
    assert redo.updated and scaler.get_scale() == 2.0 ** 7


def test_the_session_plan_reaches_every_training_process(tmp_path, tiny_model, chat_data, fork_cli):
    """CI runs the kill-and-resume tests a second time with RELAYTUNE_FUSED_ADAMW=1 around the whole
    session (.ci/run): the forked children and the real `python -m relaytune.cli` ones must then both
    run the fused AdamW, or their comparisons would mix two kernels. The kernel is in each checkpoint."""
    from conftest import ONE_THREAD_ENV, make_config, run_cli

    from relaytune.checkpoint.state import _safetensors_meta
    from relaytune.run_dir import OPTIMIZER

    session = os.environ.get("RELAYTUNE_FUSED_ADAMW") == "1"
    kernels = []
    for name, run in (("forked", fork_cli.run), ("real", lambda *a: run_cli(*a, env=ONE_THREAD_ENV))):
        cfg = make_config(tmp_path / name, tiny_model, chat_data, max_steps=3, save_steps=2)
        assert run("train", str(cfg)).returncode == 0
        raw = (tmp_path / name / "run" / "checkpoints" / "step-2" / OPTIMIZER).read_bytes()
        kernels.append({bool(g.get("fused")) for g in _safetensors_meta(raw)["param_groups"]})
    assert kernels == [{session}, {session}]


def test_the_batch_made_ahead_waits_on_the_host_until_its_step_takes_it(monkeypatch):
    """Making the next batch ahead allocates nothing on the GPU: device tensors made there raised an
    H200's seq-512 peak by 47 MiB with CUDA graphs on. Only `batches`, as the step takes each
    micro-batch, copies it to the device, in the order the step uses them."""
    from relaytune.training import prefetch

    rng = np.random.default_rng(1)
    rows = [TokenRow(ids, ids) for ids in (rng.integers(3, 200, n) for n in (5, 8, 6))]
    copied = []
    monkeypatch.setattr(prefetch, "to_device", lambda batch, device: copied.append(batch) or batch)
    ahead = prefetch.Prefetch(model=None, pad_id=0, width=None, device=torch.device("cpu"))
    ahead.rows_of, ahead.steps = (lambda step: ([0, 1, 2], rows)), 2
    ahead.prepare(1, 2)
    assert copied == [], "nothing went to the device while the last step ran"
    _, step_rows = ahead.rows(1)
    assert step_rows is rows
    taken = []
    for batch in ahead.batches(rows, 2):
        assert len(copied) == len(taken) + 1, "each micro-batch is copied as the step takes it"
        taken.append(batch)
    assert [b["input_ids"].shape[0] for b in taken] == [2, 1] and copied == taken
