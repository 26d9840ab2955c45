"""What the planner's tests share: the models named in them, the settings they vary, and the
helpers that plan a case or run the `plan` command."""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml

from relaytune.plan import GIB, Settings, estimate_memory, resolve_architecture

REPO = Path(__file__).resolve().parents[2]
DEMO_DATA = REPO / "src/relaytune/commands/demo_data/train.jsonl"
QWEN3B, LLAMA8B = "Qwen/Qwen2.5-3B-Instruct", "meta-llama/Meta-Llama-3-8B"
QLORA = dict(quantization="nf4", optim="paged_adamw_8bit")
# Every calibration point was measured while the loss recomputed each chunk in backward.
OLD_LOSS = {"loss_recomputed": True}


def peak(model: str, micro_batch: int, gc: bool = True, **settings) -> float:
    """The planner's total allocated GiB for one case (seq 2048 unless given)."""
    s = Settings(**{"max_seq_length": 2048, **settings})
    return estimate_memory(resolve_architecture(model), s, micro_batch, gc).total_allocated / GIB


def write_config(tmp_path: Path, **values) -> Path:
    cfg = {"dataset": str(DEMO_DATA), "output_dir": str(tmp_path / "run"), **values}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False), encoding="utf-8")
    return path


def run_plan(capsys, *argv: str) -> str:
    from relaytune.commands import plan

    parser = argparse.ArgumentParser(prog="relaytune")
    plan.add_parser(parser.add_subparsers(dest="command"))
    plan.run(parser.parse_args(["plan", *argv]))
    return capsys.readouterr().out

