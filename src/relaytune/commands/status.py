"""`relaytune status RUN_DIR`: where a run stands, from another shell, even mid-training.

Only reads what training writes (metrics.jsonl, sessions.jsonl, progress.json,
checkpoint manifests, mirror_state.json), tolerating a torn last line or a
checkpoint pruned while we look. It writes one thing: the plot PNG, in the run folder
(never in a checkpoint, final/ or best/), skipped with a warning where that folder is read-only. No torch.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from relaytune import atomic
from relaytune.atomic import MANIFEST, read_manifest, verify
from relaytune.commands.run_folder import run_folder
from relaytune.log import warn
from relaytune.observe.metrics import read_records
from relaytune.observe.progress import read_progress
from relaytune.run_dir import ADAPTER, AdapterRef, RunDir, saved_config, step_checkpoints

BARS = "▁▂▃▄▅▆▇█"
DESCRIPTION = ("Where a run stands, from any shell, also while it trains: steps and ETA, checkpoints (size, "
               "age, eval loss, verified), sessions and how each ended, mirror state; writes a "
               "loss/learning-rate plot PNG.")


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("status", help="progress, ETA, checkpoints, sessions and a plot; works while training",
                              description=DESCRIPTION)
    p.add_argument("run_dir", help="the run's output_dir")
    p.add_argument("--no-verify", action="store_true", help="skip re-hashing checkpoint files (faster)")
    p.add_argument("--no-plot", action="store_true", help="do not write the plot PNG")
    return p


def run(args: argparse.Namespace) -> None:
    print(format_status(run_status(args.run_dir, check_files=not args.no_verify, plot=not args.no_plot)))


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
    processes: int | None = None  # ranks that trained in this session (GPUs, or CPU processes); None: not recorded


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
    out = run_folder(run, "status")  # never a checkpoint: a plot written there would invalidate it
    layout = RunDir(out)
    records = read_records(layout.metrics)
    train = [r for r in records if "loss" in r and "event" not in r and isinstance(r.get("step"), int)]
    progress = read_progress(out)
    sessions = read_sessions(out, progress)
    state = saved_config(out) or {}  # the newest checkpoint's, else final/'s relaytune.json
    total = next((s.total for s in reversed(sessions) if s.total), None) or state.get("total_steps")
    finished = verify(layout.final) is None if layout.final.exists() else False
    committed = [ref.step for ref in step_checkpoints(out)]
    step = newest_step(train, progress, committed + [s.reached or 0 for s in sessions[-1:]])
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
        config = state.get("config") or {}
        try:
            st.plot = write_plot(records, layout.plot, title=f"{out.name}: step {step} / {total if total else '?'}",
                                 warmup=_warmup(config, total), checkpoints=committed)
        except OSError as e:  # a read-only run folder (Kaggle's /kaggle/input) still gets its report
            warn(f"cannot write {layout.plot} ({e.strerror or e}); no plot this time (--no-plot skips it)")
    return st


def newest_step(train: list[dict], progress: dict, committed: list[int]) -> int:
    """The furthest step the run is known to have reached: progress.json lags by up to logging_steps,
    and metrics.jsonl is cut back on a resume, so the newest of those and of the committed
    checkpoints (and session end records)."""
    steps = [train[-1]["step"] if train else 0]
    steps += [e["step"] for e in progress.values() if isinstance(e.get("step"), int)]
    return max(steps + [s for s in committed if isinstance(s, int)])


def _warmup(config: dict, total: int | None) -> int:
    """Warm-up steps as training computes them (training.optim.warmup_steps), without torch."""
    try:
        if (config.get("warmup_steps") or 0) > 0:
            return int(config["warmup_steps"])
        return math.ceil(float(config.get("warmup_ratio") or 0) * (total or 0))
    except (TypeError, ValueError, OverflowError):
        return 0


def read_sessions(out: Path, progress: dict | None = None) -> list[SessionInfo]:
    progress = read_progress(out) if progress is None else progress
    found: dict[int, SessionInfo] = {}
    for r in read_records(RunDir(out).sessions):
        n = r.get("session")
        if not isinstance(n, int):
            continue
        if r.get("event") == "start":
            found[n] = SessionInfo(n, r.get("time"), None, "killed", r.get("from_step", 0), None,
                                pid=r.get("pid"), total=r.get("total_steps"), processes=r.get("world_size"))
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
        first, last = recent[0], recent[-1]
        tokens_per_step = (last["tokens_seen"] - first["tokens_seen"]) / (last["step"] - first["step"])
        rates = sorted(r["tokens_per_second"] for r in recent)
        return tokens_per_step / rates[len(rates) // 2]
    return None


def checkpoints(out: Path, records: list[dict], state: dict, check_files: bool,
                total: int | None = None) -> list[CheckpointInfo]:
    from relaytune.commands.evaluate import cached_losses

    evals = {r["step"]: r["eval_loss"] for r in records if r.get("eval_loss") is not None
             and isinstance(r.get("step"), int)}
    cached = cached_losses(out)
    layout = RunDir(out)
    best_step = (state.get("counters") or {}).get("best_step")  # the best so far, mid-training
    try:
        best_step = read_manifest(layout.best).get("step", best_step)  # final word once written
    except (OSError, ValueError):
        pass
    refs = step_checkpoints(out) + [AdapterRef(p.name, p, None) for p in (layout.best, layout.final)
                                    if (p / MANIFEST).is_file()]
    found, by_sha = [], {}
    for ref in refs:
        try:
            manifest = read_manifest(ref.path)
            size = sum(f.stat().st_size for f in ref.path.iterdir() if f.is_file())
        except (OSError, ValueError):
            continue  # pruned or being replaced while we looked
        step = ref.step
        if step is None:
            step = manifest.get("step", total if ref.path == layout.final else None)
        sha = manifest.get("files", {}).get(ADAPTER, {}).get("sha256")
        # A checkpoint's loss is training's eval at its step; best/ carries its own; final/ is either
        # a copy of one of those (load_best_model_at_end) or the model evaluated at the last step.
        loss = evals.get(step) if ref.is_step else manifest.get("eval_loss")
        if loss is None:
            loss = next((v for v in (by_sha.get(sha), evals.get(step), cached.get(sha)) if v is not None), None)
        by_sha.setdefault(sha, loss)
        created = manifest.get("created")
        found.append(CheckpointInfo(ref.name, step, size, time.time() - created if created else None, loss,
                                    verify(ref.path) if check_files else "not verified",
                                    best=ref.is_step and step == best_step))
    return found


def _mirror(out: Path) -> dict | None:
    try:
        data = json.loads(RunDir(out).mirror_state.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    from relaytune.redact import redact_url  # never print a credential that a URL or an error may carry

    for key in ("url", "last_error"):
        if isinstance(data.get(key), str):
            data[key] = redact_url(data[key])
    return data


def sparkline(values: list[float], width: int = 48) -> str:
    """Values squeezed into `width` bars (means of equal slices), lowest ▁ to highest █."""
    values = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    if not values:
        return ""
    if len(values) > width:
        n = len(values)
        slices = [values[i * n // width:(i + 1) * n // width] for i in range(width)]
        values = [sum(part) / max(len(part), 1) for part in slices]
    lo, hi = min(values), max(values)
    span = hi - lo or 1.0
    return "".join(BARS[min(int((v - lo) / span * len(BARS)), len(BARS) - 1)] for v in values)


def write_plot(records: list[dict], path: Path, title: str | None = None, warmup: int = 0,
               checkpoints: list[int] = ()) -> Path | None:
    """Loss and eval loss over steps, and the learning rate below; None without matplotlib or data."""
    fig = plot_figure(records, title, warmup, checkpoints)
    if fig is None:
        return None
    png = io.BytesIO()
    fig.savefig(png, format="png")
    atomic.replace_file(path, png.getvalue())  # a viewer never sees a half-written PNG
    return path


def plot_figure(records: list[dict], title: str | None = None, warmup: int = 0, checkpoints: list[int] = ()):
    """The plot as a matplotlib Figure (Agg canvas): loss on a log scale with eval loss on top, the
    learning rate below; warm-up shaded, committed checkpoints as dotted vertical lines (gid
    "checkpoint"). None without matplotlib or data."""
    def plottable(r, key):
        v = r.get(key)
        return isinstance(r.get("step"), (int, float)) and isinstance(v, (int, float)) and math.isfinite(v)

    train = [r for r in records if "event" not in r and plottable(r, "loss")]
    evals = [r for r in records if plottable(r, "eval_loss")]
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
    losses = [r["loss"] for r in train] + [r["eval_loss"] for r in evals]
    if all(v > 0 for v in losses):  # a log scale shows the late, small improvements
        top.set_yscale("log")
    top.set_ylabel("loss (log scale)" if top.get_yscale() == "log" else "loss")
    lr = [r for r in train if plottable(r, "learning_rate")]
    bottom.plot([r["step"] for r in lr], [r["learning_rate"] for r in lr], color="tab:green", linewidth=1)
    for ax in (top, bottom):
        if warmup > 0:
            ax.axvspan(0, warmup, color="tab:orange", alpha=0.12, gid="warmup",
                       label=f"warm-up ({warmup} steps)" if ax is top else None)
        for n, step in enumerate(sorted(set(checkpoints))):
            ax.axvline(step, color="grey", linestyle=":", linewidth=0.8, gid="checkpoint",
                       label="checkpoint" if ax is top and n == 0 else None)
        ax.grid(alpha=0.3)
    top.legend()
    bottom.set_ylabel("learning rate")
    bottom.set_xlabel("step")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


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
    lines += ["", "sessions:", f"  {'#':>3}  {'started':<19}  {'ended':<19}  {'how':<16} {'steps':<13} "
              f"{'recomputed':<10}  processes"]
    for s in st.sessions:
        reach = f"{s.from_step}->{s.reached if s.reached is not None else '?'}"
        redo = "-" if s.session == st.sessions[0].session else (str(s.recomputed) if s.recomputed is not None else "?")
        lines.append(f"  {s.session:>3}  {_clock(s.started):<19}  {_clock(s.ended):<19}  "
                     f"{s.how:<16} {reach:<13} {redo:<10}  {s.processes if s.processes else '?'}")
    if st.mirror:
        m = st.mirror
        lines += ["", f"mirror   {m.get('url')}: last mirrored step {m.get('last_mirrored_step')}, "
                      f"{_duration(time.time() - m['time']) + ' ago' if m.get('time') else 'never'}"
                      + (f"; last error: {m['last_error']}" if m.get("last_error") else "")]
    if st.plot:
        lines += ["", f"plot     {st.plot}"]
    return "\n".join(lines)


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

