"""A run folder: every file and folder name of `output_dir`, and the readers that look inside.

The layout is the user-visible contract (README "What is in output_dir"), so it is
spelled out once, here, and `train`, `status`, `eval`, `export`, `compare` and the
trackers all take their paths from `RunDir`. This module never imports torch, so
`relaytune status` answers fast, also while a run trains.

Readers only read. A folder counts only once its manifest is committed, exactly as for
resuming, and the run's configuration comes from the newest checkpoint's
trainer_state.json, so the tools load the same base model, LoRA shape, data pipeline
and masks that training used.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from relaytune.atomic import MANIFEST, read_manifest, verify
from relaytune.errors import UserError

# Files inside a checkpoint, final/ and best/.
ADAPTER = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
OPTIMIZER = "optimizer.safetensors"
RNG = "rng.safetensors"
TRAINER_STATE = "trainer_state.json"
METRICS = "metrics.jsonl"

STEP_DIR = re.compile(r"^step-(\d+)$")


@dataclass(frozen=True)
class RunDir:
    """The paths of one run folder."""

    root: Path

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    def step(self, n: int) -> Path:
        return self.checkpoints / f"step-{n}"

    @property
    def final(self) -> Path:
        return self.root / "final"

    @property
    def best(self) -> Path:
        return self.root / "best"

    @property
    def metrics(self) -> Path:
        return self.root / METRICS

    @property
    def sessions(self) -> Path:
        return self.root / "sessions.jsonl"

    @property
    def progress(self) -> Path:
        return self.root / "progress.json"

    @property
    def quarantine(self) -> Path:
        return self.root / "quarantine.jsonl"

    @property
    def data_cache(self) -> Path:
        return self.root / "data-cache"

    @property
    def mirror_state(self) -> Path:
        return self.root / "mirror_state.json"

    @property
    def eval_cache(self) -> Path:
        return self.root / "eval_cache.json"

    @property
    def trackers(self) -> Path:
        return self.root / "trackers"

    @property
    def tensorboard(self) -> Path:
        """The tensorboard log folder, one for every session of the run."""
        return self.root / "tensorboard"

    @property
    def wandb(self) -> Path:
        """wandb's own files (its offline runs among them)."""
        return self.root / "wandb"

    @property
    def mlruns(self) -> Path:
        """mlflow's file store, when MLFLOW_TRACKING_URI is not set."""
        return self.root / "mlruns"

    def tracker_state(self, tracker: str) -> Path:
        """The id of the tracker's run (wandb, mlflow, trackio), kept so that a resume continues it."""
        return self.root / f"{tracker}_run.json"

    @property
    def plot(self) -> Path:
        """The loss / learning-rate plot that `status` writes."""
        return self.root / "training_plot.png"

    def compare_report(self, stamp: str) -> Path:
        """The Markdown report of one `compare`, by default."""
        return self.root / f"compare-{stamp}.md"

    @property
    def lock(self) -> Path:
        return self.root / ".relaytune.lock"

    @property
    def oom_request(self) -> Path:
        """Under FSDP: the micro-batch that an out-of-memory error asked the restarted workers to take."""
        return self.root / "oom_request.json"

    def is_finished(self) -> bool:
        return verify(self.final) is None

    def looks_like_a_run(self) -> bool:
        return any(p.exists() for p in (self.checkpoints, self.final, self.metrics, self.sessions))


@dataclass(frozen=True)
class AdapterRef:
    """One committed adapter of a run: a checkpoint, final/ or best/."""

    name: str  # "step-8", "final", "best"
    path: Path
    step: int | None

    @property
    def is_step(self) -> bool:
        """A checkpoints/step-N folder (not final/ or best/)."""
        return STEP_DIR.match(self.name) is not None

    @property
    def sha256(self) -> str:
        """The adapter's content hash, from the manifest: a cache key that survives renames."""
        return read_manifest(self.path)["files"][ADAPTER]["sha256"]


def read_text_or_empty(path: Path) -> str:
    """A text file that training may not have written yet: "" when absent or unreadable."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError:
        return ""


def run_dir(path: str | Path) -> Path:
    p = Path(path).expanduser().resolve()
    if not p.is_dir():
        raise UserError(f"{path}: no such run folder")
    if not RunDir(p).looks_like_a_run():
        raise UserError(f"{path} does not look like a relaytune run (no checkpoints/, final/, "
                        "metrics.jsonl or sessions.jsonl)")
    return p


def step_checkpoints(run: Path) -> list[AdapterRef]:
    """Checkpoints with a manifest, oldest first (a folder mid-commit is not listed)."""
    root = RunDir(run).checkpoints
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = STEP_DIR.match(p.name)
        if m and (p / MANIFEST).is_file():
            found.append(AdapterRef(p.name, p, int(m.group(1))))
    return sorted(found, key=lambda a: a.step)


def newest_state(run: Path) -> dict | None:
    """trainer_state.json of the newest checkpoint that has one (unverified: only read)."""
    for ref in reversed(step_checkpoints(run)):
        try:
            return json.loads((ref.path / TRAINER_STATE).read_text())
        except (OSError, ValueError):
            continue  # being pruned, or damaged: try an older one
    return None


def run_info(run: Path) -> dict | None:
    """The `run` entry of final/'s (else best/'s) manifest: the config and data fingerprint a finished
    run trained with, so that a run whose checkpoints/ is gone still explains itself."""
    for folder in (RunDir(run).final, RunDir(run).best):
        try:
            info = read_manifest(folder).get("run")
        except (OSError, ValueError):
            continue
        if isinstance(info, dict) and isinstance(info.get("config"), dict):
            return {**info, "total_steps": info.get("step")} if folder.name == "final" else info
    return None


def saved_config(run: Path) -> dict | None:
    """The configuration the run trained with: the newest checkpoint's, else final/'s (or best/'s)."""
    state = newest_state(run)
    if state is not None and isinstance(state.get("config"), dict):
        return state
    return run_info(run)


def run_config(run: Path, config: str | None = None):
    """The run's TrainConfig: from --config if given, else the newest checkpoint's copy, else final/'s."""
    from relaytune.config.loader import load_config

    if config:
        return load_config(config, {"output_dir": str(run)})
    state = saved_config(run)
    if state is None:
        raise UserError(f"{run}: neither a checkpoint nor final/ holds the run's configuration; "
                        "pass --config CONFIG.yaml")
    try:
        # The folder may have moved since (copied from a mirror, another machine): it is RUN_DIR now.
        return load_config({**state["config"], "output_dir": str(run)})
    except UserError as e:
        raise UserError(f"{run}: the configuration saved with the run does not load here ({e}); "
                        "pass --config CONFIG.yaml") from None


def named(run: Path, name: str) -> AdapterRef:
    """`step-8`, `8`, `final`, `best` or `latest` -> a committed, intact adapter."""
    name = name.strip()
    if name == "latest":
        refs = step_checkpoints(run)
        if not refs:
            raise UserError(f"{run}: no committed checkpoint")
        ref = refs[-1]
    elif name == "best":
        ref = best_ref(run)
    elif name == "final":
        ref = AdapterRef("final", RunDir(run).final, _final_step(run))
    else:
        step = name[5:] if name.startswith("step-") else name
        if not step.isdigit():
            raise UserError(f"{name!r} is not a checkpoint name; use step-N, N, final, best or latest")
        ref = _step_ref(run, int(step))
    if not ref.path.is_dir():
        have = ", ".join(r.name for r in default_refs(run)) or "none"
        raise UserError(f"{run}: no {ref.name} (committed adapters: {have})")
    reason = verify(ref.path)
    if reason is not None:
        raise UserError(f"{ref.path} is not usable: {reason}")
    return ref


def best_ref(run: Path) -> AdapterRef:
    """best/ once training has finished; during training, the checkpoint of the best eval so far."""
    best = RunDir(run).best
    if (best / MANIFEST).is_file():
        return AdapterRef("best", best, read_manifest(best).get("step"))
    state = newest_state(run)
    step = (state or {}).get("counters", {}).get("best_step")
    if step is None:
        raise UserError(f"{run}: no best checkpoint (the run has no evaluation yet)")
    return _step_ref(run, step)


def default_refs(run: Path) -> list[AdapterRef]:
    """Every committed checkpoint, then final/ if present."""
    refs = step_checkpoints(run)
    final = RunDir(run).final
    if (final / MANIFEST).is_file():
        refs.append(AdapterRef("final", final, _final_step(run)))
    return refs


def select(run: Path, spec: str | None) -> list[AdapterRef]:
    """A comma list of names (or None for all), each verified; duplicates dropped."""
    if not spec:
        refs = default_refs(run)
        bad = [(r, verify(r.path)) for r in refs]
        for r, reason in bad:
            if reason is not None:
                from relaytune.log import warn

                warn(f"skipping {r.name}: {reason}")
        refs = [r for r, reason in bad if reason is None]
        if not refs:
            raise UserError(f"{run}: no committed checkpoint or final adapter yet")
        return refs
    out: list[AdapterRef] = []
    for name in spec.split(","):
        if name.strip():
            ref = named(run, name)
            if ref.path not in {r.path for r in out}:
                out.append(ref)
    return out


def _step_ref(run: Path, step: int) -> AdapterRef:
    path = RunDir(run).step(step)
    return AdapterRef(path.name, path, step)


def _final_step(run: Path) -> int | None:
    info = run_info(run)
    if info is not None and isinstance(info.get("total_steps"), int):
        return info["total_steps"]
    state = newest_state(run)
    return state.get("total_steps") if state else None


def load_adapter_slot(cfg):
    """(model, tokenizer, precision): the base model with a LoRA slot shaped like the run's.

    Built by the training loader itself, so quantization, dtype and target modules are
    the same as in training; `put_adapter` then swaps in a checkpoint's weights.
    """
    import torch

    from relaytune.model import choose_precision, load_model, load_tokenizer

    precision = choose_precision(cfg)
    tokenizer = load_tokenizer(cfg)
    torch.manual_seed(cfg.seed)  # the slot's initial values are overwritten; seeded anyway
    model = load_model(cfg, precision)
    model.eval()
    return model, tokenizer, precision


def put_adapter(model, ref: AdapterRef) -> None:
    from peft.utils import set_peft_model_state_dict
    from safetensors.torch import load_file

    result = set_peft_model_state_dict(model, load_file(str(ref.path / ADAPTER)))
    if getattr(result, "unexpected_keys", None):
        raise UserError(f"{ref.path}: the adapter does not fit the run's model "
                        f"(unexpected keys such as {result.unexpected_keys[0]})")
    # A LoRA weight the file lacks would silently keep the previous checkpoint's value.
    missing = [k for k in getattr(result, "missing_keys", []) if "lora_" in k]
    if missing:
        raise UserError(f"{ref.path}: the adapter lacks weights the run's model has (e.g. {missing[0]})")
