"""training/document_mask.py builds the BlockMask that create_block_mask builds, tensor for tensor."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from relaytune.data.batches import document_ids
from relaytune.data.packing import position_ids
from relaytune.training.document_mask import document_block_mask

FIELDS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks", "q_indices",
          "full_q_num_blocks", "full_q_indices")


def _positions(rows: list[tuple[int, ...]], width: int) -> torch.Tensor:
    return torch.from_numpy(np.stack([position_ids(segments, width) for segments in rows])).long()


def _reference(pos: torch.Tensor, block: int):
    from torch.nn.attention.flex_attention import create_block_mask

    doc = document_ids(pos)
    b, s = doc.shape
    return create_block_mask(lambda b_, h, q, kv: (q >= kv) & (doc[b_, q] == doc[b_, kv]), b, None, s, s,
                             device="cpu", BLOCK_SIZE=block)


def _random_rows(rng: np.random.Generator, batch: int, width: int) -> list[tuple[int, ...]]:
    rows = []
    for _ in range(batch):
        segments, left = [], int(rng.integers(width // 2, width + 1))  # the rest: collate's padding sample
        while left > 0:
            segments.append(min(left, int(rng.integers(1, max(2, width // 3)))))
            left -= segments[-1]
        rows.append(tuple(segments))
    return rows


CASES = {
    "one document": ([(300,)], 300, 128),
    "documents on tile edges": ([(128, 128, 64), (256, 64)], 320, 128),
    "a document across tiles, a short tail tile": ([(100, 200, 33), (333,)], 333, 128),
    "padding sample after the documents": ([(40, 50), (7,)], 120, 16),
    "many tiny documents": ([tuple([3] * 40), tuple([1] * 120)], 120, 16),
}


@pytest.mark.parametrize("rows, width, block", CASES.values(), ids=CASES.keys())
def test_the_block_mask_equals_create_block_masks(rows, width, block):
    pos = _positions(rows, width)
    _assert_same(document_block_mask(pos, block), _reference(pos, block))


def test_the_block_mask_equals_create_block_masks_on_random_packings():
    rng = np.random.default_rng(0)
    full = partial = 0
    for width, block in ((256, 32), (200, 16), (130, 128), (1024, 128)):
        for _ in range(10):
            pos = _positions(_random_rows(rng, 3, width), width)
            got = document_block_mask(pos, block)
            _assert_same(got, _reference(pos, block))
            full, partial = full + int(got.full_kv_num_blocks.sum()), partial + int(got.kv_num_blocks.sum())
    assert full > 100 and partial > 100, "both kinds of tile were compared"


def _assert_same(got, want) -> None:
    for field in FIELDS:
        assert torch.equal(getattr(got, field), getattr(want, field)), field
    assert got.seq_lengths == want.seq_lengths and got.BLOCK_SIZE == want.BLOCK_SIZE
    assert torch.equal(got.to_dense(), want.to_dense())


def test_a_torch_without_seq_lengths_gets_create_block_masks_mask(monkeypatch):
    """An older from_kv_blocks refuses seq_lengths: the mask comes from create_block_mask instead
    (which, in such a torch, builds it without seq_lengths; here the refusal is the first call only)."""
    from torch.nn.attention.flex_attention import BlockMask

    pos = _positions([(100, 200, 33), (333,)], 333)
    want = _reference(pos, 128)
    real, refused = BlockMask.from_kv_blocks.__func__, []

    def old_signature(cls, *args, **kwargs):
        if not refused:
            refused.append(kwargs.get("seq_lengths"))
            raise TypeError("from_kv_blocks() got an unexpected keyword argument 'seq_lengths'")
        return real(cls, *args, **kwargs)

    monkeypatch.setattr(BlockMask, "from_kv_blocks", classmethod(old_signature))
    _assert_same(document_block_mask(pos, 128), want)
    assert refused == [(333, 333)]
