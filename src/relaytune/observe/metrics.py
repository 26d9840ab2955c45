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

from relaytune import atomic


class MetricsLog:
    """The log file, plus optional sinks (trackers) that see every record written.

    A sink has `log(record)` and `rewind(step)`; `rewind` is called when the log is
    reset to an earlier checkpoint's copy, so a tracker can drop what comes after it.
    Sinks must not raise: `observe.trackers.Trackers` is the sink that wraps the
    trackers and isolates their failures.
    """

    def __init__(self, path: Path, sinks: list | None = None):
        self.path = Path(path)
        self._lines: list[str] | None = None
        self._behind = False  # the file lacks records that a disk error kept from it
        self._warned = False
        self.sinks = list(sinks or [])

    def add_sink(self, sink) -> None:
        self.sinks.append(sink)

    def text(self) -> str:
        """The log as it should stand (kept in memory, so a full disk cannot make it lose lines).

        A torn tail on disk (a kill mid-append, NUL padding after a crash) is dropped with a
        notice, and the next write rewrites the file without it instead of appending to it."""
        if self._lines is None:
            raw = self.path.read_bytes() if self.path.exists() else b""
            self._lines, torn = clean_lines(raw, self.path)
            self._behind = self._behind or torn
        return "".join(self._lines)

    def _rewrite(self) -> None:
        """Replace the file with the in-memory log; on a disk error, try again at the next write."""
        try:
            atomic.replace_file(self.path, "".join(self._lines or []))
            self._behind = False
        except OSError as e:
            self._behind = True
            self._warn_once(e)

    def _warn_once(self, e: OSError) -> None:
        if not self._warned:
            self._warned = True
            from relaytune.log import warn

            warn(f"cannot write {self.path.name} ({e.strerror or e}); its records are kept and "
                 "written once the disk allows")

    def reset_to(self, text: str) -> None:
        self._lines, _ = clean_lines(text.encode("utf-8"), self.path)
        self._rewrite()
        if self.sinks:
            steps = [r["step"] for r in parse_records(text) if isinstance(r.get("step"), int)]
            for sink in self.sinks:
                sink.rewind(max(steps, default=0))

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
        for sink in self.sinks:
            sink.log(clean)


def _record(line: bytes) -> dict | None:
    """The JSON object on one line, or None if the line holds none (torn, NUL bytes, not JSON)."""
    try:
        record = json.loads(line.decode("utf-8"))
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return None
    return record if isinstance(record, dict) else None


def clean_lines(raw: bytes, path: Path | str | None = None) -> tuple[list[str], bool]:
    """The good lines of a JSONL file's bytes, each ending in a newline, and whether any were dropped.

    A line that holds no JSON object (a truncated last line from a kill mid-write, the NUL
    padding a crashed filesystem leaves, a damaged line) is dropped, with a notice naming the
    file and the line when `path` is given. Blank lines are dropped silently.
    """
    lines, dropped = [], []
    for number, line in enumerate(raw.split(b"\n"), start=1):
        if not line.strip(b" \t\r\0"):
            if line.strip(b" \t\r"):  # NUL padding only
                dropped.append(number)
            continue
        if _record(line) is None:
            dropped.append(number)
            continue
        lines.append(line.rstrip(b"\r").decode("utf-8") + "\n")
    if dropped and path is not None:
        from relaytune.log import notice

        where = f"line {dropped[0]}" if len(dropped) == 1 else f"lines {', '.join(map(str, dropped[:5]))}" + \
            (" ..." if len(dropped) > 5 else "")
        notice(f"{path}: {where} is torn or damaged (a write cut short by a kill or a crash); ignored it")
    return lines, bool(dropped)


def read_records(path: Path) -> list[dict]:
    """Every record of a JSONL file that relaytune writes; a torn tail is dropped with a notice."""
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        return []
    except OSError as e:
        from relaytune.log import notice

        notice(f"cannot read {path} ({e.strerror or e}); ignored it")
        return []
    return [json.loads(line) for line in clean_lines(raw, path)[0]]


def read_metrics(path: Path) -> list[dict]:
    return read_records(path)


def parse_records(text: str) -> list[dict]:
    """Records of a log text, skipping a torn last line (the file may be mid-append)."""
    out = []
    for line in text.splitlines():
        record = _record(line.encode("utf-8", "surrogatepass"))
        if record is not None:
            out.append(record)
    return out


class SessionLog:
    """sessions.jsonl: one `start` record per session and one `end` record if it ended
    on its own. A start without an end is a session that was killed."""

    def __init__(self, path: Path):
        self.path = Path(path)
        raw = self.path.read_bytes() if self.path.is_file() else b""
        lines, torn = clean_lines(raw, self.path)
        self.session = sum(1 for line in lines if json.loads(line).get("event") == "start") + 1
        if torn:  # rewrite without the torn bytes, so the next record does not glue onto them
            try:
                atomic.replace_file(self.path, "".join(lines))
            except OSError:
                pass  # _append starts on a new line instead

    def _append(self, record: dict) -> None:
        try:
            with open(self.path, "ab") as fh:
                line = json.dumps({"session": self.session, "time": time.time(), **record}) + "\n"
                if fh.tell() and not _ends_with_newline(self.path):
                    line = "\n" + line
                fh.write(line.encode("utf-8"))
                fh.flush()
                os.fsync(fh.fileno())
        except OSError:
            pass  # informational only; a full disk must not stop training

    def start(self, from_step: int, total_steps: int, world_size: int = 1) -> None:
        self._append({"event": "start", "pid": os.getpid(), "from_step": from_step, "total_steps": total_steps,
                      "world_size": world_size})

    def end(self, how: str, at_step: int) -> None:
        self._append({"event": "end", "how": how, "at_step": at_step})


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as fh:
        fh.seek(-1, os.SEEK_END)
        return fh.read(1) == b"\n"
