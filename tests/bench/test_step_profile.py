"""bench/step_profile.py runs and reports what it says it does (tiny model, on the CPU)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # builds a tiny model and trains 3 steps in a child process: ~20 s
def test_step_profile_reports_the_profiled_steps(tmp_path):
    out = tmp_path / "profile.md"
    env = {**os.environ, "BENCH_WORK": str(tmp_path / "work")}
    r = subprocess.run([sys.executable, str(ROOT / "bench/step_profile.py"), "--arch", "tiny", "--seq", "128",
                        "--steps", "2", "--warmup", "1", "--packing", "--out", str(out)],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    text = out.read_text()
    assert text.startswith("### relaytune step profile: tiny LoRA, seq 128, micro-batch 4 x accum 1, packed (cpu, ")
    walls = re.search(r"- profiled steps: 2 \(after 1\); wall seconds each: ([0-9.]+), ([0-9.]+)\n", text)
    assert walls and all(float(w) > 0 for w in walls.groups()), text[:500]
    cpu_table = text.split("Most self CPU time:")[1]
    assert "aten::mm" in cpu_table and "GPU busy" not in text  # no GPU here, so no GPU figures
