"""`write_gguf`: a merged Hugging Face model folder as one GGUF file."""

from __future__ import annotations

import shutil
from pathlib import Path

import gguf

from relaytune import atomic
from relaytune.errors import UserError
from relaytune.gguf_export.families import add_hyperparameters, load_config
from relaytune.gguf_export.tensors import (
    model_plan,
    out_type_of,
    safetensors_index,
    write_planned,
)
from relaytune.gguf_export.vocab import add_tokenizer


def write_gguf(model_dir: Path, out_file: Path, out_type: str = "f16", *, name: str | None = None,
               tokenizer_pre: str | None = None) -> Path:
    """Write the merged model in `model_dir` as a GGUF at `out_file`; returns the path.

    out_type: "f16", "q8_0", "bf16" or "f32" for the 2-D weights; norms and other 1-D
    tensors are always f32. name: general.name (default: the folder's name).
    tokenizer_pre: llama.cpp's pre-tokenizer name, only for a tokenizer it cannot recognise.
    The file appears only when complete (written beside it, then renamed).
    """
    model_dir, out_file = Path(model_dir), Path(out_file)
    file_type, wanted = out_type_of(out_type)
    config, family = load_config(model_dir)
    plan = model_plan(safetensors_index(model_dir), config, family, wanted)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    check_disk(out_file.parent, sum(p.nbytes for p in plan))
    tmp = atomic.tmp_path(out_file.parent, out_file.name)
    writer = gguf.GGUFWriter(tmp, family.arch_name)
    try:
        writer.add_type(gguf.GGUFType.MODEL)
        writer.add_name(name or model_dir.name)
        add_hyperparameters(writer, config, family)
        writer.add_file_type(file_type)
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        add_tokenizer(writer, model_dir, config, tokenizer_pre)
        write_planned(writer, plan)
        writer.close()
        atomic.commit_file(tmp, out_file)
    finally:
        writer.close()
        tmp.unlink(missing_ok=True)
    return out_file


def check_disk(folder: Path, tensor_bytes: int) -> None:
    """Refuse before writing when the tensors (plus 64 MiB for vocabulary and alignment) do not fit."""
    need, free = tensor_bytes + 64 * 2 ** 20, shutil.disk_usage(folder).free
    if need > free:
        raise UserError(f"not enough disk space in {folder}: the GGUF needs about {need / 2 ** 30:.2f} GiB, "
                        f"{free / 2 ** 30:.2f} GiB are free")
