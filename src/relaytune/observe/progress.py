"""progress.json: per session, the furthest step reached and when, for `relaytune status`.

metrics.jsonl cannot tell this after a kill (a resume cuts it back to the checkpoint),
and it is what "steps recomputed after an interruption" needs. Torch-free: `status`
reads it while a run trains.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from relaytune import atomic
from relaytune.log import notice
from relaytune.run_dir import RunDir


class Heartbeat:
    """A sink of MetricsLog (always on) that records this session's furthest step and pace."""

    def __init__(self, out: Path, start_step: int, session: int | None):
        self.path = RunDir(Path(out)).progress
        self.key = str(session if session is not None else f"pid-{os.getpid()}")
        self.entry = {"pid": os.getpid(), "from_step": start_step, "first_step": None, "first_time": None,
                      "step": start_step, "time": time.time()}

    def log(self, record: dict) -> None:
        if "loss" not in record or "event" in record or not isinstance(record.get("step"), int):
            return
        now, e = time.time(), self.entry
        if e["first_time"] is None:
            e["first_step"], e["first_time"] = record["step"], now
        e["step"], e["time"] = max(e["step"], record["step"]), now
        if "tokens_seen" in record:
            e["tokens_seen"] = record["tokens_seen"]
        data = read_progress(self.path.parent)
        data[self.key] = e
        atomic.replace_file(self.path, json.dumps(data, indent=1), durable=False)

    def rewind(self, step: int) -> None:
        pass  # the furthest step stays: it is what was computed

    def close(self) -> None:
        pass


def read_progress(out: Path) -> dict:
    """session -> its entry; {} when absent. A torn or NUL-padded file (a crashed filesystem:
    the file itself is replaced atomically) is read up to its padding, or ignored, with a notice;
    the next heartbeat replaces it whole."""
    path = RunDir(Path(out)).progress
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return {}
    except OSError as e:
        notice(f"cannot read {path} ({e.strerror or e}); ignored it")
        return {}
    body = raw.rstrip(b"\0 \t\r\n")
    line = body.count(b"\n") + 1
    try:
        data = json.loads(body.decode("utf-8")) if body else {}
    except (ValueError, RecursionError):
        notice(f"{path}: line {line} is torn or damaged (a write cut short by a crash); "
               "ignored the file, the next step rewrites it")
        return {}
    if len(body) != len(raw.rstrip(b" \t\r\n")):
        notice(f"{path}: NUL padding after line {line} (a crashed filesystem); ignored it")
    if not isinstance(data, dict):
        return {}
    return {k: v for k, v in data.items() if isinstance(v, dict)}
