"""The tiny model and packed batches the speed-up and attention tests share (tests/training)."""

from __future__ import annotations

import zlib

import numpy as np
import torch

from relaytune.config.schema import TrainConfig
from relaytune.data.batches import collate
from relaytune.data.packing import concat
from relaytune.data.rows import TokenRow
from relaytune.model import choose_precision, load_model

# Packed batches of width 32 whose documents differ from one to the next (each row's sample lengths).
DIFFERENT_BATCHES = (((7, 12, 5), (20, 4), (9,)), ((3, 3, 3, 3, 20), (30,), (2,) * 6),
                     ((16, 16), (31,), (10, 10, 10)), ((5, 27), (8, 8, 8, 8), (1, 30)), ((32,), (4, 28), (11, 11, 10)))


def tiny_config(tiny_model, tmp_path, **kw) -> TrainConfig:
    return TrainConfig(model=str(tiny_model), dataset="unused.jsonl", output_dir=str(tmp_path / "run"),
                       lora_dropout=0.0, **kw)


def tiny_lora_model(cfg: TrainConfig):
    """The model `cfg` loads, its adapters made nonzero, so that they matter."""
    torch.manual_seed(0)
    model = load_model(cfg, choose_precision(cfg))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode()))))
    return model


def packed_rows(vocab: int, segments) -> list[TokenRow]:
    """One packed row per entry of `segments`, each the concatenation of samples of those lengths."""
    rng = np.random.default_rng(3)
    rows = []
    for lengths in segments:
        ids, labels, segs = concat([(rng.integers(10, vocab, n), rng.integers(10, vocab, n)) for n in lengths])
        rows.append(TokenRow(ids, labels, segs))
    return rows


def packed_batch(vocab: int, segments=((7, 12, 5), (20, 4), (9,)), width: int | None = None) -> dict:
    return collate(packed_rows(vocab, segments), pad_id=0, width=width)


def target_count(batch: dict) -> int:
    return int((batch["labels"][:, 1:] != -100).sum())
