"""Packing: several short rows in one sequence, without letting them see each other.

Bins are filled by best-fit decreasing: the longest row first, each into the
open sequence whose free space it fills most tightly. Rows of equal length are
taken in an order drawn from the seed, so the result is a pure function of
(lengths, capacity, seed): a resumed run packs exactly as the first session did.

What keeps samples apart is done elsewhere, from the segment lengths kept here:
`batches.collate` gives each sample its own position_ids (0, 1, ...) and no
attention_mask, from which transformers builds a block-diagonal causal mask
(SDPA, eager, flex) or uses varlen flash attention; and `concat` below takes the
label off the first token of every sample after the first, because the model's
shifted loss would otherwise predict it from the previous sample's last token.
"""

from __future__ import annotations

import bisect
import contextlib

import numpy as np

from relaytune.data.rows import IGNORE


def best_fit_decreasing(lengths, capacity: int, seed: int) -> list[list[int]]:
    """Indices of the rows in each packed sequence; every length must be <= capacity."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) and lengths.max() > capacity:
        raise ValueError(f"a row of {int(lengths.max())} tokens does not fit in {capacity}")
    tie = np.random.default_rng([seed, 0xB1F]).permutation(len(lengths))
    order = np.lexsort((tie, -lengths))
    bins: list[list[int]] = []
    spaces: list[int] = []  # sorted free-space values that at least one open bin has
    open_bins: dict[int, list[int]] = {}  # free space -> bins with exactly that much
    for i in order.tolist():
        need = int(lengths[i])
        j = bisect.bisect_left(spaces, need)
        if j == len(spaces):  # nothing fits: open a new sequence
            b, free = len(bins), capacity
            bins.append([])
        else:  # the tightest fit
            free = spaces[j]
            stack = open_bins[free]
            b = stack.pop()
            if not stack:
                del open_bins[free]
                spaces.pop(j)
        bins[b].append(i)
        free -= need
        if free > 0:
            if free in open_bins:
                open_bins[free].append(b)
            else:
                open_bins[free] = [b]
                bisect.insort(spaces, free)
    return bins


def concat(pieces: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray, tuple[int, ...]]:
    """(input_ids, labels, segment lengths) of one packed sequence."""
    ids = np.concatenate([p[0] for p in pieces])
    labels = np.concatenate([p[1] for p in pieces])
    segments = tuple(len(p[0]) for p in pieces)
    start = 0
    for n in segments[:-1]:
        start += n
        labels[start] = IGNORE  # no loss across a boundary (see the module docstring)
    return ids, labels, segments


def position_ids(segments: tuple[int, ...], width: int) -> np.ndarray:
    """0..n-1 for each sample, then 0.. for the padding (its own block, never a target)."""
    parts = [np.arange(n) for n in segments]
    used = sum(segments)
    if width > used:
        parts.append(np.arange(width - used))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


# Packed samples are isolated when their logits differ from the lone sample's by under 2% (fp32 and
# bf16 on small models stay far below), or by under a fifth of what a deliberate leak changes.
ISOLATED_ERROR = 0.02
ISOLATED_SHARE_OF_LEAK = 0.2


def check_isolation(model) -> str | None:
    """None if this model keeps packed samples apart; otherwise why not, in words.

    Two short random samples are run packed (one row, positions restarting) and the second
    one alone; its logits must agree. A model whose attention ignores packed position_ids
    (custom modelling code, a KV cache left on, flash attention on a padded batch) fails
    here in a few milliseconds instead of silently training on leaked context.

    "Agree" is judged against a leak made on purpose: the same two samples as one ordinary
    sequence, so the second sees the first. Low precision through many layers (bf16, 4-bit
    weights) makes the packed and the lone pass differ by a few percent, since their kernels
    sum in another order; a leak moves the logits by about as much as the deliberate one.
    """
    import torch

    vocab = int(getattr(model.config, "vocab_size", 0) or 1000)
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randint(min(10, vocab - 1), min(1000, vocab), (1, n), generator=gen) for n in (12, 9))
    ids = torch.cat([a, b], dim=1)
    pos = torch.cat([torch.arange(12), torch.arange(9)])[None]
    # The decoder's device: the input embedding may be in host memory (offload_embeddings).
    device = next((p.device for p in model.parameters() if p.device.type != "cpu"), torch.device("cpu"))
    was_training = model.training
    model.eval()  # no dropout, so the passes are comparable
    # Eager even where the layers are compiled: these three tiny inference shapes would each cost a
    # compile, and on an H200 Inductor failed to lower FlexAttention's decoding kernel for them, after
    # which the packed run trained with flex unfused (bench/results/vs-trl-h200.md).
    set_stance = getattr(torch.compiler, "set_stance", None)
    eager = set_stance("force_eager") if set_stance else contextlib.nullcontext()
    try:
        with torch.no_grad(), eager, _quiet_unfused_flex():
            packed = model(input_ids=ids.to(device), position_ids=pos.to(device)).logits[0, 12:].float()
            alone = model(input_ids=b.to(device)).logits[0].float()
            leaked = model(input_ids=ids.to(device)).logits[0, 12:].float()
    finally:
        model.train(was_training)
    scale = alone.abs().mean().clamp_min(1e-6)
    error, leak = float((packed - alone).abs().mean() / scale), float((leaked - alone).abs().mean() / scale)
    if error < ISOLATED_ERROR or error < ISOLATED_SHARE_OF_LEAK * leak:
        return None
    impl, cache = getattr(model.config, "_attn_implementation", "?"), getattr(model.config, "use_cache", "?")
    return (f"packed samples see each other in this model (logits differ by {error:.1%} from the "
            f"sample alone, against {leak:.1%} when it follows the other sample on purpose; attention: "
            f"{impl}, use_cache: {cache})")


@contextlib.contextmanager
def _quiet_unfused_flex():
    """The check runs FlexAttention unfused on purpose (eager, 21 tokens). torch warns once per process
    that flex ran "without torch.compile()", which there would read as if training did; the warning
    is kept back, and left unspent for a later unfused call that would deserve it."""
    import sys
    import warnings

    fa = sys.modules.get("torch.nn.attention.flex_attention")  # not imported: flex is not in use
    shown = getattr(fa, "_WARNINGS_SHOWN", None)
    spent = shown is not None and "flex_attention_performance" in shown
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        try:
            yield
        finally:
            if shown is not None and not spent:
                shown.discard("flex_attention_performance")


def flat_layout(model) -> bool:
    """Whether micro-batches must be one flat row: flash attention only goes varlen (and so
    only keeps packed samples apart) for a batch of one row with packed position_ids."""
    impl = str(getattr(getattr(model, "config", None), "_attn_implementation", "") or "")
    return "flash" in impl


def efficiency(tokens: int, sequences: int, capacity: int) -> float:
    """Real tokens / token slots."""
    return tokens / max(1, sequences * capacity)
