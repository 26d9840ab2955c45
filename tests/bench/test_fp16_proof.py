"""bench/fp16_proof.py's report: a proof with a phase missing is not a pass."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _phase(curve: dict[int, float]) -> dict:
    return {"curve": {str(k): v for k, v in curve.items()}, "scaler_skips": [], "other_events": [],
            "scalers": {"30": {"scale": 65536.0, "growth_tracker": 30}}}


def _report(work: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "bench/fp16_proof.py"), "--phase", "report", "--arch", "tiny"],
                          capture_output=True, text=True, env={"BENCH_WORK": str(work), "PATH": ""}, timeout=120)


def test_a_report_without_the_resume_phase_is_incomplete_and_fails(tmp_path):
    out = tmp_path / "fp16"
    out.mkdir()
    curve = {s: 1.0 / s for s in range(1, 31)}
    (out / "bf16.json").write_text(json.dumps(_phase(curve)))
    (out / "fp16.json").write_text(json.dumps(_phase(curve)))
    r = _report(tmp_path)
    assert r.returncode == 1, r.stderr[-2000:]
    summary = json.loads(r.stdout[r.stdout.index("{"):])
    assert summary["verdict"] == "INCOMPLETE"
    assert summary["missing_phases"] == ["resume"]
    assert summary["steps_outside_tolerance"] == []  # the curves that did run agree: that alone is not a pass
