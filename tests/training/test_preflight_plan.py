"""The preflight table's memory figure is the planner's (peak allocated and on-card total at the micro-batch and
checkpointing in force), and `auto` is planned with the GPU's real free memory under any per-process cap.

No GPU here: torch.cuda's answers are faked (as in test_precision.py); the planning is ours."""

from __future__ import annotations

import pytest
import torch

from relaytune.config.loader import load_config
from relaytune.errors import UserError
from relaytune.plan import choose_auto, estimate_memory, resolve_architecture, settings_from_config
from relaytune.plan.gpus import CUDA_CONTEXT_GIB, Gpu
from relaytune.training import autobatch
from relaytune.training.preflight import Report, check_gpu, memory_rows

GIB = 2 ** 30
H200 = int(139.8 * GIB)


def cfg(**kw):
    return load_config({"dataset": "d.jsonl", "output_dir": "out", "model": "Qwen/Qwen2.5-3B", **kw})


@pytest.fixture
def fake_gpu(monkeypatch):
    def fake(free: int, total: int = H200, name: str = "NVIDIA H200", fraction: float = 1.0):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (free, total))
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: 0)
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
        monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda *a: fraction, raising=False)
    return fake


def text(report: Report) -> str:
    width = max(len(w) for w, _ in report.rows)
    return "\n".join(f"  {w.ljust(width)}  {v}" for w, v in report.rows)


def test_auto_is_planned_under_the_memory_cap_and_the_table_shows_the_planners_figure(fake_gpu):
    fake_gpu(free=H200 - GIB, fraction=14.5 * GIB / H200)  # the bench's T4-sized cap on an H200
    c = cfg(load_in_4bit=True, max_seq_length=2048, per_device_train_batch_size="auto", global_batch_size=16,
            gradient_checkpointing="auto")
    choice = autobatch.choose(c, None)
    arch = resolve_architecture("Qwen/Qwen2.5-3B")
    gpu = Gpu("x", 14.5 + CUDA_CONTEXT_GIB, True, None, compiles=False)  # a faked GPU: no capability to read
    assert (choice.micro_batch, choice.gradient_checkpointing) == choose_auto(
        arch, settings_from_config(c, gpu), gpu, "auto", 16, "auto")
    assert choice.budget_gib == pytest.approx(14.5 + CUDA_CONTEXT_GIB)
    expected = estimate_memory(arch, settings_from_config(c, gpu), choice.micro_batch, choice.gradient_checkpointing)
    assert choice.estimate.total_allocated == expected.total_allocated
    assert expected.total_reserved <= 15.0 * GIB  # what was chosen fits the capped card by the plan

    report = Report()
    check_gpu(report, choice.frozen_bytes)
    for row in autobatch.table_rows(choice, 16):
        report.add(*row)
    memory_rows(report, choice.estimate, choice.micro_batch, choice.gradient_checkpointing)
    out = text(report)
    mb, acc = choice.micro_batch, 16 // choice.micro_batch
    assert "GPU 0          NVIDIA H200: 138.8 GiB free of 139.8 GiB" in out
    assert f"micro-batch    {mb} x {acc} = global batch 16 (auto: planned for NVIDIA H200 (14.5 GiB usable))" in out
    gc = "on" if choice.gradient_checkpointing else "off"
    assert f"checkpointing  {gc} (auto: {gc} (activations" in out
    assert (f"memory         peak {expected.total_allocated / GIB:.2f} GiB allocated, "
            f"{expected.total_reserved / GIB:.2f} GiB on the card (planned at micro-batch {mb}, checkpointing {gc}); "
            f"frozen weights {expected.parts['frozen weights'] / GIB:.2f} GiB") in out
    assert "weights alone" not in out


def test_a_fixed_setting_gets_the_planners_figure_too_and_no_trial(fake_gpu):
    fake_gpu(free=100 * GIB)
    c = cfg(per_device_train_batch_size=4, gradient_accumulation_steps=2, max_seq_length=512)
    choice = autobatch.choose(c, None)
    assert (choice.micro_batch, choice.gradient_checkpointing, choice.probes) == (4, False, False)
    report = Report()
    memory_rows(report, choice.estimate, 4, False)
    assert report.rows[0][1].startswith("peak ") and "planned at micro-batch 4, checkpointing off" in report.rows[0][1]
    assert autobatch.table_rows(choice, 8)[0] == ("micro-batch", "4 x 2 = global batch 8 (as configured)")


def test_refuses_when_the_frozen_weights_alone_exceed_free_memory(fake_gpu):
    fake_gpu(free=3 * GIB, total=16 * GIB, name="Tesla T4")
    c = cfg(model="Qwen/Qwen2.5-7B", max_seq_length=512)
    choice = autobatch.choose(c, None)
    assert choice.frozen_bytes > 3 * GIB
    with pytest.raises(UserError, match=r"GPU 0 has 3.0 GiB free; the model's weights alone need about "
                                        r"\d+\.\d GiB.*load_in_4bit: true"):
        check_gpu(Report(), choice.frozen_bytes)


def test_with_two_ranks_a_full_second_gpu_is_refused_too(fake_gpu, monkeypatch):
    fake_gpu(free=40 * GIB, total=80 * GIB, name="A100")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i=0: (40 * GIB, 80 * GIB) if i == 0 else (2 * GIB, 80 * GIB))
    frozen = 15 * GIB
    check_gpu(Report(), frozen)  # one process trains on GPU 0 only: GPU 1 is not its concern
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(UserError, match=r"^GPU 1 has 2.0 GiB free; the model's weights alone need about 15.0 GiB"):
        check_gpu(Report(), frozen)


def test_checkpointing_auto_with_a_fixed_micro_batch_turns_it_off_when_it_fits(fake_gpu):
    fake_gpu(free=130 * GIB)
    c = cfg(per_device_train_batch_size=2, gradient_accumulation_steps=1, max_seq_length=1024,
            gradient_checkpointing="auto")
    choice = autobatch.choose(c, None)
    assert choice.gradient_checkpointing is False and choice.how_gc.startswith("auto: off (activations fit")


def test_cpu_has_no_memory_row():
    report = Report()
    check_gpu(report, None)
    memory_rows(report, None, 4, False)
    assert report.rows == [("GPU", "none (training on CPU)")]
