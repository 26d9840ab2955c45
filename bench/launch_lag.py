"""Whether the GPU waits for the host: each idle gap of a profiled step, split by who made it wait.

`step_profile.py --gaps` says how long the GPU is idle, not why. This reads the Chrome trace that
`step_profile.py --gaps --trace FILE` writes, pairs every kernel, memset and copy with the runtime
call that launched it (their `correlation` ids) and splits each gap before it in two:
  - host-bound: the launch call began after the GPU had run out of work, so the host was late;
  - waited: the work was launched earlier and still started late (a dependency, another stream).
It totals both per phase of the step, told apart by kernel names: the optimizer from its first
multi-tensor or fused-optimizer kernel, the backward from the first kernel whose name says
"backward", the forward from the first kernel after the optimizer. It also gives the host's lead in
each phase: the median time from a launch call to its kernel's start (near zero: the GPU runs each
kernel as soon as the host launches it).

    python bench/step_profile.py --arch llama-3-8b --quant 4bit --batch 2 --packing --steps 4 --gaps --trace t.json
    python bench/launch_lag.py t.json --steps 4
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
from collections import defaultdict

WORK = ("kernel", "gpu_memset", "gpu_memcpy")
LAUNCHES = ("cuda_runtime", "cuda_driver")
OPTIMIZER = ("multi_tensor_apply", "FusedOpti", "fused_adam")


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def next_phase(phase: str, name: str) -> str:
    if any(key in name for key in OPTIMIZER):
        return "optimizer"
    if phase == "optimizer":
        return "forward"
    if phase == "forward" and "backward" in name:
        return "backward"
    return phase


def launch_lag(events: list[dict]) -> dict[str, dict[str, float]]:
    """Per phase: host-bound and waited idle microseconds, busy microseconds, and the host's median
    lead (launch call to kernel start, microseconds)."""
    work = sorted((e for e in events if e.get("cat") in WORK), key=lambda e: e["ts"])
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in LAUNCHES and "correlation" in e.get("args", {})}
    totals: dict[str, dict[str, float]] = defaultdict(lambda: {"host_bound": 0.0, "waited": 0.0, "busy": 0.0})
    leads: dict[str, list[float]] = defaultdict(list)
    phase, reach = "forward", None
    for e in work:
        phase = next_phase(phase, e["name"])
        launch = launches.get(e.get("args", {}).get("correlation"))
        if launch is not None:
            leads[phase].append(e["ts"] - launch["ts"])
        if reach is not None and e["ts"] > reach:
            late_host = launch is not None and launch["ts"] >= reach
            totals[phase]["host_bound" if late_host else "waited"] += e["ts"] - reach
        totals[phase]["busy"] += e["dur"]
        reach = e["ts"] + e["dur"] if reach is None else max(reach, e["ts"] + e["dur"])
    for phase, lead in leads.items():
        totals[phase]["lead"] = statistics.median(lead)
    return dict(totals)


def report(totals: dict[str, dict[str, float]], steps: int) -> list[str]:
    lines = ["| phase | GPU busy ms per step | idle, host late ms per step | idle, waited ms per step "
             "| host's median lead ms |", "|---|---|---|---|---|"]
    for phase in ("forward", "backward", "optimizer"):
        if phase in totals:
            t = totals[phase]
            lines.append(f"| {phase} | {t['busy'] / 1e3 / steps:.1f} | {t['host_bound'] / 1e3 / steps:.2f} | "
                         f"{t['waited'] / 1e3 / steps:.2f} | {t.get('lead', 0.0) / 1e3:.2f} |")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", help="Chrome trace from step_profile.py --gaps --trace (.json or .json.gz)")
    p.add_argument("--steps", type=int, required=True, help="the profiled steps in it (step_profile's --steps)")
    args = p.parse_args()
    print("\n".join(report(launch_lag(load(args.trace)), args.steps)))


if __name__ == "__main__":
    main()
