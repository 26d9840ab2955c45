"""Goodput under repeated kills, on the CPU, with a small random model.

Trains one config three ways and prints one JSON line each:
  - uninterrupted;
  - SIGKILLed every K seconds (K = 30 and 60 by default) and re-run until it exits 0;
and reports wall time, steps recomputed after kills, resume-to-first-step time
against a cold start, and whether the final adapter is byte-identical.

    python bench/goodput.py --kill-every 30 60 --steps 300 --save-every-seconds 10
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
from relaytune.observe.metrics import parse_records  # noqa: E402
from relaytune.tiny import make_tiny_model  # noqa: E402


def records(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return parse_records(path.read_text()) if path.exists() else []  # a torn last line is being written


def session(cfg: Path, run: Path, kill_after: float | None) -> dict:
    """One process: how long until its first new step, how far it got, how it ended."""
    before = max((r["step"] for r in records(run) if "loss" in r), default=0)
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "relaytune.cli", "train", str(cfg)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    first = None
    while proc.poll() is None:
        now = time.monotonic() - t0
        if first is None and max((r["step"] for r in records(run) if "loss" in r), default=0) != before:
            first = now
        if kill_after is not None and now >= kill_after:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            break
        time.sleep(0.05)
    reached = max((r["step"] for r in records(run) if "loss" in r), default=0)
    return {"seconds": time.monotonic() - t0, "first_step_after": first, "reached": reached,
            "returncode": proc.returncode}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--kill-every", type=float, nargs="+", default=[30, 60])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--save-every-seconds", type=float, default=10)
    p.add_argument("--work", default="/tmp/relaytune-goodput")
    args = p.parse_args()
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    model = make_tiny_model(work / "model", hidden=256, layers=4, heads=8, kv_heads=4, intermediate=768)
    data = work / "data.jsonl"
    with open(data, "w") as fh:
        for i in range(512):
            fh.write(json.dumps({"text": " ".join(f"word{(i * 7 + j) % 97}" for j in range(200))}) + "\n")

    def config(name: str) -> Path:
        path = work / f"{name}.yaml"
        path.write_text(json.dumps({
            "model": str(model), "dataset": str(data), "output_dir": str(work / name),
            "max_steps": args.steps, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2,
            "max_seq_length": 256, "save_steps": 100000, "save_every_seconds": args.save_every_seconds,
            "logging_steps": 1, "lora_dropout": 0.1}))
        return path

    cold = session(config("uninterrupted"), work / "uninterrupted", None)
    ref = (work / "uninterrupted/final/adapter_model.safetensors").read_bytes()
    print(json.dumps({"case": "uninterrupted", "wall_seconds": round(cold["seconds"], 1),
                      "first_step_after_seconds": round(cold["first_step_after"], 2),
                      "steps": args.steps}))
    for k in args.kill_every:
        name = f"killed-every-{int(k)}s"
        cfg, run = config(name), work / name
        sessions = []
        while True:
            s = session(cfg, run, k)
            sessions.append(s)
            if s["returncode"] == 0 or len(sessions) > 50:
                break
        # Steps done again: how far each killed session got beyond where the next one resumed.
        starts = [r["from_step"] for r in _starts(run)]
        recomputed = sum(max(prev["reached"] - nxt_from, 0) for prev, nxt_from in zip(sessions, starts[1:]))
        resumes = [s["first_step_after"] for s in sessions[1:]]
        same = (run / "final/adapter_model.safetensors").read_bytes() == ref
        print(json.dumps({
            "case": name, "sessions": len(sessions), "wall_seconds": round(sum(s["seconds"] for s in sessions), 1),
            "uninterrupted_wall_seconds": round(cold["seconds"], 1), "steps_recomputed": recomputed,
            "resume_to_first_step_seconds": [round(x, 2) for x in resumes if x is not None],
            "cold_start_to_first_step_seconds": round(cold["first_step_after"], 2),
            "byte_identical": same}))


def _starts(run: Path) -> list[dict]:
    path = run / "sessions.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if '"start"' in line] if path.exists() else []


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
