"""Shared fixtures: a tiny random model built in-process, data files, configs, CLI runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from relaytune.tiny import make_tiny_model

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A 2-layer llama, hidden 64, with a byte-level BPE tokenizer and ChatML template."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def chat_rows(n: int = 40, seed: int = 0) -> list[dict]:
    import random

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        rows.append({"messages": [{"role": "user", "content": f"{a} plus {b}"},
                                  {"role": "assistant", "content": f"{a + b}"}]})
    return rows


@pytest.fixture
def chat_data(tmp_path) -> Path:
    return write_jsonl(tmp_path / "data.jsonl", chat_rows())


def make_config(tmp_path: Path, model: Path, data: Path, **overrides) -> Path:
    """A small, fast config file; returns its path."""
    cfg = {
        "model": str(model), "dataset": str(data), "output_dir": str(tmp_path / "run"),
        "max_steps": 12, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2,
        "save_steps": 4, "logging_steps": 1, "learning_rate": 1e-3, "save_every_seconds": 0,
    }
    cfg.update(overrides)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False), encoding="utf-8")
    return path


def run_cli(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `python -m relaytune.cli ARGS` in a child process, as a user would."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "relaytune.cli", *args], capture_output=True,
                          text=True, env=full_env, timeout=timeout)
