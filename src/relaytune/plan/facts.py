"""Constants of relaytune's own training code that the planner's estimates follow."""

from __future__ import annotations

from relaytune.embedding_offload import AUTO_MIN_BYTES, scaled_input_embedding
from relaytune.training.loss_settings import CHUNK_TOKENS, PLAIN_HEAD


def chunk_tokens() -> int:
    """Labelled tokens per loss chunk: the size of the logits that exist at once."""
    return CHUNK_TOKENS


def plain_head_types() -> frozenset[str]:
    """Model types that get the chunked loss; the others materialise the full logits."""
    return PLAIN_HEAD


def embedding_offload_min_bytes() -> int:
    """offload_embeddings: auto moves an untied frozen input embedding this large to host memory."""
    return AUTO_MIN_BYTES


def input_embedding_scales(model_type: str) -> bool:
    """An input embedding that scales its output: offload_embeddings leaves it on the GPU."""
    return scaled_input_embedding(model_type)
