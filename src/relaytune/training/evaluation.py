"""The evaluation loss: training's eval_loss records and `relaytune eval` compute it the same way."""

from __future__ import annotations

import contextlib
import time

import numpy as np
import torch

from relaytune.data import IGNORE
from relaytune.data.batches import micro_batches, to_device
from relaytune.data.rows import TokenRow
from relaytune.log import info
from relaytune.training.loss import causal_lm_loss, supports_chunked_loss
from relaytune.training.warmup import compile_stats


def eval_loss(model, rows, batch_size: int, pad_id: int, precision, width: int | None = None) -> tuple[float, int]:
    """Token-weighted mean loss over `rows`: the summed target-token loss over the number of targets.

    Uses no RNG: the model is in eval mode, so dropout is off. The targets are counted on the host
    and the losses summed on the device (in float64, as Python's floats would), so the GPU is read
    once, at the end, instead of twice per micro-batch.

    `width` (packed rows for compiled layers: speedups.batch_width): every micro-batch is padded to
    that width, and the last one to `batch_size` rows with rows of padding alone (no targets), so the
    compiled layers see one shape and compile evaluation once; a smaller last micro-batch cost them
    another compile. An evaluation that compiles (the first one of compiled layers: no-grad forwards
    are a graph of their own) says so and how long it took, since it stalls the run without a step.
    """
    graphs_before, t0 = compile_stats().get("graphs", 0), time.perf_counter()
    autocast = (torch.autocast(precision.device.type, dtype=precision.autocast)
                if precision.autocast else contextlib.nullcontext())
    total, count = torch.zeros((), dtype=torch.float64, device=precision.device), 0
    model.eval()
    with torch.no_grad(), autocast:
        for batch in micro_batches(_filled(rows, batch_size, pad_id, width), batch_size, pad_id, width=width):
            count += int((batch["labels"][:, 1:] != IGNORE).sum())
            batch = to_device(batch, precision.device)
            # num_items=1 makes it the sum over target tokens.
            total += causal_lm_loss(model, batch, 1, chunked=supports_chunked_loss(model)).float().double()
    value = total.item() / max(count, 1)
    compiled = compile_stats().get("graphs", 0) - graphs_before
    if compiled > 0:
        info(f"torch.compile: this evaluation compiled {compiled} graph(s) for its no-grad forwards and took "
             f"{time.perf_counter() - t0:.1f}s; later evaluations reuse them")
    return value, count


def _filled(rows: list[TokenRow], batch_size: int, pad_id: int, width: int | None) -> list[TokenRow]:
    """`rows`, and with a `width` as many rows of padding alone as make the last micro-batch full."""
    missing = -len(rows) % batch_size
    if width is None or not missing:
        return rows
    return list(rows) + [TokenRow(np.array([pad_id]), np.array([IGNORE]), (1,))] * missing
