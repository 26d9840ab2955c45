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
    """The log file, plus optional sinks (trackers) that see every record written.

    A sink has `log(record)` and `rewind(step)`; `rewind` is called when the log is
    reset to an earlier checkpoint's copy, so a tracker can drop what comes after it.
    A failing sink is warned about once and never stops training.
    """

    def __init__(self, path: Path, sinks: list | None = None):
        self.path = Path(path)
        self._lines: list[str] | None = None
        self._behind = False  # the file lacks records that a disk error kept from it
        self._warned = False
        self.sinks = list(sinks or [])
        self._sink_failed: set[int] = set()

    def add_sink(self, sink) -> None:
        self.sinks.append(sink)

    def _fan_out(self, method: str, arg) -> None:
        for sink in self.sinks:
            try:
                getattr(sink, method)(arg)
            except Exception as e:  # a tracker must never stop training
                if id(sink) not in self._sink_failed:
                    self._sink_failed.add(id(sink))
                    from relaytune.log import warn

                    warn(f"{type(sink).__name__}.{method} failed ({type(e).__name__}: {e}); "
                         "metrics.jsonl is unaffected, training continues")

    def text(self) -> str:
        """The log as it should stand (kept in memory, so a full disk cannot make it lose lines)."""
        if self._lines is None:
            self._lines = (self.path.read_text(encoding="utf-8").splitlines(keepends=True)
                           if self.path.exists() else [])
        return "".join(self._lines)

    def _rewrite(self) -> None:
        """Replace the file with the in-memory log; on a disk error, try again at the next write."""
        tmp = self.path.with_name(f".relaytune-tmp-{self.path.name}")
        try:
            with open(tmp, "w", encoding="utf-8") as fh:
                fh.write("".join(self._lines or []))
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.path)
            self._behind = False
        except OSError as e:
            self._behind = True
            tmp.unlink(missing_ok=True)
            self._warn_once(e)

    def _warn_once(self, e: OSError) -> None:
        if not self._warned:
            self._warned = True
            from relaytune.log import warn

            warn(f"cannot write {self.path.name} ({e.strerror or e}); its records are kept and "
                 "written once the disk allows")

    def reset_to(self, text: str) -> None:
        self._lines = text.splitlines(keepends=True)
        self._rewrite()
        if self.sinks:
            steps = [r["step"] for r in parse_records(text) if isinstance(r.get("step"), int)]
            self._fan_out("rewind", max(steps, default=0))

    def write(self, record: dict) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        if any(isinstance(v, float) and not math.isfinite(v) for v in record.values()):
            clean["non_finite"] = [k for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)]
        self.text()
        self._lines.append(json.dumps(clean) + "\n")
        if self._behind:
            self._rewrite()
        else:
            try:
                with open(self.path, "a", encoding="utf-8") as fh:
                    fh.write(self._lines[-1])
            except OSError as e:
                self._behind = True
                self._warn_once(e)
        if self.sinks:
            self._fan_out("log", clean)


def read_metrics(path: Path) -> list[dict]:
    out = []
    if Path(path).exists():
        for line in Path(path).read_text(encoding="utf-8").splitlines():
            if line.strip():
                out.append(json.loads(line))
    return out


def parse_records(text: str) -> list[dict]:
    """Records of a log text, skipping a torn last line (the file may be mid-append)."""
    out = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            out.append(record)
    return out


class SessionLog:
    """sessions.jsonl: one `start` record per session and one `end` record if it ended
    on its own. A start without an end is a session that was killed."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.session = sum(1 for r in read_metrics(self.path) if r.get("event") == "start") + 1

    def _append(self, record: dict) -> None:
        try:
            with open(self.path, "a", encoding="utf-8") as fh:
                fh.write(json.dumps({"session": self.session, "time": time.time(), **record}) + "\n")
                fh.flush()
                os.fsync(fh.fileno())
        except OSError:
            pass  # informational only; a full disk must not stop training

    def start(self, from_step: int, total_steps: int) -> None:
        self._append({"event": "start", "pid": os.getpid(), "from_step": from_step, "total_steps": total_steps})

    def end(self, how: str, at_step: int) -> None:
        self._append({"event": "end", "how": how, "at_step": at_step})
