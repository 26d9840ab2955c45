"""`relaytune data CONFIG`: the data checks of `train`, alone, with statistics.

It loads only the tokenizer, runs exactly the preparation `train` runs (so it
also fills the tokenization cache and writes quarantine.jsonl), and prints what
a user needs before spending GPU hours: rows by format, token lengths, how many
rows were truncated, dropped or quarantined, and how full the sequences are.
"""

from __future__ import annotations

import argparse
import math
import time

DESCRIPTION = ("Read, check and tokenize the training data exactly as `train` would (tokenizer only, no "
               "model), write bad rows to output_dir/quarantine.jsonl, fill the tokenization cache, and "
               "print statistics. Exit 2 if the data is unusable.")


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("data", help="check the data and print statistics, without loading the model",
                              description=DESCRIPTION)
    p.add_argument("config", help="YAML config file")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="override config keys")
    return p


def run(args: argparse.Namespace) -> None:
    from relaytune.config import parse_overrides

    check_data(args.config, parse_overrides(args.overrides))


def check_data(config, overrides: dict | None = None) -> dict:
    """Prepare the data as `train` would and print statistics; returns them too."""
    from relaytune.config import load_config
    from relaytune.data import prepare_data
    from relaytune.data.packing import best_fit_decreasing, efficiency
    from relaytune.model import load_tokenizer

    cfg = load_config(config, overrides)
    tokenizer = load_tokenizer(cfg)
    began = time.monotonic()
    data = prepare_data(cfg, tokenizer)
    stats = dict(data.stats, seconds=round(time.monotonic() - began, 2))
    lengths = data.train.lengths.tolist()
    limit, batch = cfg.max_seq_length, cfg.micro_batch_hint
    if not cfg.packing:
        stats["padding_efficiency"] = round(_padded_share(lengths, batch, cfg.seed), 4)
        bins = best_fit_decreasing(lengths, limit, cfg.seed)
        stats["packing_efficiency_if_on"] = round(efficiency(sum(lengths), len(bins), limit), 4)
    stats["steps_per_epoch"] = math.ceil(len(data.train) / cfg.global_batch_size)
    _print(stats, cfg)
    return stats


def _padded_share(lengths: list[int], micro: int, seed: int) -> float:
    """Real tokens / slots when micro-batches are padded to their longest row (epoch 0's order)."""
    import numpy as np

    order = np.random.default_rng([seed, 0]).permutation(len(lengths))
    arr = np.asarray(lengths)[order]
    slots = sum(int(arr[i:i + micro].max()) * len(arr[i:i + micro]) for i in range(0, len(arr), micro))
    return float(arr.sum()) / max(1, slots)


def _print(s: dict, cfg) -> None:
    p = s["length_percentiles"]
    formats = ", ".join(f"{k} {v}" for k, v in s["rows_by_format"].items()) or "none"
    lines = [
        f"data check of {cfg.dataset if isinstance(cfg.dataset, str) else f'{len(cfg.dataset)} sources'}"
        f" ({s['seconds']} s)",
        f"  rows read          {s['rows_read']}",
        f"  rows by format     {formats}",
        f"  quarantined        {s['quarantined']}" + (f"  (see {cfg.output_dir}/quarantine.jsonl)"
                                                      if s["quarantined"] or s["dropped"] else ""),
        f"  dropped (too long) {s['dropped']}",
        f"  truncated          {s['truncated']}  (max_seq_length {cfg.max_seq_length}, "
        f"on_long_rows {cfg.on_long_rows})",
        f"  token lengths      p50 {p['p50']}, p90 {p['p90']}, p99 {p['p99']}, max {p['max']}",
        f"  training rows      {s['train_rows']}  ({s['train_tokens']} tokens)",
        f"  evaluation rows    {s['eval_rows']}",
    ]
    if cfg.packing:
        lines.append(f"  packing            on: {s['train_sequences']} sequences, "
                     f"{s['packing_efficiency']:.1%} of token slots hold real tokens")
    else:
        lines.append(f"  packing            off: padding leaves {s['padding_efficiency']:.1%} of token "
                     f"slots real (packing: true would give {s['packing_efficiency_if_on']:.1%})")
    lines.append(f"  steps per epoch    {s['steps_per_epoch']}  (global batch {cfg.global_batch_size})")
    print("\n".join(lines), flush=True)
