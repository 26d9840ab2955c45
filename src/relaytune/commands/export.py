"""`relaytune export RUN_DIR --out DIR`: a checkpoint as a deployable folder.

Two forms:
  - the adapter (default): PEFT files plus the tokenizer with its chat template,
    for PeftModel.from_pretrained on top of the base model;
  - `--merge`: the adapter folded into the base weights (merge_and_unload), saved
    as sharded safetensors with the tokenizer, for AutoModelForCausalLM alone.

The merge always goes into the full-precision base. Folding a LoRA update into
4-bit weights re-quantizes it, so most of the update is rounded away and the
result is neither the trained model nor reproducible; a run trained with
load_in_4bit is therefore merged into the unquantized base (with a note), and a
base that is only available pre-quantized is refused with what to do instead.
The disk is checked before anything is written; the folder appears only when
complete (written beside it, then renamed).
"""

from __future__ import annotations

import json
import shutil
import struct
import uuid
from pathlib import Path

from relaytune.errors import UserError
from relaytune.log import info, notice
from relaytune.run_dir import AdapterRef, named, run_config, run_dir

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
DTYPES = {"float32": 4, "bfloat16": 2, "float16": 2}


def export_run(run: str | Path, out: str | Path, checkpoint: str | None = None, merge: bool = False,
               max_shard_size: str = "5GB", dtype: str = "auto", base: str | None = None,
               config: str | None = None) -> Path:
    src_run = run_dir(run)
    cfg = run_config(src_run, config)
    ref = named(src_run, checkpoint or _default(src_run))
    target = Path(out).expanduser().resolve()
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise UserError(f"--out: {target} already exists and is not empty; choose a new folder")
    owned = [src_run / d for d in ("checkpoints", "final", "best")]
    if target == src_run or any(target == d or d in target.parents for d in owned):
        raise UserError(f"--out: {target} is inside the run's own folders; choose another place")
    if base:
        cfg = cfg.model_copy(update={"model": base})
    from relaytune.model import load_tokenizer

    from relaytune.data.templates import resolve

    tokenizer = load_tokenizer(cfg)
    template = resolve(cfg.chat_template, tokenizer)
    if template.text is not None:  # ship the template training used, e.g. chat_template: chatml
        tokenizer.chat_template = template.text
    tmp = target.parent / f".relaytune-tmp-export-{target.name}-{uuid.uuid4().hex[:8]}"
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        if merge:
            _merged(cfg, ref, tmp, target, tokenizer, max_shard_size, dtype)
        else:
            need = sum((ref.path / f).stat().st_size for f in ADAPTER_FILES)
            check_disk(target.parent, need)
            tmp.mkdir()
            for f in ADAPTER_FILES:
                shutil.copyfile(ref.path / f, tmp / f)
            tokenizer.save_pretrained(tmp)
        (tmp / "relaytune_export.json").write_text(json.dumps({
            "run": str(src_run), "adapter": ref.name, "step": ref.step, "adapter_sha256": ref.sha256,
            "base_model": cfg.model, "merged": merge, "trained_in": _trained_in(cfg)}, indent=1))
        if target.exists():
            target.rmdir()  # empty (checked above)
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    info(f"exported {ref.name} ({'merged model' if merge else 'adapter'}) to {target}")
    return target


def _default(run: Path) -> str:
    return "final" if (run / "final" / "manifest.json").is_file() else "latest"


def _trained_in(cfg) -> str:
    return "4-bit" if cfg.load_in_4bit else "8-bit" if cfg.load_in_8bit else "full precision"


def _merged(cfg, ref: AdapterRef, tmp: Path, target: Path, tokenizer, max_shard_size: str, dtype: str):
    import torch
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM

    from relaytune.model import resolve_source

    src = resolve_source(cfg)
    extra = {"gguf_file": src.gguf_file} if src.gguf_file else {}
    base_config = AutoConfig.from_pretrained(src.path, trust_remote_code=cfg.trust_remote_code, **extra)
    quant = getattr(base_config, "quantization_config", None)
    if quant and not src.gguf_file:  # GGUF dequantizes on load; a bnb/GPTQ/AWQ folder does not
        method = quant.get("quant_method", "quantized") if isinstance(quant, dict) else \
            getattr(quant, "quant_method", "quantized")
        raise UserError(
            f"the base model {cfg.model} is stored quantized ({method}). Merging the adapter into "
            "quantized weights would round most of its update away, so relaytune does not do it. "
            "Merge into the full-precision base instead: pass --base with the original, unquantized "
            "model (the one this quantized copy was made from), or export the adapter without --merge.")
    if cfg.load_in_4bit or cfg.load_in_8bit:
        notice(f"this run trained the adapter on a {_trained_in(cfg)} base; the merge goes into the "
               "full-precision base (never into quantized weights), so outputs differ slightly from "
               "base-in-4-bit + adapter. Export without --merge to serve exactly the trained combination.")
    chosen = _dtype(dtype, base_config)
    # Before loading: the estimate from the base's own files, so a full disk fails in seconds.
    params = _params_from_headers(Path(src.path))
    if params:
        check_disk(target.parent, params * DTYPES[chosen])
    model = AutoModelForCausalLM.from_pretrained(
        src.path, dtype=getattr(torch, chosen), trust_remote_code=cfg.trust_remote_code, **extra)
    if any(type(m).__name__ in ("Linear4bit", "Linear8bitLt") for m in model.modules()):
        raise UserError("the base loaded quantized; merging into 4-/8-bit weights is refused (see above)")
    model = PeftModel.from_pretrained(model, str(ref.path)).merge_and_unload(safe_merge=True)
    check_disk(target.parent, sum(p.numel() * p.element_size() for p in model.parameters()))
    model.save_pretrained(tmp, max_shard_size=max_shard_size, safe_serialization=True)
    tokenizer.save_pretrained(tmp)


def _dtype(dtype: str, base_config) -> str:
    if dtype != "auto":
        if dtype not in DTYPES:
            raise UserError(f"--dtype: {dtype!r} is not one of auto, {', '.join(DTYPES)}")
        return dtype
    stored = getattr(base_config, "dtype", None) or getattr(base_config, "torch_dtype", None)
    name = str(stored).replace("torch.", "") if stored is not None else "float32"
    return name if name in DTYPES else "float32"


def _params_from_headers(folder: Path) -> int | None:
    """Parameter count from the safetensors headers alone (no weights read); None if unknown."""
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    if not files:
        return None
    total = 0
    for f in files:
        with open(f, "rb") as fh:
            header = json.loads(fh.read(struct.unpack("<Q", fh.read(8))[0]))
        for name, entry in header.items():
            if name != "__metadata__":
                n = 1
                for d in entry["shape"]:
                    n *= d
                total += n
    return total


def check_disk(where: Path, need_bytes: int) -> None:
    """Refuse before writing when the free space is short (5% and 64 MiB margin for tokenizer/metadata)."""
    probe = Path(where)
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    need = int(need_bytes * 1.05) + 64 * 2 ** 20
    if need > free:
        raise UserError(f"not enough disk space at {probe}: the export needs about {need / 2 ** 30:.2f} GiB, "
                        f"{free / 2 ** 30:.2f} GiB are free. Free space or choose another --out")


def main(args) -> None:
    """`relaytune export` (see cli.py for the options)."""
    path = export_run(args.run_dir, args.out, args.checkpoint, args.merge, args.max_shard_size,
                      args.dtype, args.base, args.config)
    print(path)
