"""`relaytune plan CONFIG [--gpu NAME]`: memory, fit, micro-batch, disk and time of a run, without a GPU."""

from __future__ import annotations

import argparse
from pathlib import Path

DESCRIPTION = (
    "Predict, without a GPU and without downloading weights, what a run needs: peak GPU memory split "
    "into its parts, whether it fits the card, the largest micro-batch that keeps the global batch, "
    "whether gradient checkpointing could be off, what to change when nothing fits, checkpoint size "
    "and disk, tokens/s and the time in hours and in Kaggle/Colab sessions. The model's shape comes "
    "from a local folder's config.json, a .gguf header, the built-in model, a table of popular Hub "
    "models, or the local Hugging Face cache.")
GPU_HELP = ("the card: T4 (default), P100, L4, A10G, A100-40, A100-80, H100, H200; NAME:GiB for another "
            "card (e.g. RTX4090:24, or T4:14 for a T4 with less free memory); `all` compares every card")
COUNTED_SUFFIXES = (".jsonl",)
MAX_COUNTED_BYTES = 4 * 2 ** 30  # counting lines of a bigger file would make `plan` slow; pass --rows instead


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("plan", help="predict memory, fit, micro-batch, disk and time before training",
                              description=DESCRIPTION)
    p.add_argument("config", help="YAML config file (the one you would give `relaytune train`)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="override config keys")
    p.add_argument("--gpu", default="T4", help=GPU_HELP)
    p.add_argument("--rows", type=int, default=None,
                   help="training rows, for the time estimate (default: counted in a local .jsonl dataset)")
    p.add_argument("--mean-tokens", type=float, default=None,
                   help="average tokens per row (`relaytune data` prints the lengths); default: every row "
                        "fills max_seq_length, an upper bound")
    return p


def run(args: argparse.Namespace) -> None:
    """Print the plan for the config on the chosen card(s). Bad input raises UserError (exit 2)."""
    from relaytune.plan import format_plan, make_plan, parse_gpu
    from relaytune.plan.gpus import TABLE
    from relaytune.plan.planner import check_plan_inputs
    from relaytune.plan.sources import resolve_architecture

    check_plan_inputs(args.rows, args.mean_tokens)
    cfg = _load(args.config, list(getattr(args, "overrides", None) or []))
    arch = resolve_architecture(cfg.model)
    rows = args.rows or count_rows(cfg)
    choice = str(getattr(args, "gpu", None) or "T4")
    if choice.lower() == "all":
        print(compare_cards(cfg, arch, [TABLE[n] for n in TABLE], rows, args.mean_tokens), end="")
        return
    plan = make_plan(cfg, parse_gpu(choice), arch=arch, rows=rows, mean_tokens=args.mean_tokens)
    print(format_plan(plan), end="")


def _load(path: str, overrides: list[str]):
    try:
        from relaytune.config import load_config
    except ImportError:  # before the config package existed
        from relaytune.config_loader import load_config
    return load_config(path, overrides or None)


def count_rows(cfg) -> int | None:
    """Training rows of a single local .jsonl dataset (non-blank lines, less the held-out share), else None."""
    source = cfg.dataset
    if not isinstance(source, str):
        return None
    path = Path(source).expanduser()
    if path.suffix not in COUNTED_SUFFIXES or not path.is_file() or path.stat().st_size > MAX_COUNTED_BYTES:
        return None
    rows = 0
    with open(path, "rb") as f:
        for line in f:
            rows += bool(line.strip())
    if not getattr(cfg, "eval_dataset", None):
        held = getattr(cfg, "val_set_size", 0) or 0
        rows -= int(held) if held >= 1 else int(rows * held)
    return max(rows, 0) or None


def compare_cards(cfg, arch, gpus, rows, mean_tokens) -> str:
    """One line per card: verdict at the configured micro-batch, the largest that fits, speed and time."""
    from relaytune.plan import make_plan
    from relaytune.plan.memory import GIB

    lines = [f"relaytune plan: {arch.name or arch.model_type}, micro-batch {cfg.per_device_train_batch_size} x "
             f"{cfg.gradient_accumulation_steps}, max_seq_length {cfg.max_seq_length}, on every card in the table",
             f"  {'card':<9}{'memory':>8}  {'peak':>9}  {'verdict':<13}{'largest mb':>10}  {'tokens/s':>9}  time"]
    for gpu in gpus:
        plan = make_plan(cfg, gpu, arch=arch, rows=rows, mean_tokens=mean_tokens)
        speed = plan.throughput.tokens_per_second
        hours = f"{plan.eta.hours:,.1f} h" if plan.eta else "-"
        lines.append(f"  {gpu.name:<9}{gpu.memory_gib:>6.1f}Gi  {plan.memory.total_reserved / GIB:>7.2f}Gi  "
                     f"{plan.status:<13}{plan.best_micro_batch or '-':>10}  "
                     f"{f'{speed:,.0f}' if speed else '-':>9}  {hours}")
    lines.append("  peak: predicted on the card (nvidia-smi) at the configured micro-batch; `--gpu NAME` for the "
                 "parts and advice")
    return "\n".join(lines) + "\n"
