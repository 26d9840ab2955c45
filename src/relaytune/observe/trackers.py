"""Experiment trackers (`report_to`) that continue the same run across resumes.

metrics.jsonl stays the record of truth; trackers are sinks of MetricsLog and see
every record it writes. The rule for a resume from the checkpoint at step s: the
points up to s were already sent by an earlier session, and points after s are
about to be recomputed. So:
  - tensorboard: the same log folder, reopened with purge_step=s+1, so readers drop
    the killed session's points past the checkpoint; flushed after every record, so
    a kill never loses a point the checkpoint already covers;
  - wandb / mlflow / trackio: a run id kept in output_dir and resumed; wandb and
    mlflow skip steps the run already holds (a resumed run recomputes the same
    values, so nothing is missing and nothing is doubled), and are sent again,
    from metrics.jsonl, the points up to the checkpoint that they lack (a kill
    loses what a tracker had not uploaded yet).
A tracker that is new to the run is back-filled from metrics.jsonl. A tracker
that fails to import, connect or log is warned about once and then ignored:
training never stops for it. `Trackers` is the one place that isolates their
errors. `Heartbeat` (observe/progress.py, always on) is one of the sinks.
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
from pathlib import Path

from relaytune import atomic
from relaytune.log import warn
from relaytune.observe.metrics import parse_records
from relaytune.observe.progress import Heartbeat
from relaytune.run_dir import RunDir, read_text_or_empty

TRAIN_KEYS = ("loss", "learning_rate", "grad_norm", "epoch", "tokens_seen", "tokens_per_second")


def scalars(record: dict) -> dict[str, float]:
    """Tracker names (HF's train/ and eval/ prefixes) of one metrics.jsonl record."""
    if "event" in record or not isinstance(record.get("step"), int):
        return {}  # events (skipped steps, rollbacks) are not points on a curve
    out = {}
    if _number(record.get("eval_loss")):
        out["eval/loss"] = float(record["eval_loss"])
    for k in TRAIN_KEYS:
        if _number(record.get(k)):
            out[f"train/{k}"] = float(record[k])
    return out


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def tracker_names(cfg) -> list[str]:
    names = [cfg.report_to] if isinstance(cfg.report_to, str) else list(cfg.report_to)
    return [n for n in names if n != "none"]


class Trackers:
    """The sink MetricsLog fans out to. A tracker that fails is warned about once and never
    stops training or affects another tracker."""

    def __init__(self, sinks: list):
        self.sinks = sinks
        self._failed: set[str] = set()

    def log(self, record: dict) -> None:
        self._each("log", record)

    def rewind(self, step: int) -> None:
        self._each("rewind", step)

    def close(self) -> None:
        self._each("close")

    def _each(self, method: str, *args) -> None:
        for sink in list(self.sinks):
            try:
                getattr(sink, method)(*args)
            except Exception as e:
                name = type(sink).__name__
                if name not in self._failed:
                    self._failed.add(name)
                    warn(f"tracker {name}: {method} failed ({type(e).__name__}: {e}); training continues, "
                         "metrics.jsonl has every point")


def open_trackers(cfg, out: Path, start_step: int, session: int | None = None) -> Trackers:
    """Call after metrics.jsonl was reset to the resumed checkpoint's copy (or emptied)."""
    out = Path(out)
    history = [r for r in parse_records(read_text_or_empty(RunDir(out).metrics))
               if isinstance(r.get("step"), int) and r["step"] <= start_step]
    sinks: list = [Heartbeat(out, start_step, session)]
    for name in tracker_names(cfg):
        try:
            sinks.append(OPENERS[name](cfg, out, start_step, history))
        except Exception as e:  # ImportError, network, bad credentials: never fatal
            hint = f" (pip install {name})" if isinstance(e, ImportError) else ""
            warn(f"report_to {name}: not available{hint}: {type(e).__name__}: {e}. "
                 "Training continues; metrics.jsonl has every point")
    return Trackers(sinks)


def public_config(cfg) -> dict:
    """The config for a tracker's run page, without anything that may hold a credential."""
    secret = re.compile(r"token|secret|password|passwd|credential|api_key|auth", re.I)
    clean = {}
    for k, v in cfg.model_dump(mode="json").items():
        if secret.search(k):
            continue
        if isinstance(v, str) and "://" in v:
            v = re.sub(r"//[^/@]*@", "//", v).split("?")[0]  # user:pass@ and ?query may hold keys
        clean[k] = v
    return clean


def _run_state(out: Path, name: str) -> tuple[Path, dict | None]:
    path = RunDir(out).tracker_state(name)
    try:
        return path, json.loads(path.read_text())
    except (OSError, ValueError):
        return path, None


def _write_json(path: Path, data: dict) -> None:
    atomic.replace_file(path, json.dumps(data, indent=1))


class TensorBoard:
    def __init__(self, cfg, out: Path, start_step: int, history: list[dict]):
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self._writer_class = SummaryWriter
        self.dir = RunDir(out).tensorboard
        existing = self.dir.is_dir() and any(self.dir.glob("events.out.tfevents.*"))
        self.writer = self._open(start_step if existing else None)
        if not existing:
            for record in history:  # a tracker added mid-run: give it the curve so far
                self.log(record, flush=False)
            self.writer.flush()

    def _open(self, resumed_at: int | None):
        # purge_step: readers drop this folder's points at steps >= it (the killed session's tail)
        return self._writer_class(str(self.dir), purge_step=None if resumed_at is None else resumed_at + 1)

    def log(self, record: dict, flush: bool = True) -> None:
        for key, value in scalars(record).items():
            self.writer.add_scalar(key, value, record["step"])
        if flush:
            self.writer.flush()  # a SIGKILL must not lose points the next checkpoint will cover

    def rewind(self, step: int) -> None:
        self.writer.close()
        self.writer = self._open(step)

    def close(self) -> None:
        self.writer.close()


class Wandb:
    def __init__(self, cfg, out: Path, start_step: int, history: list[dict]):
        import wandb

        state_path, state = _run_state(out, "wandb")
        new = state is None
        if new:  # the id is chosen and stored first, so a kill right after init still resumes it
            state = {"id": secrets.token_hex(4), "project": os.environ.get("WANDB_PROJECT", "relaytune")}
            _write_json(state_path, state)
        # allow_val_change: harmless keys (time_limit, save_steps...) may differ between sessions
        kwargs = dict(project=state["project"], id=state["id"], resume="allow", dir=str(out),
                      name=cfg.run_name or out.name, config=public_config(cfg), allow_val_change=True)
        try:
            self.run = wandb.init(**kwargs)
        except Exception as e:  # no network or no login: keep the points offline, sync later
            warn(f"wandb could not start online ({type(e).__name__}: {e}); logging offline into "
                 f"{RunDir(out).wandb}; upload later with `wandb sync`")
            self.run = wandb.init(mode="offline", **kwargs)
        # A resumed online run starts at the server's next step; anything below is already there.
        # What the server lacks up to the checkpoint is sent again from metrics.jsonl: a SIGKILL
        # loses the points wandb had not uploaded yet (offline, all of the killed session's).
        self.floor = int(getattr(self.run, "step", 0) or 0)
        for record in history:
            self.log(record)

    def log(self, record: dict) -> None:
        values = scalars(record)
        if values and record["step"] >= self.floor:
            self.run.log(values, step=record["step"])

    def rewind(self, step: int) -> None:
        pass  # wandb cannot delete points; the recomputed steps are skipped as already present

    def close(self) -> None:
        self.run.finish()


class MLflow:
    def __init__(self, cfg, out: Path, start_step: int, history: list[dict]):
        import mlflow

        if not os.environ.get("MLFLOW_TRACKING_URI"):
            mlflow.set_tracking_uri(RunDir(out).mlruns.resolve().as_uri())  # beside the run, not in the cwd
        self.mlflow = mlflow
        state_path, state = _run_state(out, "mlflow")
        if state:  # mlflow keeps every value it is given, so skip the steps the run already holds
            self.run = mlflow.start_run(run_id=state["run_id"])
            history_points = mlflow.tracking.MlflowClient().get_metric_history(state["run_id"], "train/loss")
            self.floor = max((m.step for m in history_points), default=0) + 1
        else:
            self.run = mlflow.start_run(run_name=cfg.run_name or out.name)
            _write_json(state_path, {"run_id": self.run.info.run_id})
            mlflow.log_params({k: str(v)[:500] for k, v in public_config(cfg).items()})
            self.floor = 0
        for record in history:  # up to the checkpoint: whatever the run lacks
            self.log(record)

    def log(self, record: dict) -> None:
        values = scalars(record)
        if values and record["step"] >= self.floor:
            self.mlflow.log_metrics(values, step=record["step"])

    def rewind(self, step: int) -> None:
        pass

    def close(self) -> None:
        self.mlflow.end_run()


class Trackio:
    def __init__(self, cfg, out: Path, start_step: int, history: list[dict]):
        import trackio

        self.trackio = trackio
        state_path, state = _run_state(out, "trackio")
        new = state is None
        if new:
            state = {"project": os.environ.get("TRACKIO_PROJECT", "relaytune"),
                     "name": cfg.run_name or f"{out.name}-{secrets.token_hex(3)}"}
            _write_json(state_path, state)
        trackio.init(project=state["project"], name=state["name"], config=public_config(cfg), resume="allow")
        self.floor = start_step + 1 if not new else 0
        if new:
            for record in history:
                self.log(record)

    def log(self, record: dict) -> None:
        values = scalars(record)
        if values and record["step"] >= self.floor:
            self.trackio.log(values, step=record["step"])

    def rewind(self, step: int) -> None:
        pass

    def close(self) -> None:
        self.trackio.finish()


OPENERS = {"tensorboard": TensorBoard, "wandb": Wandb, "mlflow": MLflow, "trackio": Trackio}
