"""Find a model's architecture without a GPU or a download: local config.json, GGUF header, table, Hub cache."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

from relaytune.errors import UserError
from relaytune.plan.architectures import Architecture, canonical_ids, from_table

REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


def resolve_architecture(model: str) -> Architecture:
    """The architecture of `model` as the config names it: a folder, a .gguf file, the built-in, or a Hub id."""
    name = str(model).strip()
    if name.startswith("builtin:"):
        arch = from_table(name)
        if arch is None:
            raise UserError(f"`model`: {name} is not a built-in model (known: builtin:SmolLM2-135M-Instruct)")
        return arch
    path = Path(os.path.expanduser(name))
    if path.suffix == ".gguf":
        if not path.is_file():
            raise UserError(f"`model`: GGUF file {path} not found")
        return from_gguf(path)
    if path.exists():
        if not (path / "config.json").is_file():
            raise UserError(f"`model`: {path} is not a model folder (it has no config.json)")
        return from_config_file(path / "config.json", name)
    if name.startswith((".", "/", "~")):
        raise UserError(f"`model`: {name} does not exist")
    arch = from_table(name)
    if arch is not None:
        return arch
    cached = hub_cache_config(name)
    if cached is not None:
        return from_config_file(cached, name, source=f"the Hugging Face cache ({cached})")
    raise UserError(
        f"`model`: the planner does not know {name} and it is not in the local Hugging Face cache; "
        "it never downloads. Known Hub ids: " + ", ".join(canonical_ids()) + " (and their -Instruct/-it "
        "variants). For another model, point `model` at a local folder that holds its config.json "
        "(only that file is read), e.g. `relaytune plan config.yaml model=./my-model`.")


def from_config_file(path: Path, name: str, source: str | None = None) -> Architecture:
    try:
        values = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: cannot read it as JSON ({e})") from None
    if not isinstance(values, dict):
        raise UserError(f"{path}: not a config.json object")
    return from_config_dict(values, name, source or f"{path}")


def from_config_dict(values: dict, name: str = "", source: str = "config.json") -> Architecture:
    """An Architecture from config.json values; a multimodal config's `text_config` is the language model."""
    text = values.get("text_config") if isinstance(values.get("text_config"), dict) else {}
    merged = {**values, **text}
    model_type = str(text.get("model_type") or values.get("model_type") or "unknown")
    missing = [k for k in REQUIRED if not isinstance(merged.get(k), int)]
    if missing:
        raise UserError(f"{source}: the config lacks {', '.join(missing)}; the planner understands decoder "
                        "configs in the Llama/Qwen/Mistral/Gemma/Phi style")
    heads = merged["num_attention_heads"]
    hidden = merged["hidden_size"]
    tied_default = model_type.startswith("gemma")  # the transformers config classes' own defaults
    softcap = any(merged.get(k) for k in ("final_logit_softcapping", "logits_scaling", "logit_scale"))
    return Architecture(
        model_type=model_type, hidden_size=hidden, intermediate_size=merged["intermediate_size"],
        num_layers=merged["num_hidden_layers"], num_heads=heads,
        num_kv_heads=merged.get("num_key_value_heads") or heads,
        head_dim=merged.get("head_dim") or hidden // heads, vocab_size=merged["vocab_size"],
        tied_embeddings=bool(values.get("tie_word_embeddings", merged.get("tie_word_embeddings", tied_default))),
        qkv_bias=model_type == "qwen2" or bool(merged.get("attention_bias")),
        fused_qkv=model_type == "phi3", fused_gate_up=model_type == "phi3",
        norms_per_layer=4 if model_type.startswith(("gemma2", "gemma3")) else 2,
        qk_norm=model_type.startswith(("qwen3", "gemma3", "olmo2")), logit_softcapping=softcap,
        name=name, source=source)


def hub_cache_config(model_id: str) -> Path | None:
    """config.json of a Hub model already in the local Hugging Face cache (read only, never fetched)."""
    if model_id.count("/") != 1:
        return None
    hub = os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME") or os.path.expanduser("~/.cache/huggingface"), "hub")
    repo = Path(hub) / ("models--" + model_id.replace("/", "--"))
    ref = repo / "refs" / "main"
    if ref.is_file():
        candidate = repo / "snapshots" / ref.read_text().strip() / "config.json"
        if candidate.is_file():
            return candidate
    found = sorted((repo / "snapshots").glob("*/config.json"), key=lambda p: p.stat().st_mtime) \
        if (repo / "snapshots").is_dir() else []
    return found[-1] if found else None


# --- GGUF: the header alone (metadata and tensor names), read without the gguf package's full parse ------------

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
# GGUF architecture names whose transformers model_type differs.
_GGUF_TYPES = {"gemma3": "gemma3_text"}


def from_gguf(path: Path) -> Architecture:
    try:
        meta, tensors = read_gguf_header(path)
        arch = str(meta["general.architecture"])
        values = _gguf_config(arch, {k[len(arch) + 1:]: v for k, v in meta.items() if k.startswith(arch + ".")},
                              meta.get("tokenizer.ggml.tokens"))
        # A GGUF without its own output tensor ties the head to the token embeddings.
        values["tie_word_embeddings"] = "output.weight" not in tensors
    except (OSError, KeyError, TypeError, ValueError, struct.error) as e:
        raise UserError(f"`model`: cannot read the GGUF header of {path} ({type(e).__name__}: {e})") from None
    return from_config_dict(values, str(path), f"the GGUF header of {path.name}")


def _gguf_config(arch: str, keys: dict, tokens: int | None) -> dict:
    """config.json names from a GGUF's `{arch}.*` metadata; the vocabulary falls back to the token list's length."""
    hidden, heads = int(keys["embedding_length"]), int(keys["attention.head_count"])
    return {"model_type": _GGUF_TYPES.get(arch, arch), "hidden_size": hidden,
            "intermediate_size": int(keys["feed_forward_length"]), "num_hidden_layers": int(keys["block_count"]),
            "num_attention_heads": heads, "num_key_value_heads": int(keys.get("attention.head_count_kv") or heads),
            "head_dim": int(keys.get("attention.key_length") or hidden // heads),
            "vocab_size": int(keys.get("vocab_size") or tokens)}


def read_gguf_header(path: Path) -> tuple[dict, set[str]]:
    """Metadata (arrays reduced to their length) and tensor names of a GGUF file, v2 or v3."""
    with open(path, "rb") as f:
        magic, version = f.read(4), struct.unpack("<I", f.read(4))[0]
        if magic != b"GGUF" or version < 2:
            raise ValueError("not a GGUF v2/v3 file")
        n_tensors, n_kv = struct.unpack("<QQ", f.read(16))
        meta = {}
        for _ in range(n_kv):
            name = _string(f)
            meta[name] = _value(f, struct.unpack("<I", f.read(4))[0])
        names = set()
        for _ in range(n_tensors):
            names.add(_string(f))
            dims = struct.unpack("<I", f.read(4))[0]
            f.seek(8 * dims + 4 + 8, os.SEEK_CUR)  # the shape, the type and the data offset
    return meta, names


def _string(f) -> str:
    (n,) = struct.unpack("<Q", f.read(8))
    return f.read(n).decode("utf-8", errors="replace")


def _value(f, kind: int):
    if kind in _SCALARS:
        fmt = _SCALARS[kind]
        return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]
    if kind == _STRING:
        return _string(f)
    if kind == _ARRAY:
        item, count = struct.unpack("<IQ", f.read(12))
        if item in _SCALARS:
            f.seek(struct.calcsize(_SCALARS[item]) * count, os.SEEK_CUR)
        else:
            for _ in range(count):
                _value(f, item)
        return count  # the planner needs only an array's length (the vocabulary size)
    raise ValueError(f"unknown GGUF value type {kind}")
