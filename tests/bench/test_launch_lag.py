"""bench/launch_lag.py tells a GPU that waits for a late host from one that waits on earlier work."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _kernel(name, ts, dur, corr):
    return {"cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}


def _launch(ts, corr):
    return {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 5, "args": {"correlation": corr}}


# One step. Forward: "norm" runs 0-100; "mm" is launched at 130, after the GPU ran dry at 100, and
# runs 140-200: 40 us idle, the host late. Backward: "mm_backward" is launched at 150, while the GPU
# still had work, yet starts at 400: 200 us idle, waited. Optimizer: starts as "mm_backward" ends.
TRACE = [
    _launch(0, 1), _kernel("norm", 0, 100, 1),
    _launch(130, 2), _kernel("mm", 140, 60, 2),
    _launch(150, 3), _kernel("mm_backward", 400, 100, 3),
    _launch(160, 4), _kernel("multi_tensor_apply_kernel", 500, 10, 4),
    {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 1, "args": {}},
]


def test_idle_time_is_split_into_a_late_host_and_a_wait_on_earlier_work(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import launch_lag

    totals = launch_lag.launch_lag(TRACE)
    assert totals["forward"] == {"host_bound": 40.0, "waited": 0.0, "busy": 160.0, "lead": 5.0}
    assert totals["backward"] == {"host_bound": 0.0, "waited": 200.0, "busy": 100.0, "lead": 250.0}
    assert totals["optimizer"] == {"host_bound": 0.0, "waited": 0.0, "busy": 10.0, "lead": 340.0}


def test_it_reads_a_gzipped_trace_and_prints_per_step_figures(tmp_path):
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": TRACE}, f)
    r = subprocess.run([sys.executable, str(ROOT / "bench/launch_lag.py"), str(path), "--steps", "2"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "| forward | 0.1 | 0.02 | 0.00 | 0.01 |" in r.stdout
    assert "| backward | 0.1 | 0.00 | 0.10 | 0.25 |" in r.stdout
