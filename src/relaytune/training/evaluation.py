"""The evaluation loss: training's eval_loss records and `relaytune eval` compute it the same way."""

from __future__ import annotations

import contextlib

import torch

from relaytune.data import IGNORE
from relaytune.data.batches import micro_batches
from relaytune.training.loss import causal_lm_loss, supports_chunked_loss


def eval_loss(model, rows, batch_size: int, pad_id: int, precision) -> tuple[float, int]:
    """Token-weighted mean loss over `rows`: the summed target-token loss over the number of targets.

    Uses no RNG: the model is in eval mode, so dropout is off.
    """
    autocast = (torch.autocast(precision.device.type, dtype=precision.autocast)
                if precision.autocast else contextlib.nullcontext())
    total, count = 0.0, 0
    model.eval()
    with torch.no_grad(), autocast:
        for batch in micro_batches(rows, batch_size, pad_id):
            batch = {k: v.to(precision.device) for k, v in batch.items()}
            count += int((batch["labels"][:, 1:] != IGNORE).sum())
            # num_items=1 makes it the sum over target tokens.
            total += causal_lm_loss(model, batch, 1, chunked=supports_chunked_loss(model)).float().item()
    return total / max(count, 1), count
