"""Bench scripts that need a GPU, on a machine without one: each says why it cannot run, exit 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is the CPU's answer")
@pytest.mark.parametrize("script,reason", [
    ("graphs_memory_probe.py", "graphs_memory_probe.py needs a GPU: CUDA graphs only replay there"),
    ("flex_graphs_trajectory.py",
     "flex_graphs_trajectory.py needs a GPU: FlexAttention's backward and CUDA graphs run there only."),
    ("bf16_gradient_error.py", "bf16_gradient_error.py needs a CUDA GPU."),
    ("flex_decoding_check.py", "flex_decoding_check.py needs a CUDA GPU."),
    ("liger_swiglu_compiled.py", "liger_swiglu_compiled.py needs a CUDA GPU: Liger's kernels are Triton's."),
])
def test_without_a_gpu_the_script_says_it_needs_one(script, reason):
    done = subprocess.run([sys.executable, str(ROOT / "bench" / script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert reason in done.stderr
    assert "Traceback" not in done.stderr
