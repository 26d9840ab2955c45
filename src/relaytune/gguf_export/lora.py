"""`write_lora_gguf`: a PEFT LoRA adapter alone, as a llama.cpp LoRA GGUF.

llama.cpp applies, for each base tensor W named N, `W x + s * B (A x)` from the tensors
`N.lora_a` (A, rank x in) and `N.lora_b` (B, out x rank), with s = adapter.lora.alpha /
rank times the user's scale. The base GGUF must come from the same base model, so the
q/k rows of B get the same rope interleaving as the base's q/k weights (A is untouched:
the interleaving reorders output rows only).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np

from relaytune import atomic
from relaytune.errors import UserError
from relaytune.gguf_export.families import family_of, kv_heads
from relaytune.gguf_export.tensors import (
    Planned,
    ggml_type,
    interleave_rope_rows,
    read_tensor,
    safetensors_index,
    write_planned,
)

Q = gguf.GGMLQuantizationType
LORA_TYPES = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16}
PREFIX = "base_model.model."


def write_lora_gguf(adapter_dir: Path, base_config, out_file: Path, out_type: str = "f32", *,
                    name: str | None = None) -> Path:
    """Write the adapter in `adapter_dir` (adapter_config.json + adapter_model.safetensors) as a
    llama.cpp LoRA GGUF. base_config: the base model's folder or config.json path, or its
    transformers config. out_type: "f32" (default, as llama.cpp's own converter), "f16" or "bf16".
    name: general.name (default: the adapter folder's name)."""
    adapter_dir, out_file = Path(adapter_dir), Path(out_file)
    if out_type not in LORA_TYPES:
        raise UserError(f"LoRA GGUF type {out_type!r} is not supported; choose one of {', '.join(LORA_TYPES)}")
    config = _base_config(base_config)
    family = family_of(getattr(config, "model_type", None), "the adapter's base model")
    settings = _lora_settings(adapter_dir)
    plan = _lora_plan(adapter_dir, config, family, LORA_TYPES[out_type])
    out_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = atomic.tmp_path(out_file.parent, out_file.name)
    writer = gguf.GGUFWriter(tmp, family.arch_name)
    try:
        writer.add_type(gguf.GGUFType.ADAPTER)
        writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
        writer.add_name(name or adapter_dir.name)
        writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, settings["alpha"])
        write_planned(writer, plan)
        writer.close()
        atomic.commit_file(tmp, out_file)
    finally:
        writer.close()
        tmp.unlink(missing_ok=True)
    return out_file


def _base_config(base_config):
    from transformers import AutoConfig

    if isinstance(base_config, (str, Path)):
        path = Path(base_config)
        folder = path.parent if path.name == "config.json" else path
        if not (folder / "config.json").is_file():
            raise UserError(f"{folder} has no config.json; the LoRA GGUF needs the base model's config")
        family_of(json.loads((folder / "config.json").read_text(encoding="utf-8")).get("model_type"),
                  str(folder))
        return AutoConfig.from_pretrained(folder)
    return base_config


def _lora_settings(adapter_dir: Path) -> dict:
    """The adapter's alpha as llama.cpp will use it; PEFT features it cannot express are refused."""
    path = adapter_dir / "adapter_config.json"
    if not path.is_file():
        raise UserError(f"{adapter_dir} has no adapter_config.json; point at a PEFT adapter folder "
                        "(a run's final/ or checkpoints/step-N/)")
    cfg = json.loads(path.read_text(encoding="utf-8"))
    refused = {
        "peft_type": cfg.get("peft_type", "LORA") != "LORA",
        "use_dora": bool(cfg.get("use_dora")),
        "rank_pattern": bool(cfg.get("rank_pattern")),
        "alpha_pattern": bool(cfg.get("alpha_pattern")),
        "modules_to_save": bool(cfg.get("modules_to_save")),
        "lora_bias": bool(cfg.get("lora_bias")),
    }
    if any(refused.values()):
        what = ", ".join(k for k, v in refused.items() if v)
        raise UserError(f"a llama.cpp LoRA GGUF holds only plain LoRA A/B pairs with one alpha; this "
                        f"adapter uses {what}. Export the merged model to GGUF instead (without --gguf-lora)")
    alpha, rank = float(cfg["lora_alpha"]), int(cfg["r"])
    # llama.cpp scales by alpha / rank; rsLoRA scales by alpha / sqrt(rank), so alpha is adjusted.
    return {"alpha": alpha * math.sqrt(rank) if cfg.get("use_rslora") else alpha, "rank": rank}


def _lora_plan(adapter_dir: Path, config, family, qtype) -> list[Planned]:
    names = gguf.get_tensor_name_map(family.arch, config.num_hidden_layers)
    heads = {gguf.MODEL_TENSOR.ATTN_Q: config.num_attention_heads, gguf.MODEL_TENSOR.ATTN_K: kv_heads(config)}
    tied = bool(getattr(config, "tie_word_embeddings", False))
    plan = []
    for key, (path, shape) in safetensors_index(adapter_dir, "adapter_model.safetensors").items():
        part = ".lora_A.weight" if key.endswith(".lora_A.weight") else \
            ".lora_B.weight" if key.endswith(".lora_B.weight") else None
        base = key.removeprefix(PREFIX)
        if part is None:
            raise UserError(f"the adapter tensor {key} is not a LoRA A/B matrix; llama.cpp LoRA GGUF "
                            "cannot carry it. Export the merged model to GGUF instead")
        base = base[: -len(part)] + ".weight"
        found = names.get_type_and_name(base, try_suffixes=(".weight",))
        if found is None or (tied and base == "lm_head.weight"):
            raise UserError(f"the adapter changes {base}, which has no separate tensor in llama.cpp's "
                            f"{family.arch_name} graph; export the merged model to GGUF instead")
        kind, name = found
        suffix = ".lora_a" if part == ".lora_A.weight" else ".lora_b"
        n_head = heads.get(kind) if family.interleave_rope and suffix == ".lora_b" else None
        plan.append(Planned(name + suffix, tuple(shape), ggml_type(name, tuple(shape), qtype),
                            _loader(path, key, n_head)))
    if not plan:
        raise UserError(f"{adapter_dir}/adapter_model.safetensors holds no LoRA tensors")
    return plan


def _loader(path: Path, key: str, n_head: int | None):
    def load() -> np.ndarray:
        values = read_tensor(path, key)
        return interleave_rope_rows(values, n_head) if n_head else values
    return load
