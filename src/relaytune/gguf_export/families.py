"""The model families that export to GGUF, and the hyper-parameters each writes.

A family maps a Hugging Face `model_type` to a llama.cpp architecture. Mistral has
no architecture of its own in llama.cpp: its dense models are the llama graph, so
they are written as `llama`. Qwen2 is its own architecture (q/k/v biases, NEOX rope).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from relaytune.errors import UserError
from relaytune.log import notice


@dataclass(frozen=True)
class Family:
    model_type: str
    arch: gguf.MODEL_ARCH
    # True where llama.cpp's graph rotates adjacent pairs (2i, 2i+1) of each q/k head:
    # HF's rotate_half pairs row i with row i + head_dim/2, so those rows are interleaved.
    interleave_rope: bool
    examples: str

    @property
    def arch_name(self) -> str:
        return gguf.MODEL_ARCH_NAMES[self.arch]


FAMILIES = {
    "llama": Family("llama", gguf.MODEL_ARCH.LLAMA, True, "SmolLM2, Llama 2/3, TinyLlama"),
    "mistral": Family("mistral", gguf.MODEL_ARCH.LLAMA, True, "Mistral 7B, Mistral Nemo"),
    "qwen2": Family("qwen2", gguf.MODEL_ARCH.QWEN2, False, "Qwen2, Qwen2.5"),
}
SUPPORTED = ", ".join(f"{name} ({f.examples})" for name, f in FAMILIES.items())
ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def family_of(model_type: str | None, where: str) -> Family:
    family = FAMILIES.get(model_type or "")
    if family is None:
        raise UserError(
            f"GGUF export does not support the architecture {model_type!r} of {where}. "
            f"Supported: {SUPPORTED}. Export the merged folder (relaytune export --merge) and "
            "convert it with llama.cpp's convert_hf_to_gguf.py instead.")
    return family


def load_config(model_dir: Path):
    """(transformers config, Family) of a model folder; refuses unsupported types before any
    weight is read."""
    from transformers import AutoConfig

    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise UserError(f"{model_dir} has no config.json; GGUF export needs a merged model folder "
                        "(relaytune export RUN_DIR --merge writes one)")
    family = family_of(json.loads(path.read_text(encoding="utf-8")).get("model_type"), str(model_dir))
    config = AutoConfig.from_pretrained(model_dir)
    return config, family


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def kv_heads(config) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def add_hyperparameters(writer: gguf.GGUFWriter, config, family: Family) -> None:
    """The `<arch>.*` keys llama.cpp reads to size the graph."""
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(kv_heads(config))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_rope_dimension_count(head_dim(config))
    if head_dim(config) != config.hidden_size // config.num_attention_heads:
        # llama.cpp assumes hidden/heads per head unless told (Mistral Nemo: 128, not 160).
        writer.add_key_length(head_dim(config))
        writer.add_value_length(head_dim(config))
    rope = rope_parameters(config)
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    if rope["rope_type"] == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    elif rope["rope_type"] == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(rope["factor"]))
        writer.add_rope_scaling_orig_ctx_len(int(rope.get("original_max_position_embeddings")
                                                 or config.max_position_embeddings))
    window = getattr(config, "sliding_window", None)
    if family.model_type == "mistral" and window and window < config.max_position_embeddings:
        notice(f"this model attends within a sliding window of {window} tokens; llama.cpp's llama "
               "graph attends to the whole context, so answers differ only past that length")


def rope_parameters(config) -> dict:
    """The rope settings in one shape for transformers 4.x (rope_theta + rope_scaling) and 5.x
    (rope_parameters); an unsupported scaling type is refused rather than silently dropped."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "full_attention" in params:
        params = params["full_attention"]
    if not params:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params = dict(params)
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    if params["rope_type"] not in ROPE_TYPES:
        raise UserError(f"GGUF export: rope scaling {params['rope_type']!r} is not supported "
                        f"(supported: {', '.join(ROPE_TYPES)})")
    return params


def llama3_rope_factors(config) -> np.ndarray | None:
    """llama.cpp divides each rotary frequency by `rope_freqs[i]`; Llama 3.1's scaled frequencies
    come from transformers' own llama3 rope function, so the factors are plain / scaled."""
    rope = rope_parameters(config)
    if rope["rope_type"] != "llama3":
        return None
    import torch
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    dim = head_dim(config)
    plain = 1.0 / (float(rope["rope_theta"]) ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    return (plain / scaled.float()).numpy().astype(np.float32)
