"""Constants of relaytune's own training code that the planner's estimates follow."""

from __future__ import annotations

from relaytune.training.loss_settings import CHUNK_TOKENS, PLAIN_HEAD


def chunk_tokens() -> int:
    """Labelled tokens per loss chunk: the size of the logits that exist at once."""
    return CHUNK_TOKENS


def plain_head_types() -> frozenset[str]:
    """Model types that get the chunked loss; the others materialise the full logits."""
    return PLAIN_HEAD
