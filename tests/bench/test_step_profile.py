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


def test_the_gap_report_finds_where_the_gpu_waits(monkeypatch):
    """--gaps: idle time is what lies between the end of all work so far and the next start (a copy
    overlapping a kernel hides no gap), in bands of length, totalled by the work that ended the wait."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import step_profile

    class Span:
        def __init__(self, start, end):
            self.start, self.end = start, end

        def elapsed_us(self):
            return self.end - self.start

    class Work:
        def __init__(self, name, start, end):
            self.name, self.time_range = name, Span(start, end)

    # two steps: each waits 8 us before "mm", 2,000 us before "adamw" (the host's step boundary)
    work = [Work("mm", 0, 100), Work("copy", 50, 300), Work("mm", 308, 400), Work("adamw", 2400, 2500),
            Work("mm", 2508, 2600), Work("adamw", 4600, 4700)]
    monkeypatch.setattr(step_profile, "device_work", lambda prof: work)
    lines = step_profile.gap_report(None, steps=2)
    text = "\n".join(lines)
    assert lines[0] == ("- GPU timeline of the profiled steps: 4.7 ms from the first kernel to the last, "
                        "4.0 ms of it idle (85%), 2.0 ms idle per step")
    assert "| 0-10 us | 1 | 0.01 |" in text and "| >= 1000 us | 1 | 2.00 |" in text
    assert "| 10-100 us | 0 | 0.00 |" in text and "| 100-1000 us | 0 | 0.00 |" in text
    assert "    2.00     1.0  adamw" in text and "    0.01     1.0  mm" in text
    assert text.index("     2000  mm") < text.index("        8  copy")


def test_the_kernel_report_totals_each_kernel_and_tells_matmuls_apart_by_shape(monkeypatch):
    """--kernels: every kernel's time per step, largest first, and the matmuls by input shapes (an
    adapter's have its rank as a dimension)."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import step_profile

    class Span:
        def __init__(self, us):
            self.us = us

        def elapsed_us(self):
            return self.us

    class Work:
        def __init__(self, name, us):
            self.name, self.time_range = name, Span(us)

    class Average:
        def __init__(self, key, shapes, us, count):
            self.key, self.input_shapes, self.self_device_time_total, self.count = key, shapes, us, count

    class Prof:
        def key_averages(self, group_by_input_shape=False):
            assert group_by_input_shape
            return [Average("aten::add", [[8]], 9_000, 2), Average("aten::mm", [[64, 16], [16, 64]], 600, 4),
                    Average("aten::mm", [[64, 64], [64, 64]], 3_000, 2)]

    work = [Work("gemm", 1_500), Work("dropout", 200), Work("gemm", 1_500), Work("dropout", 200)]
    monkeypatch.setattr(step_profile, "device_work", lambda prof: work)
    text = "\n".join(step_profile.kernel_tables(Prof(), steps=2))
    assert "(1.7 ms per step; ms per step, share, calls per step)" in text
    assert "    1.50   88.2%      1.0  gemm" in text and "    0.20   11.8%      1.0  dropout" in text
    assert text.index("gemm") < text.index("dropout")
    shapes = text.split("Matmuls by input shapes")[1]
    assert "aten::add" not in shapes
    assert shapes.index("    1.50      1.0  aten::mm [[64, 64], [64, 64]]") < \
        shapes.index("    0.30      2.0  aten::mm [[64, 16], [16, 64]]")
