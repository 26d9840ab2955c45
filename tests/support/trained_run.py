"""A finished tiny run shared by the eval / compare / export / status tests.

Trained once per test session, in-process (a CLI child costs seconds of imports),
on one torch thread: these 2-core machines are shared, and oversubscribed threads
make a tiny model 10x slower. Tests that write into a run copy it first.
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

from support.run_helpers import chat_rows, write_jsonl

import relaytune
import relaytune.training.recipe

_cache: dict[str, Path] = {}

BASE = {"max_steps": 12, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2,
        "save_steps": 4, "logging_steps": 1, "learning_rate": 1e-3, "save_every_seconds": 0,
        "val_set_size": 8, "eval_steps": 4, "save_total_limit": None}

@contextlib.contextmanager
def one_thread():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def train_run(folder: Path, model: Path, **overrides) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    data = write_jsonl(folder / "data.jsonl", chat_rows())
    settings = {**BASE, "model": str(model), "dataset": str(data), "output_dir": str(folder / "run"), **overrides}
    with one_thread():
        relaytune.training.recipe.train(settings)
    return folder / "run"


def finished_run(tmp_path_factory, tiny_model: Path) -> Path:
    """The shared run (read-only by convention: copy it with `copy_run` before writing)."""
    key = str(tiny_model)
    if key not in _cache:
        _cache[key] = train_run(tmp_path_factory.mktemp("shared-run"), tiny_model)
    return _cache[key]


def copy_run(run: Path, dest: Path) -> Path:
    shutil.copytree(run, dest)
    return dest
