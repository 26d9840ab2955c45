"""bench/gpu_power.py: what nvidia-smi said while a benchmark child ran, over the busy samples only."""

from __future__ import annotations

import os
import stat
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import gpu_power  # noqa: E402


def test_the_summary_counts_busy_samples_and_the_power_cap_bit():
    text = ("100, 1980, 650.5, 60, 0x0000000000000000\n"
            "99, 1700, 699.9, 71, 0x0000000000000004\n"
            "97, 1755, 700.1, 70, 0x0000000000000024\n"
            "5, 1980, 90.0, 40, 0x0000000000000000\n"   # idle: not counted
            "[N/A], 1980, 90.0, 40, 0x0\n"                # unreadable: skipped
            "98, 17")                                      # cut off by the terminate: skipped
    got = gpu_power.summarise(text)
    assert got == {"busy_samples": 3, "sm_clock_mhz_median": 1755.0, "sm_clock_mhz_min": 1700.0,
                   "power_w_median": 699.9, "temperature_c_max": 71.0, "power_capped_share": 0.667}
    assert gpu_power.describe(got) == ("SM clock median 1755 MHz (min 1700), power median 700 W, held by the "
                                       "power cap in 67% of 3 busy samples, up to 71 C")
    assert gpu_power.summarise("5, 1980, 90.0, 40, 0x0\n") is None
    assert gpu_power.describe(None) == "no nvidia-smi samples"


def test_without_nvidia_smi_nothing_is_sampled(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with gpu_power.PowerSampler() as sampler:
        pass
    assert sampler.summary() is None


def test_the_sampler_runs_nvidia_smi_with_the_reasons_field_this_driver_knows(tmp_path, monkeypatch):
    """A driver that knows only the old name of the throttle reasons' field."""
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\n"
                    "case \"$*\" in *clocks_event_reasons*) exit 6;; esac\n"
                    "case \"$*\" in *--loop-ms=*)\n"
                    "  while true; do echo '100, 1600, 700.0, 65, 0x4'; sleep 0.05; done;; esac\n"
                    "echo '0, 1980, 70.0, 30, 0x0'\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    with gpu_power.PowerSampler(period_ms=50) as sampler:
        deadline = time.monotonic() + 60
        while sampler.file.read_text().count("\n") < 2 and time.monotonic() < deadline:
            time.sleep(0.05)  # a loaded machine may start the fake nvidia-smi late
    got = sampler.summary()
    assert got is not None and got["busy_samples"] >= 2
    assert (got["sm_clock_mhz_median"], got["power_w_median"], got["power_capped_share"]) == (1600.0, 700.0, 1.0)
