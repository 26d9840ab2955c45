"""Training state to and from checkpoint files: safetensors and JSON, never pickle.

Every piece of state has one pair here: the adapter, the optimizer, the
scheduler, the gradient scaler, all RNGs, the data cursor, the counters and the
metrics history. `snapshot` turns live objects into file bytes (cheap: LoRA
state is small); `restore` puts them back bit for bit.
"""

from __future__ import annotations

import json
import os
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load, save

from relaytune.run_dir import ADAPTER, ADAPTER_CONFIG, METRICS, OPTIMIZER, RNG, TRAINER_STATE


@dataclass
class TrainState:
    """Saved progress, and nothing else: the epoch and the data cursor derive from `step`."""

    step: int = 0  # optimizer steps completed
    tokens_seen: int = 0
    skipped_steps: int = 0
    last_eval_loss: float | None = None
    best_eval_loss: float | None = None
    best_step: int | None = None


@dataclass
class Live:
    """The live objects whose state a checkpoint holds besides TrainState."""

    model: object
    optimizer: object
    scheduler: object
    scaler: object | None


def adapter_files(model) -> dict[str, bytes]:
    """The adapter in PEFT format: loadable on its own with PeftModel.from_pretrained."""
    from peft.utils import get_peft_model_state_dict

    weights = {k: v.detach().to("cpu").contiguous() for k, v in get_peft_model_state_dict(model).items()}
    return {ADAPTER: save(weights, metadata={"format": "pt"}), ADAPTER_CONFIG: adapter_config_bytes(model)}


BUILTIN_HUB_IDS = {"builtin:SmolLM2-135M-Instruct": "HuggingFaceTB/SmolLM2-135M-Instruct"}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolvable_base(path: str | None) -> tuple[str | None, str | None]:
    """(what adapter_config.json names as the base, the local folder it was loaded from or None).

    Others cannot resolve a path on the training machine, so the base is named by its Hub id
    where one is known: the built-in model's real id, or a local folder's own `_name_or_path`
    (config.json) when that is a Hub id; otherwise the folder's path as given."""
    if not path:
        return path, None
    local = Path(os.path.expanduser(path))
    if not local.exists():
        return path, None  # a Hub id already
    from relaytune import builtin

    for name, hub_id in BUILTIN_HUB_IDS.items():
        try:
            if local.resolve() == (builtin.cache_root() / name.split(":", 1)[1]).resolve():
                return hub_id, str(local)
        except OSError:
            pass
    try:
        named = json.loads((local / "config.json").read_text()).get("_name_or_path")
    except (OSError, ValueError, AttributeError):
        named = None
    if isinstance(named, str) and _HUB_ID.match(named) and not Path(os.path.expanduser(named)).exists():
        return named, str(local)
    return path, str(local)


def adapter_config_bytes(model) -> bytes:
    config = model.peft_config["default"].to_dict()
    config["inference_mode"] = True
    config["base_model_name_or_path"], _ = resolvable_base(config.get("base_model_name_or_path"))
    for k, v in list(config.items()):
        if isinstance(v, set):
            config[k] = sorted(v)
    return json.dumps(config, indent=2, sort_keys=True, default=str).encode()


def run_info(model, config: dict, fingerprint: str | None, step: int) -> dict:
    """What final/ and best/ keep in their manifest (key `run`) so that every command works from
    that folder alone (export, eval, compare, status): the resolved config with the training-time
    overrides and quantization, the data fingerprint, and the base model with its local path."""
    hub, local = resolvable_base(model.peft_config["default"].base_model_name_or_path)
    return {"step": step, "config": config, "data_fingerprint": fingerprint,
            "base_model": {"model": config.get("model"), "base_model_name_or_path": hub, "local_path": local}}


def deferred_safetensors(tensors: dict[str, torch.Tensor], metadata: dict) -> Callable[[], bytes]:
    """Copy the tensors now and serialise later, in the thread that writes the checkpoint, while
    training goes on.

    CPU tensors are cloned (unchanged: CPU checkpoints stay byte-identical). CUDA tensors are not
    cloned on the GPU (that doubled LoRA + Adam state in GPU memory for a moment): they are copied
    into reused pinned host buffers on a side stream; the training stream waits for those copies
    before it changes a weight again (a GPU-side wait, no host sync), and the writer waits on an
    event before it serialises. The buffers go back to the pool once the bytes exist."""
    if not any(v.is_cuda for v in tensors.values()):
        copies = {k: v.detach().clone() for k, v in tensors.items()}
        return lambda: save({k: v.to("cpu").contiguous() for k, v in copies.items()}, metadata=metadata)
    return _PinnedSnapshot(tensors, metadata)


class _PinnedSnapshot:
    """One tensor file staged in pinned host memory (see deferred_safetensors)."""

    _free: dict[tuple, list[torch.Tensor]] = {}  # (shape, dtype) -> idle pinned buffers
    _streams: dict[int, object] = {}  # device index -> staging stream
    _lock = __import__("threading").Lock()  # the writer thread releases while the loop acquires

    def __init__(self, tensors: dict[str, torch.Tensor], metadata: dict):
        self.metadata = metadata
        self.data: bytes | None = None
        device = next(v.device for v in tensors.values() if v.is_cuda)
        stream = self._streams.get(device.index)
        if stream is None:
            stream = self._streams[device.index] = torch.cuda.Stream(device)
        main = torch.cuda.current_stream(device)
        stream.wait_stream(main)  # the values as of now
        self.staged: dict[str, torch.Tensor] = {}
        self.owned: list[torch.Tensor] = []
        with torch.cuda.stream(stream):
            for k, v in tensors.items():
                if v.is_cuda:
                    buf = self._acquire(tuple(v.shape), v.dtype)
                    buf.copy_(v.detach(), non_blocking=True)
                    self.owned.append(buf)
                    self.staged[k] = buf
                else:
                    self.staged[k] = v.detach().clone()
        self.event = torch.cuda.Event()
        self.event.record(stream)
        main.wait_stream(stream)  # no optimizer step overwrites a weight before its copy is done

    def __call__(self) -> bytes:
        if self.data is None:
            self.event.synchronize()
            self.data = save({k: v.contiguous() for k, v in self.staged.items()}, metadata=self.metadata)
            self.staged = {}
            with self._lock:  # reuse for the next snapshot; `data` is an independent copy
                for buf in self.owned:
                    self._free.setdefault((tuple(buf.shape), buf.dtype), []).append(buf)
            self.owned = []
        return self.data

    @classmethod
    def _acquire(cls, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        with cls._lock:
            idle = cls._free.get((shape, dtype))
            if idle:
                return idle.pop()
        return torch.empty(shape, dtype=dtype, pin_memory=True)


def snapshot(live: Live, state: dict, metrics_text: str, include_optimizer: bool = True
             ) -> dict[str, bytes | Callable[[], bytes]]:
    """Every file of a checkpoint at this step boundary; tensor files are serialised lazily.

    `state` is the JSON-able part the trainer owns (progress, recovery state, run facts).
    """
    from peft.utils import get_peft_model_state_dict

    files: dict[str, bytes | Callable[[], bytes]] = {
        ADAPTER: deferred_safetensors(get_peft_model_state_dict(live.model), {"format": "pt"}),
        ADAPTER_CONFIG: adapter_config_bytes(live.model),
    }
    if include_optimizer:
        tensors, meta = _flatten_optimizer(live.optimizer.state_dict())
        files[OPTIMIZER] = deferred_safetensors(tensors, {"relaytune": json.dumps(meta)})
    files[RNG] = save(_torch_rng())
    full = {
        **state,
        "scheduler": _scheduler_state(live.scheduler),
        "scaler": live.scaler.state_dict() if live.scaler is not None else None,
        "python_rng": _python_rng(),
        "numpy_rng": _numpy_rng(),
        "has_optimizer": include_optimizer,
    }
    files[TRAINER_STATE] = json.dumps(full, indent=1, sort_keys=True).encode()
    files[METRICS] = metrics_text.encode()
    return files


def nonfinite(live: Live) -> str | None:
    """Which trainable weight or optimizer state tensor holds a NaN or an infinity; None if all are
    finite. Cheap (LoRA state is small): checked before every checkpoint is committed."""
    for name, p in live.model.named_parameters():
        if p.requires_grad and p.is_floating_point() and not bool(torch.isfinite(p.detach()).all()):
            return f"weight {name}"
    for idx, per_param in live.optimizer.state_dict()["state"].items():
        for key, t in per_param.items():
            if torch.is_tensor(t) and t.is_floating_point() and not bool(torch.isfinite(t).all()):
                return f"optimizer state {key} of parameter {idx}"
    return None


def read_trainer_state(source: Path | dict) -> dict:
    return json.loads(_read(source, TRAINER_STATE))


def _read(source: Path | dict, name: str) -> bytes:
    """A checkpoint file's bytes, from a folder or from an in-memory snapshot."""
    if not isinstance(source, dict):
        return (Path(source) / name).read_bytes()
    return source[name]() if callable(source[name]) else source[name]


def restore(source: Path | dict, live: Live) -> dict:
    """Put a verified checkpoint (folder or snapshot) into the live objects; returns its saved state."""
    from peft.utils import set_peft_model_state_dict

    state = read_trainer_state(source)
    result = set_peft_model_state_dict(live.model, load(_read(source, ADAPTER)))
    if getattr(result, "unexpected_keys", None):
        raise RuntimeError(f"{source}: adapter has unexpected keys {result.unexpected_keys[:3]}")
    if state["has_optimizer"]:
        raw = _read(source, OPTIMIZER)
        saved = _unflatten_optimizer(load(raw), _safetensors_meta(raw))
        live.optimizer.load_state_dict(with_live_implementation(saved, live.optimizer))
    if state["scheduler"] is not None:
        live.scheduler.load_state_dict(state["scheduler"])
    if live.scaler is not None and state.get("scaler"):
        live.scaler.load_state_dict(state["scaler"])
    _set_rng(load(_read(source, RNG)), state["python_rng"], state["numpy_rng"])
    return state


def progress_of(state: dict) -> TrainState:
    """The TrainState inside a saved state; checkpoints of 0.1 kept it in one `counters` dict."""
    saved = state.get("progress") or state["counters"]
    return TrainState(**{k: saved[k] for k in TrainState.__dataclass_fields__ if k in saved})


def recovery_of(state: dict) -> dict:
    """The trainer's saved recovery state and logging window (see Trainer)."""
    return state.get("recovery") or state["counters"]


def capture_rng() -> dict:
    """All RNG states, in memory: an OOM retry restarts its step from these."""
    return {"tensors": _torch_rng(), "python": random.getstate(), "numpy": np.random.get_state()}


def reset_rng(saved: dict) -> None:
    torch.set_rng_state(saved["tensors"]["torch"])
    cuda = [v for k, v in sorted(saved["tensors"].items()) if k.startswith("cuda.")]
    if cuda:
        torch.cuda.set_rng_state_all(cuda)
    random.setstate(saved["python"])
    np.random.set_state(saved["numpy"])


def _flatten_optimizer(sd: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """Tensors keyed `state/<param>/<name>[/<sub>...]`; everything else goes to JSON.

    Nested dicts occur: bitsandbytes keeps its 8-bit quantisation state in one.
    """
    tensors, scalars = {}, {}

    def walk(prefix: str, value) -> None:
        if torch.is_tensor(value):
            tensors[prefix] = value
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}/{k}", v)
        else:
            scalars[prefix] = value

    for idx, per_param in sd["state"].items():
        walk(f"state/{idx}", per_param)
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in sd["param_groups"]]
    return tensors, {"param_groups": groups, "scalars": scalars}


def _unflatten_optimizer(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    state: dict[int, dict] = {}
    for key, value in list(tensors.items()) + list(meta["scalars"].items()):
        _, idx, *path = key.split("/")
        node = state.setdefault(int(idx), {})
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    groups = [{k: (tuple(v) if k == "betas" else v) for k, v in g.items()} for g in meta["param_groups"]]
    return {"state": state, "param_groups": groups}


# How a torch optimizer runs (one fused kernel, a loop of per-tensor kernels), not what it computes.
IMPLEMENTATION_KEYS = ("foreach", "fused", "capturable", "differentiable")


def with_live_implementation(saved: dict, optimizer) -> dict:
    """`saved` with the live optimizer's implementation flags. They are this machine's choice, not the
    run's state (AdamW is fused on a GPU and not on a CPU), so a checkpoint written by either, or by
    a version before AdamW was fused, resumes onto the kernel this machine picked; torch's
    load_state_dict would otherwise take the saved flags and place the step counters by them."""
    groups = []
    for i, group in enumerate(saved["param_groups"]):
        live = optimizer.param_groups[i] if i < len(optimizer.param_groups) else {}
        groups.append({**group, **{k: live[k] for k in IMPLEMENTATION_KEYS if k in live}})
    return {**saved, "param_groups": groups}


def _safetensors_meta(raw: bytes) -> dict:
    header_len = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + header_len])
    return json.loads(header["__metadata__"]["relaytune"])


def _scheduler_state(scheduler) -> dict | None:
    if scheduler is None:
        return None
    sd = scheduler.state_dict()
    sd["lr_lambdas"] = [None] * len(sd.get("lr_lambdas", []))
    return sd


def _torch_rng() -> dict[str, torch.Tensor]:
    out = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            out[f"cuda.{i}"] = s
    return out


def _python_rng() -> list:
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]


def _numpy_rng() -> dict:
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {"name": name, "keys": keys.tolist(), "pos": int(pos), "has_gauss": int(has_gauss),
            "cached": float(cached)}


def _set_rng(tensors: dict[str, torch.Tensor], python_state: list, numpy_state: dict) -> None:
    torch.set_rng_state(tensors["torch"])
    cuda = [tensors[k] for k in sorted((k for k in tensors if k.startswith("cuda.")), key=lambda k: int(k[5:]))]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda[: torch.cuda.device_count()])
    random.setstate((python_state[0], tuple(python_state[1]), python_state[2]))
    np.random.set_state((numpy_state["name"], np.asarray(numpy_state["keys"], dtype=np.uint32),
                         numpy_state["pos"], numpy_state["has_gauss"], numpy_state["cached"]))
