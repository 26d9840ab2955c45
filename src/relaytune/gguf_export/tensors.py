"""Which tensors go into the GGUF, under which names and in which ggml type.

The plan is built from the safetensors headers alone, so the GGUF header (names,
shapes, types, offsets) is written before any weight is read, and the weights then
stream through one at a time: memory stays at about one tensor, whatever the model.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from relaytune.errors import UserError

Q = gguf.GGMLQuantizationType
# out_type -> (file type recorded in general.file_type, ggml type of the 2-D weights).
OUT_TYPES = {
    "f32": (gguf.LlamaFileType.ALL_F32, Q.F32),
    "f16": (gguf.LlamaFileType.MOSTLY_F16, Q.F16),
    "bf16": (gguf.LlamaFileType.MOSTLY_BF16, Q.BF16),
    "q8_0": (gguf.LlamaFileType.MOSTLY_Q8_0, Q.Q8_0),
}
SKIPPED_SUFFIXES = ("rotary_emb.inv_freq",)  # recomputed by every runtime; old checkpoints store it


@dataclass
class Planned:
    name: str                      # GGUF tensor name, e.g. blk.0.attn_q.weight
    shape: tuple[int, ...]         # numpy order (rows, cols); gguf reverses it on disk
    qtype: gguf.GGMLQuantizationType
    load: Callable[[], np.ndarray]  # float32 values, already in llama.cpp's layout

    @property
    def nbytes(self) -> int:
        block, size = gguf.GGML_QUANT_SIZES[self.qtype]
        return int(np.prod(self.shape)) // block * size


def out_type_of(out_type: str) -> tuple[gguf.LlamaFileType, gguf.GGMLQuantizationType]:
    if out_type not in OUT_TYPES:
        raise UserError(f"GGUF type {out_type!r} is not supported; choose one of {', '.join(OUT_TYPES)}")
    return OUT_TYPES[out_type]


def ggml_type(name: str, shape: tuple[int, ...], wanted: gguf.GGMLQuantizationType) -> gguf.GGMLQuantizationType:
    """Norms, biases and other 1-D tensors stay f32: they are tiny and llama.cpp adds them in f32."""
    if len(shape) < 2 or name.endswith("_norm.weight") or name == "rope_freqs.weight":
        return Q.F32
    block = gguf.GGML_QUANT_SIZES[wanted][0]
    if shape[-1] % block:
        return Q.F16  # a row that is not a whole number of blocks cannot be quantized
    return wanted


def encode(values: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """The bytes of one tensor in `qtype` (gguf.quants rounds exactly as ggml does)."""
    return gguf.quants.quantize(np.ascontiguousarray(values, dtype=np.float32), qtype)


def interleave_rope_rows(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Reorder each head's rows from HF's rotate_half layout (pair i with i + d/2) to the
    adjacent-pair layout (2i, 2i + 1) that llama.cpp's llama rope rotates."""
    rows = weight.shape[0]
    return (weight.reshape(n_head, 2, rows // n_head // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def safetensors_index(folder: Path, pattern: str = "*.safetensors") -> dict[str, tuple[Path, list[int]]]:
    """tensor name -> (file, shape), from the headers only."""
    index: dict[str, tuple[Path, list[int]]] = {}
    for path in sorted(Path(folder).glob(pattern)):
        if pattern == "*.safetensors" and path.name.startswith("adapter_"):
            continue  # a PEFT adapter beside the weights is not part of the merged model
        with open(path, "rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        for name, entry in header.items():
            if name != "__metadata__":
                index[name] = (path, entry["shape"])
    if not index:
        raise UserError(f"{folder} has no *.safetensors weights; GGUF export needs a merged model folder")
    return index


def read_tensor(path: Path, name: str) -> np.ndarray:
    """One tensor as float32 numpy; torch reads it because numpy has no bfloat16."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return f.get_tensor(name).float().numpy()


def model_plan(index: dict, config, family, wanted: gguf.GGMLQuantizationType) -> list[Planned]:
    """Every weight of the merged model under its GGUF name, in ggml layout."""
    from relaytune.gguf_export.families import kv_heads, llama3_rope_factors

    names = gguf.get_tensor_name_map(family.arch, config.num_hidden_layers)
    allowed = set(gguf.MODEL_TENSORS[family.arch])
    tied = bool(getattr(config, "tie_word_embeddings", False))
    plan: list[Planned] = []
    factors = llama3_rope_factors(config)
    if factors is not None:
        plan.append(Planned("rope_freqs.weight", factors.shape, Q.F32, lambda f=factors: f))
    for hf_name, (path, shape) in index.items():
        if hf_name.endswith(SKIPPED_SUFFIXES) or (tied and hf_name == "lm_head.weight"):
            continue  # tied: llama.cpp reuses token_embd when output.weight is absent
        kind_name = names.get_type_and_name(hf_name, try_suffixes=(".weight", ".bias"))
        if kind_name is None or kind_name[0] not in allowed:
            raise UserError(f"GGUF export: the tensor {hf_name} has no place in llama.cpp's "
                            f"{family.arch_name} architecture; this model is not a plain {family.model_type}")
        kind, name = kind_name
        heads = {gguf.MODEL_TENSOR.ATTN_Q: config.num_attention_heads,
                 gguf.MODEL_TENSOR.ATTN_K: kv_heads(config)}.get(kind) if family.interleave_rope else None
        plan.append(Planned(name, tuple(shape), ggml_type(name, tuple(shape), wanted),
                            _loader(path, hf_name, heads)))
    return plan


def _loader(path: Path, hf_name: str, heads: int | None) -> Callable[[], np.ndarray]:
    def load() -> np.ndarray:
        values = read_tensor(path, hf_name)
        return interleave_rope_rows(values, heads) if heads else values
    return load


def write_planned(writer: gguf.GGUFWriter, plan: list[Planned]) -> None:
    """Header, metadata and tensor table first, then each tensor's bytes in plan order."""
    for p in plan:
        writer.add_tensor_info(p.name, p.shape, np.dtype(np.float32), p.nbytes, raw_dtype=p.qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for p in plan:
        data = encode(p.load(), p.qtype)
        if data.nbytes != p.nbytes:
            raise RuntimeError(f"{p.name}: {data.nbytes} bytes encoded, {p.nbytes} planned")
        writer.write_tensor_data(data)
