"""bench/flex_graphs_trajectory.py on a machine without a GPU: it says why it cannot run, exit 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is the CPU's answer")
def test_without_a_gpu_the_trajectory_says_it_needs_one():
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "flex_graphs_trajectory.py")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "flex_graphs_trajectory.py needs a GPU: FlexAttention's backward and CUDA graphs run there only." in (
        done.stderr)
    assert "Traceback" not in done.stderr
