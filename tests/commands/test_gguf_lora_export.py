"""The adapter alone as a GGUF LoRA file (gguf_export/lora.py), checked with gguf.GGUFReader: the
names, shapes and alpha llama.cpp reads, B's rows reordered as the base weights they add to, and the
PEFT features llama.cpp cannot hold refused."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from support.gguf_cases import fields

from relaytune.errors import UserError
from relaytune.gguf_export import write_gguf, write_lora_gguf


def test_lora_gguf_names_shapes_alpha_and_the_same_rope_layout_as_the_base(tiny_model, tmp_path):
    """Base (f32 GGUF) + alpha/r * B @ A from the LoRA GGUF equals the merged model's f32 GGUF,
    so B's q/k rows are reordered exactly like the base weights they add to."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model), LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "down_proj"], lora_dropout=0.0))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)  # PEFT starts B at zero; a zero update would prove nothing
    peft_model.save_pretrained(tmp_path / "adapter")
    merged = peft_model.merge_and_unload()
    merged.save_pretrained(tmp_path / "merged")

    lora = write_lora_gguf(tmp_path / "adapter", tiny_model, tmp_path / "adapter.gguf")
    base = write_gguf(tiny_model, tmp_path / "base.gguf", "f32")
    whole = write_gguf(_with_tokenizer(tmp_path / "merged", tiny_model), tmp_path / "merged.gguf", "f32")
    kv, reader = fields(lora)
    assert (kv["general.type"], kv["adapter.type"], kv["general.architecture"]) == ("adapter", "lora", "llama")
    assert kv["adapter.lora.alpha"] == pytest.approx(8.0)
    shapes = {t.name: list(map(int, t.shape)) for t in reader.tensors}
    assert shapes["blk.0.attn_q.weight.lora_a"] == [64, 4] and shapes["blk.0.attn_q.weight.lora_b"] == [4, 64]
    assert shapes["blk.1.attn_k.weight.lora_b"] == [4, 32] and shapes["blk.1.ffn_down.weight.lora_a"] == [128, 4]
    assert len(shapes) == 2 * 2 * 4
    lora_t = {t.name: np.asarray(t.data) for t in reader.tensors}
    base_t = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(base).tensors}
    whole_t = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(whole).tensors}
    for name in ("blk.0.attn_q.weight", "blk.1.attn_k.weight", "blk.0.attn_v.weight", "blk.1.ffn_down.weight"):
        rebuilt = base_t[name] + 8 / 4 * lora_t[name + ".lora_b"] @ lora_t[name + ".lora_a"]
        np.testing.assert_allclose(rebuilt, whole_t[name], atol=1e-5, err_msg=name)


def _with_tokenizer(folder: Path, tokenizer_from: Path) -> Path:
    import shutil

    for f in tokenizer_from.iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith(".jinja"):
            shutil.copy(f, folder / f.name)
    return folder


def test_lora_features_llama_cpp_cannot_hold_are_refused(tmp_path, tiny_model):
    folder = tmp_path / "dora"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "use_dora": True}))
    with pytest.raises(UserError, match="use_dora.*merged"):
        write_lora_gguf(folder, tiny_model, tmp_path / "x.gguf")
    assert not list(tmp_path.glob("*.gguf*"))


def test_rslora_alpha_is_rescaled_for_llama_cpps_alpha_over_rank():
    """rsLoRA scales by alpha / sqrt(r); llama.cpp by alpha / r, so the file carries alpha * sqrt(r)."""
    import tempfile

    from relaytune.gguf_export.lora import _lora_settings

    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "adapter_config.json").write_text(json.dumps(
            {"peft_type": "LORA", "r": 16, "lora_alpha": 8, "use_rslora": True}))
        assert _lora_settings(Path(folder))["alpha"] == pytest.approx(8 * 4)
