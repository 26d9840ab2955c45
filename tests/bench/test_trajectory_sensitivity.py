"""bench/trajectory_sensitivity.py runs its three CPU trajectories and measures each against fp32's."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_each_run_is_measured_against_the_fp32_run_step_by_step():
    r = subprocess.run([sys.executable, str(ROOT / "bench/trajectory_sensitivity.py"), "--steps", "2"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = dict(re.findall(r"^(.+?): \(loss, grad norm\) per step (.+)$", r.stdout, re.M))
    assert list(rows) == ["fp32", "bf16 autocast", "fp32, LoRA weights x (1 + 1e-3)"]
    assert rows["fp32"].endswith("; grad norm's relative distance from fp32 per step 0.000, 0.000")
    # Each change reaches the maths: the first step's loss already differs from fp32's.
    first_losses = {name: row.split(",")[0] for name, row in rows.items()}
    assert len(set(first_losses.values())) == 3, first_losses
