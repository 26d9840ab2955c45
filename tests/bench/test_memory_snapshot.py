"""bench/memory_snapshot.py's analysis on a made-up CUDA memory history: the peak, and which optimizer
step allocated each block still live at it (a block from an earlier step outlived its step)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import memory_snapshot  # noqa: E402

MIB = 2**20
STEP = [{"filename": "/x/relaytune/training/step.py", "line": 1, "name": "_forward_backward"}]


def _event(action: str, addr: int, size: int, time_us: float) -> dict:
    return {"action": action, "addr": addr, "size": size, "time_us": time_us, "frames": STEP}


def test_the_peak_and_the_steps_that_allocated_what_is_live_at_it():
    trace = [
        _event("alloc", 0x1000, 4 * MIB, 100),  # step 1: a saved input that is never freed (outlives step 1)
        _event("alloc", 0x9000, 2 * MIB, 150),  # step 1: freed within it (4 + 2 MiB: below the peak)
        _event("free_requested", 0x9000, 2 * MIB, 160),
        _event("free_completed", 0x9000, 2 * MIB, 160),
        _event("alloc", 0x2000, 2 * MIB, 250),  # step 2
        _event("alloc", 0x3000, 1 * MIB, 260),  # step 2: the peak (4 + 2 + 1 MiB)
        _event("free_requested", 0x3000, 1 * MIB, 270),
        _event("free_completed", 0x3000, 1 * MIB, 270),
    ]
    snapshot = {"device_traces": [trace], "segments": []}
    result = memory_snapshot.analyse(snapshot, 0, {}, step_ends_us=[200.0, 300.0])
    assert result["peak_event"] == 5 and result["peak_allocated_gib"] == round(7 * MIB / 2**30, 3)
    assert result["peak_step"] == 2
    saved = result["categories"]["saved activations"]
    assert saved["blocks"] == 3
    assert saved["gib_by_allocating_step"] == {"1": round(4 * MIB / 2**30, 3), "2": round(3 * MIB / 2**30, 3)}


def test_the_step_of_an_event_counts_the_steps_ended_before_it():
    ends = [200.0, 300.0]
    assert [memory_snapshot.step_of(t, ends) for t in (50, 200, 201, 299, 301)] == [1, 2, 2, 2, 3]
    assert memory_snapshot.step_of(None, ends) is None


def test_peak_blocks_lists_the_largest_live_blocks_with_their_stacks():
    deep = [{"filename": "/x/torch/_inductor/runtime/benchmarking.py", "line": 649, "name": "benchmark_gpu"},
            *STEP]
    trace = [
        {**_event("alloc", 0x1000, 4 * MIB, 100)},
        {**_event("alloc", 0x2000, 8 * MIB, 250), "frames": deep},  # the peak's own allocation
        _event("alloc", 0x3000, 1 * MIB, 260),
        _event("free_requested", 0x1000, 4 * MIB, 270),
        _event("free_completed", 0x1000, 4 * MIB, 270),
    ]
    result = memory_snapshot.analyse({"device_traces": [trace], "segments": []}, 0, {},
                                     step_ends_us=[200.0, 300.0], peak_blocks=2)
    assert result["peak_event_stack"] == ["relaytune/training/step.py:1 _forward_backward"]
    assert [(b["mib"], b["step"]) for b in result["largest_blocks_at_peak"]] == [(8.0, 2), (4.0, 1)]
    assert result["largest_blocks_at_peak"][0]["stack"] == [
        "_inductor/runtime/benchmarking.py:649 benchmark_gpu", "relaytune/training/step.py:1 _forward_backward"]
    assert memory_snapshot.analyse({"device_traces": [trace], "segments": []}, 0, {})["largest_blocks_at_peak"] == []
