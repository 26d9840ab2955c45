"""`relaytune status RUN_DIR`: where a run stands, from another shell, even mid-training.

Only reads what training writes (metrics.jsonl, sessions.jsonl, progress.json,
checkpoint manifests, mirror_state.json), tolerating a torn last line or a
checkpoint pruned while we look. It writes one thing: the plot PNG. No torch.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from relaytune.atomic import read_manifest, verify
from relaytune.observe.metrics import parse_records
from relaytune.run_dir import ADAPTER, AdapterRef, newest_state, run_dir, step_checkpoints
from relaytune.observe.trackers import read_progress

PLOT = "training_plot.png"
BARS = "▁▂▃▄▅▆▇█"


@dataclass
class CheckpointInfo:
    name: str
    step: int | None
    size: int
    age_s: float | None
    eval_loss: float | None
    problem: str | None  # None: verified intact; "not verified" with --no-verify
    best: bool = False


@dataclass
class SessionInfo:
    session: int
    started: float
    ended: float | None
    how: str  # finished, signal, time_limit, oom, error: X, killed, running
    from_step: int
    reached: int | None  # furthest step this session computed, if known
    recomputed: int | None = None  # steps it redid that the previous session had already computed
    pid: int | None = None
    total: int | None = None  # the run's total steps as this session counted them


@dataclass
class RunStatus:
    run: Path
    state: str
    step: int
    total: int | None
    seconds_per_step: float | None
    checkpoints: list[CheckpointInfo] = field(default_factory=list)
    sessions: list[SessionInfo] = field(default_factory=list)
    mirror: dict | None = None
    records: list[dict] = field(default_factory=list)
    plot: Path | None = None

    @property
    def eta_s(self) -> float | None:
        if self.total is None or self.seconds_per_step is None:
            return None
        return max(self.total - self.step, 0) * self.seconds_per_step


def run_status(run: str | Path, check_files: bool = True, plot: bool = True) -> RunStatus:
    out = run_dir(run)
    records = parse_records(_read(out / "metrics.jsonl"))
    train = [r for r in records if "loss" in r and "event" not in r and isinstance(r.get("step"), int)]
    progress = read_progress(out)
    sessions = read_sessions(out, progress)
    state = newest_state(out) or {}
    total = next((s.total for s in reversed(sessions) if s.total), None) or state.get("total_steps")
    finished = verify(out / "final") is None if (out / "final").exists() else False
    step = max([train[-1]["step"] if train else 0] + [s.reached or 0 for s in sessions[-1:]])
    if finished:
        run_state = "finished"
        step = total or step
    elif not sessions:
        run_state = "not started"
    else:
        last = sessions[-1]
        run_state = {"running": f"running (pid {last.pid})", "killed": "interrupted (killed: no end record)"}.get(
            last.how, f"stopped ({last.how}); run the same command to continue")
    st = RunStatus(out, run_state, step, total, _pace(sessions, progress, train),
                   checkpoints(out, records, state, check_files, total), sessions, _mirror(out), records)
    if plot:
        st.plot = write_plot(records, out / PLOT)
    return st


def read_sessions(out: Path, progress: dict | None = None) -> list[SessionInfo]:
    progress = read_progress(out) if progress is None else progress
    found: dict[int, SessionInfo] = {}
    for r in parse_records(_read(out / "sessions.jsonl")):
        n = r.get("session")
        if r.get("event") == "start":
            found[n] = SessionInfo(n, r.get("time"), None, "killed", r.get("from_step", 0), None,
                                pid=r.get("pid"), total=r.get("total_steps"))
        elif r.get("event") == "end" and n in found:
            s = found[n]
            s.ended, s.how, s.reached = r.get("time"), r.get("how", "?"), r.get("at_step")
    ordered = [found[k] for k in sorted(found)]
    for i, s in enumerate(ordered):
        beat = progress.get(str(s.session), {})
        s.reached = max([v for v in (s.reached, beat.get("step")) if v is not None], default=None)
        if s.ended is None and i == len(ordered) - 1 and _alive(s.pid):
            s.how = "running"
        if i > 0 and ordered[i - 1].reached is not None:
            s.recomputed = max(ordered[i - 1].reached - s.from_step, 0)
    return ordered


def _alive(pid: int | None) -> bool:
    """Whether a process with this pid runs on this machine (a zombie does not count)."""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _pace(sessions, progress: dict, train: list[dict]) -> float | None:
    """Seconds per step: wall clock of the latest session (saves and evals included), else
    from the logged token throughput."""
    if sessions:
        beat = progress.get(str(sessions[-1].session), {})
        if beat.get("first_time") and beat.get("time", 0) > beat["first_time"] and beat["step"] > beat["first_step"]:
            return (beat["time"] - beat["first_time"]) / (beat["step"] - beat["first_step"])
    recent = [r for r in train if r.get("tokens_per_second") and r.get("tokens_seen")][-6:]
    if len(recent) >= 2 and recent[-1]["step"] > recent[0]["step"]:
        tokens_per_step = (recent[-1]["tokens_seen"] - recent[0]["tokens_seen"]) / (recent[-1]["step"] - recent[0]["step"])
        rates = sorted(r["tokens_per_second"] for r in recent)
        return tokens_per_step / rates[len(rates) // 2]
    return None


def checkpoints(out: Path, records: list[dict], state: dict, check_files: bool,
                total: int | None = None) -> list[CheckpointInfo]:
    from relaytune.commands.evaluate import cached_losses

    evals = {r["step"]: r["eval_loss"] for r in records if r.get("eval_loss") is not None and "step" in r}
    cached = cached_losses(out)
    best_step = (state.get("counters") or {}).get("best_step")  # the best so far, mid-training
    try:
        best_step = read_manifest(out / "best").get("step", best_step)  # final word once written
    except (OSError, ValueError):
        pass
    refs = step_checkpoints(out) + [AdapterRef(n, out / n, None) for n in ("best", "final")
                                    if (out / n / "manifest.json").is_file()]
    found, by_sha = [], {}
    for ref in refs:
        try:
            manifest = read_manifest(ref.path)
            size = sum(f.stat().st_size for f in ref.path.iterdir() if f.is_file())
        except (OSError, ValueError):
            continue  # pruned or being replaced while we looked
        step = ref.step if ref.step is not None else manifest.get("step", total if ref.name == "final" else None)
        sha = manifest.get("files", {}).get(ADAPTER, {}).get("sha256")
        # A checkpoint's loss is training's eval at its step; best/ carries its own; final/ is either
        # a copy of one of those (load_best_model_at_end) or the model evaluated at the last step.
        loss = evals.get(step) if ref.name.startswith("step-") else manifest.get("eval_loss")
        if loss is None:
            loss = next((v for v in (by_sha.get(sha), evals.get(step), cached.get(sha)) if v is not None), None)
        by_sha.setdefault(sha, loss)
        created = manifest.get("created")
        found.append(CheckpointInfo(ref.name, step, size, time.time() - created if created else None, loss,
                                    verify(ref.path) if check_files else "not verified",
                                    best=ref.name.startswith("step-") and step == best_step))
    return found


def _mirror(out: Path) -> dict | None:
    try:
        data = json.loads((out / "mirror_state.json").read_text())
    except (OSError, ValueError):
        return None
    from relaytune.checkpoint.mirror import redact  # never print a credential that a URL may carry

    if isinstance(data.get("url"), str):
        data["url"] = redact(data["url"])
    return data


def sparkline(values: list[float], width: int = 48) -> str:
    """Values squeezed into `width` bars (means of equal slices), lowest ▁ to highest █."""
    values = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    if not values:
        return ""
    if len(values) > width:
        n = len(values)
        values = [sum(values[i * n // width:(i + 1) * n // width]) / max(len(values[i * n // width:(i + 1) * n // width]), 1)
                  for i in range(width)]
    lo, hi = min(values), max(values)
    span = hi - lo or 1.0
    return "".join(BARS[min(int((v - lo) / span * len(BARS)), len(BARS) - 1)] for v in values)


def write_plot(records: list[dict], path: Path) -> Path | None:
    """Loss and eval loss over steps, and the learning rate below; None without matplotlib or data."""
    train = [r for r in records if "loss" in r and "event" not in r and r.get("loss") is not None]
    evals = [r for r in records if r.get("eval_loss") is not None]
    if not train and not evals:
        return None
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        from relaytune.log import notice

        notice("pip install matplotlib to get the plot")
        return None
    # The object API with the Agg canvas: no pyplot, no global backend switched in a user's notebook.
    fig = Figure(figsize=(8, 6), dpi=100)
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    top.plot([r["step"] for r in train], [r["loss"] for r in train], label="loss", linewidth=1)
    if evals:
        top.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="eval_loss")
    top.set_ylabel("loss")
    top.legend()
    top.grid(alpha=0.3)
    lr = [r for r in train if r.get("learning_rate") is not None]
    bottom.plot([r["step"] for r in lr], [r["learning_rate"] for r in lr], color="tab:green", linewidth=1)
    bottom.set_ylabel("learning rate")
    bottom.set_xlabel("step")
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    tmp = path.with_name(f".relaytune-tmp-{path.name}")
    fig.savefig(tmp, format="png")
    os.replace(tmp, path)  # a viewer never sees a half-written PNG
    return path


def format_status(st: RunStatus) -> str:
    lines = [f"run      {st.run}", f"state    {st.state}"]
    pct = f" ({st.step / st.total:.0%})" if st.total else ""
    lines.append(f"steps    {st.step} / {st.total if st.total else '?'}{pct}")
    if st.seconds_per_step and st.total and st.step < st.total:
        label = "ETA     " if st.state.startswith("running") else "to go   "
        lines.append(f"{label} {_duration(st.eta_s)}  ({st.seconds_per_step:.2f} s/step measured)")
    train = [r for r in st.records if "loss" in r and "event" not in r and r.get("loss") is not None]
    evals = [r for r in st.records if r.get("eval_loss") is not None]
    if train:
        losses = [r["loss"] for r in train]
        lines.append(f"loss     {sparkline(losses)}  {losses[0]:.4f} -> {losses[-1]:.4f} (min {min(losses):.4f})")
    if len(evals) > 1:
        e = [r["eval_loss"] for r in evals]
        lines.append(f"eval     {sparkline(e, 24)}  {e[0]:.4f} -> {e[-1]:.4f} (min {min(e):.4f})")
    lrs = [r["learning_rate"] for r in train if r.get("learning_rate") is not None]
    if lrs:
        lines.append(f"lr       {sparkline(lrs)}  now {lrs[-1]:.2e}")
    lines += ["", "checkpoints (* best eval loss):",
              f"  {'name':<12} {'step':>6} {'size':>9} {'age':>8} {'eval_loss':>9}  verified"]
    for c in st.checkpoints:
        ok = "ok" if c.problem is None else c.problem
        loss = f"{c.eval_loss:.4f}" if c.eval_loss is not None else "-"
        lines.append(f"  {c.name + (' *' if c.best else ''):<12} {c.step if c.step is not None else '-':>6} "
                     f"{_size(c.size):>9} {_duration(c.age_s):>8} {loss:>9}  {ok}")
    if not st.checkpoints:
        lines.append("  none committed yet")
    lines += ["", "sessions:", f"  {'#':>3}  {'started':<19}  {'ended':<19}  {'how':<16} {'steps':<13} recomputed"]
    for s in st.sessions:
        reach = f"{s.from_step}->{s.reached if s.reached is not None else '?'}"
        redo = "-" if s.session == st.sessions[0].session else (str(s.recomputed) if s.recomputed is not None else "?")
        lines.append(f"  {s.session:>3}  {_clock(s.started):<19}  {_clock(s.ended):<19}  {s.how:<16} {reach:<13} {redo}")
    if st.mirror:
        m = st.mirror
        lines += ["", f"mirror   {m.get('url')}: last mirrored step {m.get('last_mirrored_step')}, "
                      f"{_duration(time.time() - m['time']) + ' ago' if m.get('time') else 'never'}"
                      + (f"; last error: {m['last_error']}" if m.get("last_error") else "")]
    if st.plot:
        lines += ["", f"plot     {st.plot}"]
    return "\n".join(lines)


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except OSError:
        return ""


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _duration(s: float | None) -> str:
    if s is None:
        return "-"
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def _clock(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"


def main(args) -> None:
    """`relaytune status` (see cli.py for the options)."""
    print(format_status(run_status(args.run_dir, check_files=not args.no_verify, plot=not args.no_plot)))
