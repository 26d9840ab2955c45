"""The dtype chosen for the hardware: bf16 where supported, fp16 with a scaler on a T4, fp32 on CPU.

There is no GPU here, so the GPU answers of torch.cuda are faked; the decisions are ours."""

from __future__ import annotations

import pytest
import torch

from relaytune.config.loader import load_config
from relaytune.model import choose_precision


def cfg(**kw):
    return load_config({"dataset": "d.jsonl", "output_dir": "out", **kw})


@pytest.fixture
def gpu(monkeypatch):
    def fake(bf16: bool, name: str):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: bf16)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)
    return fake


def test_cpu_trains_in_float32(capsys):
    p = choose_precision(cfg(bf16=True))
    assert (p.device.type, p.dtype, p.autocast, p.use_grad_scaler) == ("cpu", torch.float32, None, False)
    assert "no GPU: training in float32" in capsys.readouterr().err


def test_bf16_is_the_default_where_supported(gpu):
    gpu(True, "NVIDIA H200")
    p = choose_precision(cfg())
    assert (p.dtype, p.autocast, p.use_grad_scaler) == (torch.bfloat16, torch.bfloat16, False)


def test_bf16_on_a_t4_becomes_fp16_with_a_scaler_and_a_notice(gpu, capsys):
    gpu(False, "Tesla T4")
    p = choose_precision(cfg(bf16=True))
    assert (p.dtype, p.autocast, p.use_grad_scaler) == (torch.float16, torch.float16, True)
    assert "Tesla T4 has no bfloat16; using fp16 with a gradient scaler" in capsys.readouterr().err


def test_unset_on_a_t4_is_fp16(gpu):
    gpu(False, "Tesla T4")
    assert choose_precision(cfg()).dtype == torch.float16


def test_both_off_is_fp32_on_a_gpu(gpu):
    gpu(True, "NVIDIA H200")
    p = choose_precision(cfg(bf16=False, fp16=False))
    assert (p.dtype, p.autocast) == (torch.float32, None)
