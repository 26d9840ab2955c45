"""bench/graphs_proof.py's report: what makes the GPU proof of CUDA graphs a pass, and what does not."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CURVE = {s: 10.0 / s for s in range(1, 41)}


def _write(work: Path, phase: str, curve: dict[int, float], graphs_on: bool, **extra) -> None:
    out = work / "graphs"
    out.mkdir(exist_ok=True)
    result = {"phase": phase, "curve": {str(k): v for k, v in curve.items()}, "graphs_on": graphs_on,
              "median_tokens_per_second": 1000.0, "peak_memory_gib": 3.0, "speedups": [], "errors": [],
              "seconds": 1.0, **extra}
    (out / f"{phase}.json").write_text(json.dumps(result))


def _report(work: Path) -> tuple[int, dict]:
    r = subprocess.run([sys.executable, str(ROOT / "bench/graphs_proof.py"), "--phase", "report"],
                       capture_output=True, text=True, env={"BENCH_WORK": str(work), "PATH": ""}, timeout=120)
    return r.returncode, json.loads(r.stdout[r.stdout.index("{"):])


# Step 23 (1-based) redone at the same micro-batch once the graphs were given up.
OOM_EVENT = {"step": 22, "event": "oom", "micro_batch_size": 4, "was": 4, "released": ["cuda_graphs"]}


def _all_phases(work: Path, on: dict[int, float] = CURVE, graphs_on: bool = True, **oom) -> None:
    _write(work, "off", CURVE, False, exit=0)
    _write(work, "on", on, graphs_on, exit=0)
    _write(work, "resume", dict(on), graphs_on, first_exit=75, second_exit=0, stopped_at=25)
    _write(work, "oom", dict(on), graphs_on, **{"exit": 0, "oom_at": 23, "oom_events": [OOM_EVENT],
                                                 "graphs_dropped": graphs_on, **oom})


def test_equal_curves_with_graphs_on_and_a_resume_that_continues_pass(tmp_path):
    _all_phases(tmp_path)
    code, summary = _report(tmp_path)
    assert (code, summary["verdict"]) == (0, "PASS")
    assert summary["on_vs_off"] == {"steps_compared": 40, "max_rel_diff": 0.0, "steps_outside_tolerance": []}
    assert summary["resume_vs_on_after_stop"]["steps_compared"] == 15
    assert summary["oom_vs_on"]["steps_compared"] == 40
    assert summary["runs"]["oom"]["oom_events"] == [OOM_EVENT] and summary["runs"]["oom"]["graphs_dropped"]


def test_an_oom_that_kept_the_graphs_or_was_redone_otherwise_fails(tmp_path):
    _all_phases(tmp_path, graphs_dropped=False)  # the warning never came: the graphs stayed on
    assert _report(tmp_path)[1]["verdict"] == "FAIL"
    _all_phases(tmp_path, oom_events=[{**OOM_EVENT, "micro_batch_size": 2}])  # halved although graphs went
    assert _report(tmp_path)[1]["verdict"] == "FAIL"
    _all_phases(tmp_path, oom_events=[OOM_EVENT, {**OOM_EVENT, "step": 30}])  # a second, real OOM
    assert _report(tmp_path)[1]["verdict"] == "FAIL"
    _all_phases(tmp_path, exit=1)
    assert _report(tmp_path)[1]["verdict"] == "FAIL"


def test_a_curve_that_leaves_the_tolerance_fails_and_names_the_steps(tmp_path):
    drifted = {s: v * (1.05 if s >= 30 else 1.0) for s, v in CURVE.items()}
    _all_phases(tmp_path, on=drifted)
    code, summary = _report(tmp_path)
    assert (code, summary["verdict"]) == (1, "FAIL")
    assert summary["on_vs_off"]["steps_outside_tolerance"] == list(range(30, 41))


def test_graphs_that_never_ran_prove_nothing(tmp_path):
    _all_phases(tmp_path, graphs_on=False)  # e.g. a GPU whose setting fell back to off with a notice
    code, summary = _report(tmp_path)
    assert (code, summary["verdict"]) == (1, "FAIL")


def test_a_missing_resume_is_incomplete(tmp_path):
    _write(tmp_path, "off", CURVE, False, exit=0)
    _write(tmp_path, "on", CURVE, True, exit=0)
    code, summary = _report(tmp_path)
    assert (code, summary["verdict"], summary["missing_phases"]) == (1, "INCOMPLETE", ["resume", "oom"])
