"""Helpers the tests share: chat data files, small configs, CLI runs and their metrics."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import yaml


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def chat_rows(n: int = 40, seed: int = 0) -> list[dict]:
    """`n` one-turn chats "A plus B" -> "A+B" with single digits, the same for the same seed."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        rows.append({"messages": [{"role": "user", "content": f"{a} plus {b}"},
                                  {"role": "assistant", "content": f"{a + b}"}]})
    return rows


def make_config(tmp_path: Path, model: Path, data: Path, **overrides) -> Path:
    """A small, fast config file; returns its path."""
    cfg = {
        "model": str(model), "dataset": str(data), "output_dir": str(tmp_path / "run"),
        "max_steps": 12, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2,
        "save_steps": 4, "logging_steps": 1, "learning_rate": 1e-3, "save_every_seconds": 0,
    }
    cfg.update(overrides)
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False), encoding="utf-8")
    return path


def run_cli(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `python -m relaytune.cli ARGS` in a child process, as a user would."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "relaytune.cli", *args], capture_output=True,
                          text=True, env=full_env, timeout=timeout)


def step_records(metrics_path: Path) -> list[dict]:
    """The per-step records of a metrics.jsonl (records with an "event" key are events)."""
    records = [json.loads(line) for line in Path(metrics_path).read_text(encoding="utf-8").splitlines()
               if line.strip()]
    return [r for r in records if "event" not in r and "eval_loss" not in r]


def run_until_done(cli, cfg: Path, limit: int = 10, **kwargs) -> list[subprocess.CompletedProcess]:
    """Re-run `relaytune train CFG` (no fault switches) until it exits 0; returns every result.

    `cli` is a ForkServer (or anything with its `run`); every run but the last must have been
    killed (-9) or stopped to be resumed (75).
    """
    results = []
    for _ in range(limit):
        r = cli.run("train", str(cfg), **kwargs)
        results.append(r)
        if r.returncode == 0:
            return results
        assert r.returncode in (-9, 75), f"rc {r.returncode}:\n{r.stderr[-3000:]}"
    raise AssertionError(f"no exit 0 after {limit} runs")


def lora_model_with_gradients(model_dir: Path, output_dir: Path):
    """A tiny model with a LoRA adapter (r 4, no dropout) whose A matrices get gradients; (model, cfg,
    precision). LoRA's B starts at zero, which leaves A without gradient, so B gets random values."""
    import torch

    from relaytune.config.schema import TrainConfig
    from relaytune.model import choose_precision, load_model

    cfg = TrainConfig(model=str(model_dir), dataset="unused.jsonl", output_dir=str(output_dir), lora_r=4,
                      lora_dropout=0.0)
    precision = choose_precision(cfg)
    torch.manual_seed(0)
    model = load_model(cfg, precision)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    model.train()
    return model, cfg, precision
