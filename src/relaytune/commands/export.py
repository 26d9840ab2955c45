"""`relaytune export RUN_DIR --out DIR`: a checkpoint as a deployable folder.

Two forms:
  - the adapter (default): PEFT files plus the tokenizer with its chat template,
    for PeftModel.from_pretrained on top of the base model;
  - `--merge`: the adapter folded into the base weights (merge_and_unload), saved
    as sharded safetensors with the tokenizer, for AutoModelForCausalLM alone;
  - `--gguf` (a merge, plus GGUF files and an Ollama Modelfile) and `--gguf-lora` (the
    adapter alone as a llama.cpp LoRA GGUF), for llama.cpp, Ollama and LM Studio.

The merge always goes into the full-precision base. Folding a LoRA update into
4-bit weights re-quantizes it, so most of the update is rounded away and the
result is neither the trained model nor reproducible; a run trained with
load_in_4bit is therefore merged into the unquantized base (with a note), and a
base that is only available pre-quantized is refused with what to do instead.
The disk is checked before anything is written; the folder appears only when
complete (written beside it, then renamed). What a killed export left beside it is
removed by the next export into the same folder.

RUN_DIR may also be a checkpoint's own folder (RUN/checkpoints/step-4, RUN/final,
RUN/best): that adapter of its run is exported.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

from relaytune import atomic
from relaytune.errors import UserError
from relaytune.log import info, notice
from relaytune.run_dir import ADAPTER, ADAPTER_CONFIG, AdapterRef, RunDir, named, run_config, run_dir

ADAPTER_FILES = (ADAPTER_CONFIG, ADAPTER)
EXPORT_INFO = "relaytune_export.json"
DTYPES = {"float32": 4, "bfloat16": 2, "float16": 2}
GGUF_TYPES = ("f16", "q8_0", "bf16", "f32")
DESCRIPTION = ("Write a checkpoint as a PEFT adapter folder with the tokenizer and chat template, or with "
               "--merge as a full model (adapter merged into the full-precision base, sharded safetensors) "
               "for AutoModelForCausalLM.from_pretrained.")


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("export", help="export an adapter, or a merged model, ready to load",
                              description=DESCRIPTION)
    p.add_argument("run_dir", help="the run's output_dir")
    p.add_argument("--out", required=True, help="new folder to write")
    p.add_argument("--checkpoint", help="step-N, final, best or latest (default: final, else latest)")
    p.add_argument("--merge", action="store_true", help="merge into the base and write a full model")
    p.add_argument("--max-shard-size", default="5GB",
                   help="largest safetensors shard of a merged model (default 5GB)")
    p.add_argument("--dtype", default="auto", help="merged weights: auto (the base's), float32, bfloat16, float16")
    p.add_argument("--base", help="full-precision base model to merge into (default: the run's model)")
    p.add_argument("--config", help="the run's config file, if no checkpoint holds it")
    p.add_argument("--gguf", action="store_true",
                   help="also write the merged model as GGUF (implies --merge) for llama.cpp, Ollama and LM Studio, "
                        "with an Ollama Modelfile beside it")
    p.add_argument("--gguf-types", default="f16,q8_0", help=f"GGUF types to write (default f16,q8_0; "
                   f"any of {', '.join(GGUF_TYPES)})")
    p.add_argument("--gguf-lora", action="store_true",
                   help="also write the adapter alone as a llama.cpp LoRA GGUF (for llama.cpp's --lora)")
    return p


def run(args: argparse.Namespace) -> None:
    gguf = GgufRequest(tuple(t.strip() for t in args.gguf_types.split(",") if t.strip()) if args.gguf else (),
                       args.gguf_lora)
    path = export_run(args.run_dir, args.out, args.checkpoint, args.merge or args.gguf, args.max_shard_size,
                      args.dtype, args.base, args.config, gguf=gguf)
    print(path)


@dataclass(frozen=True)
class GgufRequest:
    """What to write as GGUF besides the folder: the merged model's types, and the adapter alone."""

    types: tuple[str, ...] = ()
    lora: bool = False


def export_run(run: str | Path, out: str | Path, checkpoint: str | None = None, merge: bool = False,
               max_shard_size: str = "5GB", dtype: str = "auto", base: str | None = None,
               config: str | None = None, gguf: GgufRequest = GgufRequest()) -> Path:
    from relaytune.commands.evaluate import adapter_path_as_run

    src_run, checkpoint = adapter_path_as_run(run, checkpoint, "--checkpoint")
    src_run = run_dir(src_run)
    cfg = run_config(src_run, config)
    ref = named(src_run, checkpoint or _default(src_run))
    target = _check_target(src_run, out)
    if base:
        cfg = cfg.model_copy(update={"model": base})
    bad = [t for t in gguf.types if t not in GGUF_TYPES]
    if bad:
        raise UserError(f"--gguf-types: {bad[0]!r} is not one of {', '.join(GGUF_TYPES)}")
    from relaytune.data.templates import resolve
    from relaytune.model import load_tokenizer

    tokenizer = load_tokenizer(cfg)
    template = resolve(cfg.chat_template, tokenizer)
    if template.text is not None:  # ship the template training used, e.g. chat_template: chatml
        tokenizer.chat_template = template.text
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_exports(target.parent)  # before the disk check: a killed merge may hold gigabytes
    with atomic.held_tmp_folder(target.parent, f"export-{target.name}") as tmp:
        if merge:
            _merged(cfg, ref, tmp, target, tokenizer, max_shard_size, dtype)
        else:
            need = sum((ref.path / f).stat().st_size for f in ADAPTER_FILES)
            check_free_space(target.parent, need)
            for f in ADAPTER_FILES:
                shutil.copyfile(ref.path / f, tmp / f)
            tokenizer.save_pretrained(tmp)
        _write_gguf(cfg, ref, tmp, src_run.name, gguf)
        atomic.write_file(tmp / EXPORT_INFO, json.dumps({
            "run": str(src_run), "adapter": ref.name, "step": ref.step, "adapter_sha256": ref.sha256,
            "base_model": cfg.model, "merged": merge, "trained_in": _trained_in(cfg)}, indent=1).encode(),
            points="export")
        follow_umask(tmp)
        if target.exists():
            target.rmdir()  # empty (checked above)
        atomic.publish(tmp, target)
    info(f"exported {ref.name} ({'merged model' if merge else 'adapter'}) to {target}")
    return target


def _check_target(src_run: Path, out: str | Path) -> Path:
    """--out as an absolute path: a new or empty folder outside the run's own folders."""
    target = Path(out).expanduser().resolve()
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise UserError(f"--out: {target} already exists and is not empty; choose a new folder")
    layout = RunDir(src_run)
    owned = [layout.checkpoints, layout.final, layout.best]
    if target == src_run or any(target == d or d in target.parents for d in owned):
        raise UserError(f"--out: {target} is inside the run's own folders; choose another place")
    return target


def remove_stale_exports(parent: Path) -> None:
    """Remove what earlier exports into `parent` left when killed (a merge's temp folder is the size of
    the model); a running export's own folder is locked, so it stays (atomic.held_tmp_folder)."""
    removed, unsure = atomic.clean_stale_tmp(parent, "export")
    if removed:
        size = sum(n for _, n in removed)
        info(f"removed {len(removed)} unfinished folder(s) of an earlier, interrupted export in {parent} "
             f"({size / 2 ** 20:.1f} MiB freed): {', '.join(p.name for p, _ in removed)}")
    if unsure:
        notice(f"{', '.join(p.name for p in unsure)} in {parent}: unfinished export folder(s); this filesystem "
               "cannot tell whether an export still writes them, so they were kept. Remove them once no "
               "export is running")


def _write_gguf(cfg, ref: AdapterRef, folder: Path, name: str, gguf: GgufRequest) -> None:
    """GGUF files beside the exported folder's own files; the Modelfile points at the last type written."""
    from relaytune.gguf_export import write_gguf, write_lora_gguf, write_modelfile

    written = [write_gguf(folder, folder / f"{name}-{t}.gguf", t, name=name) for t in gguf.types]
    if written:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(folder)
        write_modelfile(written[-1], tok.chat_template, [tok.eos_token] if tok.eos_token else [], folder)
        info(f"GGUF: {', '.join(p.name for p in written)} and an Ollama Modelfile "
             f"(ollama create {name} -f {folder.name}/Modelfile)")
    if gguf.lora:
        from relaytune.model import resolve_source

        src = resolve_source(cfg)
        base = src.path
        if src.gguf_file:
            from transformers import AutoConfig

            base = AutoConfig.from_pretrained(src.path, gguf_file=src.gguf_file)
        path = write_lora_gguf(ref.path, base, folder / f"{name}-lora.gguf", name=name)
        info(f"GGUF adapter: {path.name} (llama.cpp: --lora {path.name} on the base model's GGUF)")


def current_umask() -> int:
    """The process's umask, read without changing it (Linux), else by setting it back at once."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def follow_umask(folder: Path) -> None:
    """Every exported file 0666 & ~umask, as a plain `open` makes it: safetensors writes its
    files 0600, which left model.safetensors unreadable to others beside 0644 siblings."""
    mode = 0o666 & ~current_umask()
    for f in Path(folder).rglob("*"):
        if f.is_file() and not f.is_symlink():
            os.chmod(f, mode)


def _default(run: Path) -> str:
    return "final" if (RunDir(run).final / atomic.MANIFEST).is_file() else "latest"


def _trained_in(cfg) -> str:
    return "4-bit" if cfg.load_in_4bit else "8-bit" if cfg.load_in_8bit else "full precision"


def _merged(cfg, ref: AdapterRef, tmp: Path, target: Path, tokenizer, max_shard_size: str, dtype: str):
    import torch
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM

    from relaytune.model import quiet_peft, resolve_source

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
        check_free_space(target.parent, params * DTYPES[chosen])
    model = AutoModelForCausalLM.from_pretrained(
        src.path, dtype=getattr(torch, chosen), trust_remote_code=cfg.trust_remote_code, **extra)
    if any(type(m).__name__ in ("Linear4bit", "Linear8bitLt") for m in model.modules()):
        raise UserError("the base loaded quantized; merging into 4-/8-bit weights is refused (see above)")
    with quiet_peft():
        model = PeftModel.from_pretrained(model, str(ref.path)).merge_and_unload(safe_merge=True)
    check_free_space(target.parent, sum(p.numel() * p.element_size() for p in model.parameters()))
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


def check_free_space(where: Path, need_bytes: int) -> None:
    """Refuse before writing when the free space is short (5% and 64 MiB margin for tokenizer/metadata)."""
    probe = Path(where)
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    need = int(need_bytes * 1.05) + 64 * 2 ** 20
    if need > free:
        raise UserError(f"not enough disk space at {probe}: the export needs about {need / 2 ** 30:.2f} GiB, "
                        f"{free / 2 ** 30:.2f} GiB are free. Free space or choose another --out")

