"""`relaytune export`: adapter and merged model, loadable, same logits; 4-bit and disk refusals."""

from __future__ import annotations

import json
import shutil
from collections import namedtuple

import pytest
from support.trained_run import copy_run, finished_run, one_thread

from relaytune.atomic import TMP_PREFIX
from relaytune.cli import main
from relaytune.commands import export
from relaytune.errors import UserError


@pytest.fixture
def run(tmp_path_factory, tiny_model):
    return finished_run(tmp_path_factory, tiny_model)  # export only reads the run


def _logits(model):
    import torch

    ids = torch.tensor([[1, 366, 201, 21, 385, 338, 2, 201, 1, 301, 382, 86, 201]])
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


def _base_plus_adapter(tiny_model, adapter):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    return _logits(PeftModel.from_pretrained(base, adapter))


def test_merged_export_loads_alone_and_matches_base_plus_adapter(run, tiny_model, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "merged"
    with one_thread():
        assert main(["export", str(run), "--checkpoint", "step-8", "--merge", "--max-shard-size", "150KB",
                     "--out", str(out)]) == 0
        names = {p.name for p in out.iterdir()}
        assert "model.safetensors.index.json" in names and len([n for n in names if n.startswith("model-")]) > 1
        assert not names & {"adapter_config.json", "adapter_model.safetensors"}
        merged = AutoModelForCausalLM.from_pretrained(out)
        assert merged.dtype == torch.float32  # the base's own dtype ("auto")
        expected = _base_plus_adapter(tiny_model, run / "checkpoints" / "step-8")
        torch.testing.assert_close(_logits(merged), expected, rtol=1e-4, atol=1e-5)
        # the adapter really changed something: the merge is not just the base
        plain = AutoModelForCausalLM.from_pretrained(tiny_model)
        assert not torch.allclose(_logits(plain), expected, atol=1e-4)
    tok = AutoTokenizer.from_pretrained(out)
    assert "<|im_start|>" in tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    info = json.loads((out / "relaytune_export.json").read_text())
    assert info["adapter"] == "step-8" and info["merged"] is True


def test_adapter_export_loads_with_peft_and_carries_tokenizer(run, tiny_model, tmp_path):
    import torch
    from transformers import AutoTokenizer

    out = export.export_run(run, tmp_path / "adapter")  # default: final/
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    adapter = "adapter_model.safetensors"
    assert (out / adapter).read_bytes() == (run / "final" / adapter).read_bytes()
    with one_thread():
        torch.testing.assert_close(_base_plus_adapter(tiny_model, out),
                                   _base_plus_adapter(tiny_model, run / "final"))
    assert AutoTokenizer.from_pretrained(out).chat_template
    with pytest.raises(UserError, match="not empty"):
        export.export_run(run, out)


def test_merge_into_a_quantized_base_is_refused(run, tiny_model, tmp_path):
    base = tmp_path / "base-4bit"
    shutil.copytree(tiny_model, base)
    config = json.loads((base / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True,
                                     "bnb_4bit_quant_type": "nf4"}
    (base / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="full-precision base"):
        export.export_run(run, tmp_path / "out", merge=True, base=str(base))
    assert not (tmp_path / "out").exists()
    assert main(["export", str(run), "--merge", "--base", str(base), "--out", str(tmp_path / "out")]) == 2


def test_disk_space_is_checked_before_writing(run, tmp_path, monkeypatch):
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(export.shutil, "disk_usage", lambda p: Usage(10 ** 9, 10 ** 9, 1000))
    with pytest.raises(UserError, match="not enough disk space"):
        export.export_run(run, tmp_path / "merged", merge=True)
    with pytest.raises(UserError, match="not enough disk space"):
        export.export_run(run, tmp_path / "adapter")
    assert not any(p.name.startswith((TMP_PREFIX, "merged", "adapter")) for p in tmp_path.iterdir())


def test_gguf_export_writes_readable_files_and_a_modelfile(run, tmp_path, capsys):
    """`--gguf --gguf-lora`: the merged model as f16 and q8_0 GGUF, the adapter as a LoRA GGUF, an
    Ollama Modelfile naming the last type, all read back by gguf's own reader."""
    import gguf

    out = tmp_path / "gguf"
    with one_thread():
        assert main(["export", str(run), "--out", str(out), "--gguf", "--gguf-lora"]) == 0
    name = run.name
    for suffix in ("f16", "q8_0", "lora"):
        reader = gguf.GGUFReader(out / f"{name}-{suffix}.gguf")
        assert reader.tensors, suffix
    lora = gguf.GGUFReader(out / f"{name}-lora.gguf")
    assert bytes(lora.fields["general.type"].parts[-1]).decode() == "adapter"
    assert all(t.name.endswith((".lora_a", ".lora_b")) for t in lora.tensors)
    modelfile = (out / "Modelfile").read_text()
    assert modelfile.startswith(f"FROM ./{name}-q8_0.gguf") and "TEMPLATE" in modelfile
    assert json.loads((out / "relaytune_export.json").read_text())["merged"] is True


def test_gguf_type_is_checked_before_anything_is_written(run, tmp_path):
    with pytest.raises(UserError, match="--gguf-types: 'q2_k' is not one of f16, q8_0, bf16, f32"):
        export.export_run(run, tmp_path / "x", merge=True, gguf=export.GgufRequest(("q2_k",)))
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("mask", [0o022, 0o027])
def test_every_exported_file_follows_the_umask(run, tmp_path, mask):
    """Issue 14 item 6: the merged model.safetensors was 0600 beside 0644 siblings (safetensors
    writes 0600); every exported file now has the mode a plain open() gives under the umask."""
    import os
    import stat

    old = os.umask(mask)
    try:
        with one_thread():
            assert main(["export", str(run), "--merge", "--out", str(tmp_path / "merged")]) == 0
            assert main(["export", str(run), "--out", str(tmp_path / "adapter")]) == 0
    finally:
        os.umask(old)
    for folder in ("merged", "adapter"):
        files = [p for p in (tmp_path / folder).rglob("*") if p.is_file()]
        modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in files}
        assert "model.safetensors" in modes or folder == "adapter"
        assert set(modes.values()) == {0o666 & ~mask}, modes


def test_a_checkpoint_folder_exports_that_checkpoint(run, tmp_path, capsys):
    """`relaytune export RUN/checkpoints/step-4` said no configuration was found: the folder holds a
    metrics.jsonl, so it passed for a run, and the configuration lives in the run."""
    step4 = run / "checkpoints" / "step-4"
    assert main(["export", str(step4), "--out", str(tmp_path / "x")]) == 0
    assert json.loads((tmp_path / "x" / export.EXPORT_INFO).read_text())["adapter"] == "step-4"
    adapter = "adapter_model.safetensors"
    assert (tmp_path / "x" / adapter).read_bytes() == (step4 / adapter).read_bytes()
    assert f"is step-4 of the run in {run}" in capsys.readouterr().err
    assert main(["export", str(run / "final"), "--out", str(tmp_path / "f")]) == 0
    assert json.loads((tmp_path / "f" / export.EXPORT_INFO).read_text())["adapter"] == "final"
    assert main(["export", str(step4), "--checkpoint", "step-8", "--out", str(tmp_path / "y")]) == 2
    assert "--checkpoint names step-8" in capsys.readouterr().err and not (tmp_path / "y").exists()
    shutil.copytree(step4, tmp_path / "loose")  # a checkpoint copied out of its run
    assert main(["export", str(tmp_path / "loose"), "--out", str(tmp_path / "z")]) == 2
    assert "outside a run folder" in capsys.readouterr().err
    copy = copy_run(run, tmp_path / "copy")  # a checkpoint that a resume set aside: no adapter to take
    aside = copy / "checkpoints" / "step-4.invalid-1700000000"
    (copy / "checkpoints" / "step-4").rename(aside)
    assert main(["export", str(aside), "--out", str(tmp_path / "w")]) == 2
    assert f"is checkpoint step-4 set aside of the run in {copy}, not one adapter" in capsys.readouterr().err
