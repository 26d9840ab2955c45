"""The GPU's SM clock, power and throttle reasons while a benchmark child runs (`nvidia-smi --loop-ms`).

Why: in the sixteenth session relaytune's Llama-3-8B step lost 29 ms of GPU idle time per step and
its wall time did not move, because the same kernels took 33 ms longer; a GPU held at its power
limit runs slower when it never rests. This records what the GPU did, so a report can say whether a
run was power- or clock-bound instead of guessing. Nothing is recorded where nvidia-smi is missing.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import tempfile
from pathlib import Path

FIELDS = ["utilization.gpu", "clocks.sm", "power.draw", "temperature.gpu"]
# The throttle reasons' field was renamed; drivers know one name or both.
REASONS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active")
POWER_CAP = 0x4  # "SW power cap": the driver holds the clocks down to stay under the power limit
BUSY = 90  # percent utilisation from which a sample counts as the GPU at work


class PowerSampler:
    """`with PowerSampler() as s: ...` samples every `period_ms`; `s.summary()` afterwards."""

    def __init__(self, period_ms: int = 200):
        self.period_ms, self.proc, self.file = period_ms, None, None

    def __enter__(self) -> PowerSampler:
        exe = shutil.which("nvidia-smi")
        query = next((q for q in (",".join([*FIELDS, r]) for r in REASONS) if exe and subprocess.run(
            [exe, f"--query-gpu={q}", "--format=csv,noheader", "-i", "0"], capture_output=True).returncode == 0),
            None)
        if query is not None:
            self.file = Path(tempfile.mkstemp(suffix=".csv")[1])
            with self.file.open("w") as out:
                cmd = [exe, f"--query-gpu={query}", "--format=csv,noheader,nounits", "-i", "0",
                       f"--loop-ms={self.period_ms}"]
                self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.DEVNULL)
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def summary(self) -> dict | None:
        if self.file is None:
            return None
        text = self.file.read_text(errors="replace")
        self.file.unlink(missing_ok=True)
        return summarise(text)


def summarise(csv_text: str) -> dict | None:
    """Median SM clock and power, peak temperature and the share of samples held by the power cap,
    over the samples where the GPU was busy; None when there were none."""
    busy = []
    for line in csv_text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != len(FIELDS) + 1:
            continue
        try:
            util, clock, power, temp = (float(p) for p in parts[:4])
            reasons = int(parts[4], 16)
        except ValueError:  # "[N/A]", a header, a line cut off by the terminate
            continue
        if util >= BUSY:
            busy.append((clock, power, temp, reasons))
    if not busy:
        return None
    clocks, powers, temps, reasons = zip(*busy)
    return {"busy_samples": len(busy), "sm_clock_mhz_median": statistics.median(clocks),
            "sm_clock_mhz_min": min(clocks), "power_w_median": round(statistics.median(powers), 1),
            "temperature_c_max": max(temps),
            "power_capped_share": round(sum(1 for r in reasons if r & POWER_CAP) / len(busy), 3)}


def describe(gpu: dict | None) -> str:
    """One line for a report."""
    if not gpu:
        return "no nvidia-smi samples"
    return (f"SM clock median {gpu['sm_clock_mhz_median']:.0f} MHz (min {gpu['sm_clock_mhz_min']:.0f}), "
            f"power median {gpu['power_w_median']:.0f} W, held by the power cap in "
            f"{gpu['power_capped_share']:.0%} of {gpu['busy_samples']} busy samples, "
            f"up to {gpu['temperature_c_max']:.0f} C")
