"""Reading a checkpoint back: everything is read, verified and parsed *before* any live object
is touched, and applying it is all or nothing.

    load(source)          read every file once (bytes), check it against the manifest in memory,
                          parse it all (safetensors, JSON of the exact shape): a `Loaded`
    check_fits(l, live)   the parsed state matches the live model and optimizer (keys, shapes, finite)
    apply(l, live)        put it into the live objects; if that still fails, the live objects are
                          put back exactly as they were (from an in-memory copy) before re-raising

Any problem is raised as `Damaged(reason)`, never as anything else: the caller sets the
checkpoint aside and falls back to the previous one. A checkpoint whose bytes match its manifest
but do not parse, or parse to the wrong shape, is damaged like one whose bytes do not match.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError
from safetensors.torch import load as load_tensors

from relaytune.atomic import MANIFEST, parse_manifest
from relaytune.run_dir import ADAPTER, ADAPTER_CONFIG, METRICS, OPTIMIZER, RNG, STEP_DIR, TRAINER_STATE

REQUIRED = frozenset({ADAPTER, ADAPTER_CONFIG, RNG, TRAINER_STATE, METRICS})
KNOWN = REQUIRED | {OPTIMIZER}
PER_ELEMENT = ("exp_avg", "exp_avg_sq", "momentum_buffer", "state1", "state2", "max_exp_avg_sq")


class Damaged(Exception):
    """A checkpoint that cannot be restored; str(e) is the reason."""


class _Progress(BaseModel):
    model_config = ConfigDict(extra="allow")
    step: Annotated[StrictInt, Field(ge=0)]
    tokens_seen: Annotated[StrictInt, Field(ge=0)] = 0
    skipped_steps: Annotated[StrictInt, Field(ge=0)] = 0
    last_eval_loss: float | None = None
    best_eval_loss: float | None = None
    best_step: Annotated[StrictInt, Field(ge=0)] | None = None


class _Recovery(BaseModel):
    model_config = ConfigDict(extra="allow")
    micro_batch_size: Annotated[StrictInt, Field(ge=1)]
    accumulation: Annotated[StrictInt, Field(ge=1)]
    lr_scale: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 1.0
    consecutive_bad_steps: Annotated[StrictInt, Field(ge=0)] = 0


class _Window(BaseModel):
    model_config = ConfigDict(extra="allow")
    window_loss: Annotated[float, Field(allow_inf_nan=False)]
    window_steps: Annotated[StrictInt, Field(ge=0)]


class _BatchConfig(BaseModel):
    model_config = ConfigDict(extra="allow")
    per_device_train_batch_size: Annotated[StrictInt, Field(ge=1)] | Literal["auto"]
    gradient_accumulation_steps: Annotated[StrictInt, Field(ge=1)]


class _TrainerState(BaseModel):
    model_config = ConfigDict(extra="allow")
    progress: dict[str, Any] | None = None
    recovery: dict[str, Any] | None = None
    log_window: dict[str, Any] | None = None
    counters: dict[str, Any] | None = None  # checkpoints of 0.1
    config: dict[str, Any]
    data_fingerprint: StrictStr
    scheduler: dict[str, Any] | None
    scaler: dict[str, Any] | None = None
    python_rng: list
    numpy_rng: dict[str, Any]
    has_optimizer: StrictBool


@dataclass
class Loaded:
    """A checkpoint read and parsed in memory, not yet applied."""

    where: str  # for messages: the folder name, or "the start"
    path: Path | None  # the folder; None for an in-memory snapshot
    state: dict  # trainer_state.json
    adapter: dict[str, torch.Tensor]
    optimizer: dict | None  # a torch optimizer state_dict
    rng: dict[str, torch.Tensor]
    metrics: str


def load(source: Path | dict, where: str | None = None) -> Loaded:
    """Read and parse a checkpoint folder (verified against its manifest) or an in-memory snapshot."""
    try:
        return _load(source, where)
    except Damaged:
        raise
    except Exception as e:  # whatever a damaged file makes a parser raise
        raise Damaged(f"{type(e).__name__}: {str(e)[:200]}") from None


def _load(source: Path | dict, where: str | None) -> Loaded:
    if isinstance(source, dict):
        raw = {name: (data() if callable(data) else data) for name, data in source.items()}
        where = where or "the start"
    else:
        raw = read_verified(Path(source))
        where = where or Path(source).name
    state = _parse_state(raw[TRAINER_STATE])
    step = state["progress_step"]
    if not isinstance(source, dict) and (m := STEP_DIR.match(Path(source).name)) and int(m.group(1)) != step:
        raise Damaged(f"trainer_state.json is for step {step}, the folder for step {m.group(1)}")
    missing = REQUIRED - raw.keys() | ({OPTIMIZER} - raw.keys() if state["has_optimizer"] else set())
    if missing:
        raise Damaged(f"missing file {sorted(missing)[0]}")
    config = json.loads(raw[ADAPTER_CONFIG])
    if not isinstance(config, dict):
        raise Damaged("adapter_config.json is not a JSON object")
    metrics = raw[METRICS].decode("utf-8")
    for n, line in enumerate(metrics.splitlines(), 1):
        record = json.loads(line) if line.strip() else {"step": 0}
        if not isinstance(record, dict) or type(record.get("step")) is not int:
            raise Damaged(f"metrics.jsonl line {n} is not a record with an integer step")
    adapter = load_tensors(raw[ADAPTER])
    _all_finite(adapter, ADAPTER)
    optimizer = None
    if state["has_optimizer"]:
        tensors = load_tensors(raw[OPTIMIZER])
        _all_finite(tensors, OPTIMIZER)
        optimizer = _unflatten_optimizer(tensors, _safetensors_meta(raw[OPTIMIZER]))
    rng = load_tensors(raw[RNG])
    _check_rng(rng, state)
    return Loaded(where, None if isinstance(source, dict) else Path(source), state, adapter, optimizer, rng,
                  metrics)


def read_verified(path: Path) -> dict[str, bytes]:
    """Every file of a committed checkpoint, read once and checked against the manifest in memory."""
    mpath = path / MANIFEST
    if not mpath.is_file():
        raise Damaged("no manifest (an unfinished or foreign folder)")
    try:
        manifest = parse_manifest(mpath.read_bytes())
    except ValueError as e:
        raise Damaged(f"malformed manifest ({e})") from None
    m = STEP_DIR.match(path.name)
    if m and manifest.step != int(m.group(1)):
        raise Damaged(f"the manifest is for step {manifest.step}, the folder for step {m.group(1)}")
    problem = checkpoint_files_problem(path, manifest.files)
    if problem:
        raise Damaged(problem)
    out = {}
    for name, entry in manifest.files.items():
        data = (path / name).read_bytes()
        if len(data) != entry.size:
            raise Damaged(f"{name} has {len(data)} bytes, the manifest says {entry.size}")
        if hashlib.sha256(data).hexdigest() != entry.sha256:
            raise Damaged(f"{name} does not match its sha256 (corrupted)")
        out[name] = data
    return out


def checkpoint_files_problem(path: Path, listed: dict) -> str | None:
    """The file set of a checkpoint: the required ones listed, nothing unknown, nothing unlisted."""
    missing = sorted(REQUIRED - set(listed))
    if missing:
        return f"the manifest does not list {missing[0]}"
    unknown = sorted(set(listed) - KNOWN)
    if unknown:
        return f"the manifest lists an unexpected file {unknown[0]}"
    on_disk = {p.name for p in path.iterdir()} - {MANIFEST}
    unlisted = sorted(on_disk - set(listed))
    if unlisted:
        return f"{unlisted[0]} is not in the manifest"
    return None


def _parse_state(raw: bytes) -> dict:
    state = json.loads(raw)
    if not isinstance(state, dict):
        raise Damaged("trainer_state.json is not a JSON object")
    try:
        _TrainerState.model_validate(state)
        progress = _Progress.model_validate(state.get("progress") or state.get("counters"))
        _Recovery.model_validate(state.get("recovery") or state.get("counters"))
        _Window.model_validate(state.get("log_window") or state.get("recovery") or state.get("counters"))
        _BatchConfig.model_validate(state["config"])
    except ValidationError as e:
        err = e.errors()[0]
        raise Damaged(f"trainer_state.json: {'.'.join(map(str, err['loc'])) or 'top level'}: {err['msg']}") from None
    state["progress_step"] = progress.step
    return state


def _all_finite(tensors: dict[str, torch.Tensor], name: str) -> None:
    for key, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise Damaged(f"{name}: {key} holds non-finite values")


def _check_rng(rng: dict[str, torch.Tensor], state: dict) -> None:
    t = rng.get("torch")
    if t is None or t.dtype != torch.uint8 or t.shape != torch.get_rng_state().shape:
        raise Damaged("rng.safetensors has no valid torch RNG state")
    torch.Generator().set_state(t)  # raises on an invalid state, on a throwaway generator
    py = state["python_rng"]
    random.Random().setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy_rng"]
    np.random.RandomState().set_state((n["name"], np.asarray(n["keys"], dtype=np.uint32), n["pos"],
                                       n["has_gauss"], n["cached"]))


def check_fits(loaded: Loaded, live) -> None:
    """The parsed state matches the live model, optimizer and schedule (no live object is touched)."""
    try:
        _check_fits(loaded, live)
    except Damaged:
        raise
    except Exception as e:
        raise Damaged(f"{type(e).__name__}: {str(e)[:200]}") from None


def _check_fits(loaded: Loaded, live) -> None:
    from peft.utils import get_peft_model_state_dict

    expected = get_peft_model_state_dict(live.model)
    if set(loaded.adapter) != set(expected):
        odd = sorted(set(loaded.adapter) ^ set(expected))
        raise Damaged(f"adapter_model.safetensors: keys differ from the model's adapter ({odd[0]})")
    for k, t in loaded.adapter.items():
        if t.shape != expected[k].shape or t.dtype != expected[k].dtype:
            raise Damaged(f"adapter_model.safetensors: {k} has shape {tuple(t.shape)} {t.dtype}, "
                          f"the model {tuple(expected[k].shape)} {expected[k].dtype}")
    if loaded.optimizer is not None:
        _check_optimizer(loaded.optimizer, live.optimizer)
    sched = loaded.state["scheduler"]
    if (sched is None) != (live.scheduler is None):
        raise Damaged("trainer_state.json: scheduler state missing or unexpected")
    if sched is not None:
        _same_structure(sched, _live_scheduler_state(live.scheduler), "scheduler")
    if live.scaler is not None and loaded.state.get("scaler"):
        _same_structure(loaded.state["scaler"], live.scaler.state_dict(), "scaler")


def _live_scheduler_state(scheduler) -> dict:
    sd = scheduler.state_dict()
    sd["lr_lambdas"] = [None] * len(sd.get("lr_lambdas", []))
    return sd


def _check_optimizer(sd: dict, optimizer) -> None:
    from relaytune.checkpoint.state import with_live_implementation

    live = optimizer.state_dict()
    sd = with_live_implementation(sd, optimizer)  # fused or not is this machine's choice (state.py)
    _same_structure([{k: v for k, v in g.items()} for g in sd["param_groups"]],
                    [{k: v for k, v in g.items()} for g in live["param_groups"]], "optimizer param_groups")
    for saved_g, live_g in zip(sd["param_groups"], live["param_groups"]):
        if list(saved_g["params"]) != list(live_g["params"]):
            raise Damaged("optimizer.safetensors: parameter groups differ from the model's")
    params = [p for g in optimizer.param_groups for p in g["params"]]
    ids = [i for g in live["param_groups"] for i in g["params"]]
    by_id = dict(zip(ids, params))
    keys = None
    for idx, per_param in sd["state"].items():
        if idx not in by_id:
            raise Damaged(f"optimizer.safetensors: state for unknown parameter {idx}")
        if keys is not None and set(per_param) != keys:
            raise Damaged(f"optimizer.safetensors: parameter {idx} has a different set of state entries")
        keys = set(per_param)
        for name in PER_ELEMENT:
            t = per_param.get(name)
            if torch.is_tensor(t) and t.numel() != by_id[idx].numel():
                raise Damaged(f"optimizer.safetensors: {name} of parameter {idx} has {t.numel()} "
                              f"elements, the parameter {by_id[idx].numel()}")


def _same_structure(saved, live, where: str) -> None:
    """Same keys, lengths and kinds of values (numbers, strings, bools, None) all the way down."""
    def kind(v):
        if isinstance(v, bool) or v is None or isinstance(v, str):
            return type(v)
        if isinstance(v, (int, float)):
            return float
        if isinstance(v, (list, tuple)):
            return list
        if isinstance(v, dict):
            return dict
        if torch.is_tensor(v):
            return torch.Tensor
        return type(v)

    if kind(saved) is not kind(live):
        raise Damaged(f"{where}: {type(saved).__name__} where {type(live).__name__} belongs")
    if isinstance(saved, dict):
        if set(saved) != set(live):
            raise Damaged(f"{where}: keys {sorted(map(str, set(saved) ^ set(live)))[:3]} differ")
        for k in saved:
            _same_structure(saved[k], live[k], f"{where}.{k}")
    elif isinstance(saved, (list, tuple)):
        if len(saved) != len(live):
            raise Damaged(f"{where}: {len(saved)} entries where {len(live)} belong")
        for i, (a, b) in enumerate(zip(saved, live)):
            _same_structure(a, b, f"{where}[{i}]")
    elif isinstance(saved, float) and not math.isfinite(saved) and math.isfinite(float(live)):
        raise Damaged(f"{where}: non-finite value")


def apply(loaded: Loaded, live) -> None:
    """Put a checked checkpoint into the live objects; on any failure put them back as they were."""
    backup = capture(live)
    try:
        _apply(loaded, live)
    except BaseException as e:
        _apply(backup, live)
        if isinstance(e, Exception):
            raise Damaged(f"{type(e).__name__}: {str(e)[:200]}") from None
        raise


def capture(live) -> Loaded:
    """The live objects' state, copied in memory: what `apply` returns to if applying fails."""
    from peft.utils import get_peft_model_state_dict

    from relaytune.checkpoint.state import _numpy_rng, _python_rng, _scheduler_state, _torch_rng

    state = {"scheduler": _scheduler_state(live.scheduler),
             "scaler": live.scaler.state_dict() if live.scaler is not None else None,
             "python_rng": _python_rng(), "numpy_rng": _numpy_rng()}
    adapter = {k: v.detach().clone() for k, v in get_peft_model_state_dict(live.model).items()}
    return Loaded("the live state", None, state, adapter, copy.deepcopy(live.optimizer.state_dict()), _torch_rng(), "")


def _apply(loaded: Loaded, live) -> None:
    from peft.utils import set_peft_model_state_dict

    from relaytune.checkpoint.state import _set_rng, with_live_implementation
    from relaytune.log import notice

    result = set_peft_model_state_dict(live.model, loaded.adapter)
    if getattr(result, "unexpected_keys", None):
        raise Damaged(f"adapter has unexpected keys {result.unexpected_keys[:3]}")
    if loaded.optimizer is not None:
        saved, running = _kernel(loaded.optimizer["param_groups"]), _kernel(live.optimizer.param_groups)
        if saved != running:
            notice(f"{loaded.where} was written with AdamW's {saved} kernel and this machine runs the {running} "
                   "one: the same update up to float rounding, so the run continues its curve, not bit for bit")
        live.optimizer.load_state_dict(with_live_implementation(loaded.optimizer, live.optimizer))
    if loaded.state["scheduler"] is not None:
        live.scheduler.load_state_dict(loaded.state["scheduler"])
    if live.scaler is not None and loaded.state.get("scaler"):
        live.scaler.load_state_dict(loaded.state["scaler"])
    _set_rng(loaded.rng, loaded.state["python_rng"], loaded.state["numpy_rng"])


def _kernel(param_groups: list[dict]) -> str:
    return "fused" if any(g.get("fused") for g in param_groups) else "per-tensor"


def _unflatten_optimizer(tensors, meta):
    from relaytune.checkpoint.state import _unflatten_optimizer as unflatten

    return unflatten(tensors, meta)


def _safetensors_meta(raw: bytes) -> dict:
    from relaytune.checkpoint.state import _safetensors_meta as meta

    out = meta(raw)
    if not isinstance(out, dict) or not isinstance(out.get("param_groups"), list) or \
            not isinstance(out.get("scalars"), dict):
        raise Damaged("optimizer.safetensors: malformed relaytune metadata")
    return out
