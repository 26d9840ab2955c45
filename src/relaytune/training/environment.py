"""The deadline each platform implies, and whether output_dir survives the session
(platforms.py says which platform this is).

Everything reads the environment passed in (default os.environ), so tests fake
a platform by handing in a dict.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from relaytune.config.checks import parse_duration, parse_timestamp
from relaytune.config.schema import TrainConfig
from relaytune.log import warn
from relaytune.platforms import COLAB_DRIVE, KAGGLE_PERSISTENT, platform
from relaytune.training.stops import Deadline

KAGGLE_SESSION_SECONDS = 12 * 3600  # Kaggle's documented limit for CPU and GPU sessions
def time_budget(cfg: TrainConfig, env=None, now: float | None = None,
                session_start: float | None = None) -> Deadline:
    """The earliest of: time_limit from now, the deadline key, the platform's own limit."""
    env = os.environ if env is None else env
    now = time.time() if now is None else now
    candidates: list[tuple[float, str]] = []
    if cfg.time_limit:
        candidates.append((now + parse_duration(cfg.time_limit), f"time_limit {cfg.time_limit}"))
    if cfg.deadline:
        candidates.append((parse_timestamp(cfg.deadline), f"deadline {cfg.deadline}"))
    where = platform(env)
    if where == "slurm":
        end = slurm_end_time(env)
        if end is not None:
            candidates.append((end, f"SLURM job {env.get('SLURM_JOB_ID')} time limit"))
    elif where == "kaggle":
        start = session_start if session_start is not None else _machine_start_time()
        candidates.append((start + KAGGLE_SESSION_SECONDS, "Kaggle's 12 h session limit"))
    if not candidates:
        return Deadline(None, "none")
    end, source = min(candidates)
    return Deadline(end, source)


def slurm_end_time(env) -> float | None:
    """The job's end time: SLURM_JOB_END_TIME (Slurm >= 23.02), else squeue."""
    raw = env.get("SLURM_JOB_END_TIME")
    if raw and raw.strip().isdigit():
        return float(raw)
    job = env.get("SLURM_JOB_ID")
    if not job:
        return None
    try:
        out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%e"], capture_output=True,
                             text=True, timeout=10).stdout.strip()
        return parse_timestamp(out) if out and out not in ("N/A", "NONE") else None
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def _machine_start_time() -> float:
    """When this machine (container) booted: a Kaggle session starts with its machine. A machine up
    for longer than a session is not a fresh Kaggle container: count from now instead."""
    try:
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - uptime if uptime < KAGGLE_SESSION_SECONDS else time.time()
    except (OSError, ValueError, IndexError):
        return time.time()


def storage_warnings(output_dir: Path, env=None) -> list[str]:
    """Warnings when output_dir will not survive the session, naming the absolute path."""
    env = os.environ if env is None else env
    where = platform(env)
    out = Path(output_dir).resolve()
    if where == "kaggle" and not _inside(out, KAGGLE_PERSISTENT):
        return [f"output_dir is {out}, outside {KAGGLE_PERSISTENT}: Kaggle keeps only "
                f"{KAGGLE_PERSISTENT} when the session ends. Use e.g. output_dir: {KAGGLE_PERSISTENT}/run"]
    if where == "colab" and not _inside(out, COLAB_DRIVE):
        return [f"output_dir is {out}, on the Colab machine's own disk, which is wiped when the "
                "session ends. Mount Google Drive (from google.colab import drive; "
                "drive.mount('/content/drive')) and use output_dir: /content/drive/MyDrive/run, "
                "or set mirror_to to a Drive folder"]
    return []


def warn_storage(output_dir: Path, env=None) -> None:
    for message in storage_warnings(output_dir, env):
        warn(message)


def _inside(path: Path, root: Path) -> bool:
    try:
        path.relative_to(root)
        return True
    except ValueError:
        return False
