"""The causal-LM loss without materialising the full logits.

A model's own forward computes logits for every position (batch x seq x vocab;
for Qwen2.5 at 4 x 2048 that is 1.2 G values, 5 GB in fp32 once the loss
upcasts them, and as much again for their gradient). Here the decoder runs,
then only the positions that carry a label go through the output head, in
chunks, each recomputed in backward: the peak holds one chunk's logits.

The sum is divided by `num_items` (the target tokens of the whole global
batch), exactly as transformers' `num_items_in_batch` does, so gradient
accumulation stays exact. Architectures whose head does more than a linear
layer (logit soft-capping, scaling) use the model's own forward instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from relaytune.data.rows import IGNORE
from relaytune.training.loss_settings import CHUNK_TOKENS, PLAIN_HEAD


def supports_chunked_loss(model) -> bool:
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = lm.config
    if getattr(config, "model_type", None) not in PLAIN_HEAD:
        return False
    if any(getattr(config, k, None) for k in ("final_logit_softcapping", "logits_scaling", "logit_scale")):
        return False
    return hasattr(lm, "get_decoder") and lm.get_output_embeddings() is not None


def causal_lm_loss(model, batch: dict, num_items: int, chunked: bool = True) -> torch.Tensor:
    """Summed next-token cross-entropy over labelled positions, divided by `num_items`."""
    if not chunked:
        return model(**batch, num_items_in_batch=num_items).loss
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    hidden = lm.get_decoder()(**inputs, use_cache=False).last_hidden_state
    labels = batch["labels"]
    # Position t predicts token t+1; the last position predicts nothing.
    targets = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE)], dim=1).reshape(-1)
    keep = (targets != IGNORE).nonzero(as_tuple=True)[0]
    hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, keep)
    targets = targets.index_select(0, keep)
    head = lm.get_output_embeddings()
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, targets.numel(), CHUNK_TOKENS):
        h, t = hidden[start:start + CHUNK_TOKENS], targets[start:start + CHUNK_TOKENS]
        if torch.is_grad_enabled():
            total = total + checkpoint(_chunk_loss, head, h, t, use_reentrant=False)
        else:
            total = total + _chunk_loss(head, h, t)
    return total / num_items


def _chunk_loss(head, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = head(hidden).float()
    return F.cross_entropy(logits, targets, reduction="sum")
