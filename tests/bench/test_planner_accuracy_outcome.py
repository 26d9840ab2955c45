"""bench/planner_accuracy.py's account of a capped run: what its OOMs changed."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import planner_accuracy  # noqa: E402


def test_a_run_redone_at_the_same_micro_batch_is_not_said_to_step_down():
    outcome = planner_accuracy._capped_outcome
    assert outcome({"oom": False}) == "ran"
    assert outcome({"oom": True, "final_micro_batch": 2}) == "OOM, stepped down to 2"  # an older record
    assert (outcome({"oom": True, "final_micro_batch": 8, "released": ["compile_checkpoint"], "started_at": 8})
            == "OOM, redone without compile_checkpoint")
    assert (outcome({"oom": True, "final_micro_batch": 4, "released": ["cuda_graphs"], "started_at": 8})
            == "OOM, redone without cuda_graphs, then stepped down to 4")
