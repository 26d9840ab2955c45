"""How bench/multi_gpu.py runs one relaytune session and reads what it left (its measurements are there).

Every session is `relaytune.train` in a child process (`multi_gpu.py _child`, the launcher when num_gpus > 1,
whose workers are its own children), so a measurement can SIGTERM the launcher or SIGKILL one worker. The
memory cap of the `t4` measurement reaches the spawned workers through a sitecustomize.py on PYTHONPATH.
Figures come from metrics.jsonl, sessions.jsonl and checkpoints/*/trainer_state.json.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"
sys.path.insert(0, str(SRC))
from relaytune.observe.metrics import parse_records  # noqa: E402

SITECUSTOMIZE = '''\
import os
_cap = os.environ.get("RELAYTUNE_BENCH_CAP_GIB")
try:
    with open("/proc/self/cmdline", "rb") as _fh:
        _cmd = _fh.read()
except OSError:
    _cmd = b""
if _cap and b"spawn_main" in _cmd:  # a worker spawned by torch's elastic agent
    import torch

    _set_device = torch.cuda.set_device

    def _capped_set_device(device):
        _set_device(device)
        index = torch.cuda.current_device()
        total = torch.cuda.get_device_properties(index).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, float(_cap) * 2**30 / total), index)

    torch.cuda.set_device = _capped_set_device
'''


def cuda() -> bool:
    import torch

    return torch.cuda.is_available()


# --- one session in a child process -------------------------------------------------------------

def child(args) -> None:
    """relaytune.train(cfg, **overrides) in this process (the launcher when num_gpus > 1)."""
    import relaytune
    from relaytune.errors import StoppedEarly, UserError

    cfg, overrides = json.loads(args.cfg), json.loads(args.set or "{}")
    cap = os.environ.get("RELAYTUNE_BENCH_CAP_GIB")
    if cap and {**cfg, **overrides}.get("num_gpus") == 1 and cuda():
        import torch

        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, float(cap) * 2**30 / total))
    try:
        relaytune.train(cfg, **overrides)
    except StoppedEarly as e:
        print(f"stopped: {e}", file=sys.stderr)
        sys.exit(75)
    except UserError as e:
        print(f"user error: {e}", file=sys.stderr)
        sys.exit(2)


def child_env(args, slow: bool = False, cap: float | None = None) -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.setdefault("OMP_NUM_THREADS", "1" if not cuda() else env.get("OMP_NUM_THREADS", "4"))
    path = [str(SRC)]
    if cap is not None:
        folder = Path(tempfile.mkdtemp(prefix="relaytune-cap-"))
        (folder / "sitecustomize.py").write_text(SITECUSTOMIZE)
        path.insert(0, str(folder))
        env["RELAYTUNE_BENCH_CAP_GIB"] = str(cap)
    env["PYTHONPATH"] = os.pathsep.join(path + [p for p in [env.get("PYTHONPATH")] if p])
    if slow and args.arch == "tiny":
        env["RELAYTUNE_SLOW_STEP"] = "0.3"  # so that a signal lands mid-run on the tiny model
    return env


def workers(pid: int) -> list[int]:
    """The launcher's worker processes: its children, less multiprocessing's resource tracker."""
    pids: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    for task in tasks:
        try:
            pids += [int(x) for x in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
        except OSError:
            pass
    out = []
    for p in pids:
        try:
            if b"resource_tracker" in Path(f"/proc/{p}/cmdline").read_bytes():
                continue
        except OSError:
            continue
        out.append(p)
    return sorted(out)


def session(args, cfg: dict, overrides: dict | None = None, *, stop_at: int | None = None,
            kill_worker_at: int | None = None, cap: float | None = None) -> dict:
    """Run one session; SIGTERM the launcher after step `stop_at`, or SIGKILL its last worker after
    step `kill_worker_at`. Returns rc, wall seconds and what was done to it."""
    cmd = [sys.executable, str(HERE / "multi_gpu.py"), "_child", "--cfg", json.dumps(cfg),
           "--set", json.dumps(overrides or {})]
    env = child_env(args, slow=stop_at is not None or kill_worker_at is not None, cap=cap)
    metrics = Path(cfg["output_dir"]) / "metrics.jsonl"
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    out: dict = {}
    target = stop_at if stop_at is not None else kill_worker_at
    while target is not None and proc.poll() is None:
        if any(r.get("step", 0) >= target for r in steps_of(metrics)):
            if stop_at is not None:
                proc.send_signal(signal.SIGTERM)
                out["sigterm_after_step"] = max(r["step"] for r in steps_of(metrics))
            else:
                pids = workers(proc.pid)
                out["workers_seen"] = pids
                if pids:
                    os.kill(pids[-1], signal.SIGKILL)
                    out["sigkill_worker_after_step"] = max(r["step"] for r in steps_of(metrics))
                    out["killed_pid"] = pids[-1]
            print(f"# {json.dumps(out)}", file=sys.stderr)
            break
        time.sleep(0.05)
    try:
        out["rc"] = proc.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its workers: this session's own group
        proc.wait()
        out["rc"] = "timeout"
    out["wall_seconds"] = round(time.monotonic() - t0, 1)
    return out


# --- reading a run ------------------------------------------------------------------------------

def records(path: Path) -> list[dict]:
    return parse_records(path.read_text()) if path.exists() else []  # a torn last line is being written


def steps_of(metrics: Path) -> list[dict]:
    return [r for r in records(metrics) if "loss" in r and "event" not in r]


def curve(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in steps_of(run / "metrics.jsonl")}  # a redone step: last record


def throughput(run: Path) -> dict:
    steps = steps_of(run / "metrics.jsonl")
    warm = steps[3:] or steps
    return {"steps": len(steps),
            "tokens_per_second_median": round(statistics.median(r["tokens_per_second"] for r in warm), 1)
            if warm else None,
            "peak_memory_gib_rank0": max((r.get("peak_memory_gib", 0) for r in steps), default=None)}


def starts(run: Path) -> list[dict]:
    return [r for r in records(run / "sessions.jsonl") if r.get("event") == "start"]


def trainer_states(run: Path) -> dict[int, dict]:
    out = {}
    for ckpt in (run / "checkpoints").glob("step-*"):
        try:
            out[int(ckpt.name[5:])] = json.loads((ckpt / "trainer_state.json").read_text())
        except (OSError, ValueError):
            pass
    return dict(sorted(out.items()))


def adapter_diff(a: Path, b: Path) -> float | None:
    from safetensors.torch import load_file

    fa, fb = a / "final/adapter_model.safetensors", b / "final/adapter_model.safetensors"
    if not (fa.exists() and fb.exists()):
        return None
    x, y = load_file(fa), load_file(fb)
    return max(((x[k].float() - y[k].float()).abs().max().item() for k in x if k in y), default=None)
