"""FlexAttention's BlockMask for a packed batch: causal, and within one document.

`create_block_mask` finds which 128 x 128 tiles of the score matrix are empty, partial or full by
evaluating the mask function on every query and key position (B x S x S, compiled on a GPU to
avoid materialising it); on an H200 that took 3-4 ms of each Llama-3-8B step with the GPU idle
(bench/results/host-overhead-h200.md). Documents are runs of positions, so a tile's kind follows
from the document ids at its four corners: document ids never decrease along a row, so two
position ranges share a document exactly when the later range's first id equals the earlier
range's last id. That is a few operations on B x (S/128)^2 tiles, and the BlockMask it builds is
the one `create_block_mask` builds, tensor for tensor (tests/training/test_document_mask.py).
"""

from __future__ import annotations

import torch

from relaytune.data.batches import document_ids

BLOCK = 128  # FlexAttention's default tile (torch.nn.attention.flex_attention._DEFAULT_SPARSE_BLOCK_SIZE)


def document_block_mask(position_ids: torch.Tensor, block: int = BLOCK):
    """One BlockMask for a packed batch (B, S): query q sees key k when q >= k and both lie in the
    same document, documents being the runs of position_ids that restart at 0
    (data/batches.document_ids). Built on position_ids' device, with no host sync."""
    from torch.nn.attention.flex_attention import BlockMask

    doc = document_ids(position_ids)
    length = doc.shape[1]
    partial, full = _tile_kinds(doc, block)
    kv_num, kv_index = _ordered(partial)
    full_num, full_index = _ordered(full)
    try:
        return BlockMask.from_kv_blocks(kv_num, kv_index, full_num, full_index, BLOCK_SIZE=(block, block),
                                        mask_mod=_same_document_causal(doc), seq_lengths=(length, length))
    except TypeError:  # a torch whose from_kv_blocks takes no seq_lengths: let torch build it
        return torch_block_mask(position_ids, block)


def torch_block_mask(position_ids: torch.Tensor, block: int = BLOCK):
    """The same BlockMask from torch's `create_block_mask`, compiled on a GPU (it never materialises
    B x S x S there): the fallback above, and what bench/block_mask.py times against."""
    from torch.nn.attention.flex_attention import create_block_mask

    doc = document_ids(position_ids)
    batch, length = doc.shape
    args = (_same_document_causal(doc), batch, None, length, length)
    if doc.is_cuda:
        try:
            return create_block_mask(*args, device=doc.device, BLOCK_SIZE=block, _compile=True)
        except TypeError:
            pass
    return create_block_mask(*args, device=doc.device, BLOCK_SIZE=block)


def _same_document_causal(doc: torch.Tensor):
    def same_document_causal(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (doc[b, q_idx] == doc[b, kv_idx])

    return same_document_causal


def _tile_kinds(doc: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial, full): (B, 1, tiles, tiles) booleans, query tile by key tile.

    A tile below the diagonal has every query after every key: it holds some visible pair when the
    key tile's last document is the query tile's first, and only visible pairs when the key tile's
    first document is the query tile's last and the query tile lies wholly inside the sequence (a
    tile cut short by the end holds positions that see nothing). A diagonal tile is always partial
    (a query before a key sees nothing); a tile above it is empty."""
    length = doc.shape[1]
    starts = torch.arange(0, length, block, device=doc.device)
    ends = (starts + block - 1).clamp(max=length - 1)
    first, last = doc[:, starts], doc[:, ends]  # (B, tiles): the documents at each tile's edges
    tiles = torch.arange(starts.numel(), device=doc.device)
    below = tiles[None, :] < tiles[:, None]  # [query tile, key tile]
    diagonal = tiles[None, :] == tiles[:, None]
    whole = (starts + block <= length)[:, None]  # the query tile is not cut short
    some = diagonal | (below & (last[:, None, :] == first[:, :, None]))
    full = below & whole & (first[:, None, :] == last[:, :, None])
    return (some & ~full).unsqueeze(1), full.unsqueeze(1)


def _ordered(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query tile: how many key tiles are set, and their indices first, in ascending order
    (as flex_attention's `_dense_to_ordered` orders them)."""
    dense = tiles.to(torch.int32)
    order = torch.argsort(dense, dim=-1, descending=True, stable=True)
    return dense.sum(dim=-1).to(torch.int32), order.to(torch.int32)
