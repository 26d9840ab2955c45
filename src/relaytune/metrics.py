"""metrics.jsonl: one JSON object per logged step, continued without gaps or duplicates.

Each checkpoint carries the log as it stood at its step. A resume puts that
copy back (atomically), so records written after the checkpoint by the killed
session disappear and are written again as the steps are redone.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path


class MetricsLog:
    def __init__(self, path: Path):
        self.path = Path(path)

    def text(self) -> str:
        return self.path.read_text(encoding="utf-8") if self.path.exists() else ""

    def reset_to(self, text: str) -> None:
        tmp = self.path.with_name(f".relaytune-tmp-{self.path.name}")
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.path)

    def write(self, record: dict) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        if any(isinstance(v, float) and not math.isfinite(v) for v in record.values()):
            clean["non_finite"] = [k for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)]
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(clean) + "\n")


def read_metrics(path: Path) -> list[dict]:
    out = []
    if Path(path).exists():
        for line in Path(path).read_text(encoding="utf-8").splitlines():
            if line.strip():
                out.append(json.loads(line))
    return out


class SessionLog:
    """sessions.jsonl: one `start` record per session and one `end` record if it ended
    on its own. A start without an end is a session that was killed."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.session = sum(1 for r in read_metrics(self.path) if r.get("event") == "start") + 1

    def _append(self, record: dict) -> None:
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps({"session": self.session, "time": time.time(), **record}) + "\n")
            fh.flush()
            os.fsync(fh.fileno())

    def start(self, from_step: int, total_steps: int) -> None:
        self._append({"event": "start", "pid": os.getpid(), "from_step": from_step, "total_steps": total_steps})

    def end(self, how: str, at_step: int) -> None:
        self._append({"event": "end", "how": how, "at_step": at_step})
