"""final/ stands alone (issue 14 items 2 and 3, issue 13 item 4): with checkpoints/ deleted every
command still works from final/ with the training-time settings, and adapter_config.json names a
base model others can resolve."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
from support.trained_run import copy_run, finished_run, train_run

from relaytune.checkpoint.state import adapter_config_bytes, resolvable_base
from relaytune.commands.evaluate import evaluate_run
from relaytune.commands.export import EXPORT_INFO, export_run
from relaytune.commands.status import format_status, run_status
from relaytune.run_dir import run_config


@pytest.fixture
def alone(tmp_path_factory, tiny_model, tmp_path):
    """A finished run whose checkpoints/ was deleted (to free disk)."""
    run = copy_run(finished_run(tmp_path_factory, tiny_model), tmp_path / "run")
    shutil.rmtree(run / "checkpoints")
    return run


def test_commands_work_from_final_alone(alone, tmp_path, one_thread):
    info = json.loads((alone / "final/manifest.json").read_text())["run"]  # final/ keeps its config
    assert info["config"]["max_steps"] == 12 and info["data_fingerprint"] and info["step"] == 12
    cfg = run_config(alone)  # no checkpoint holds it: final/'s copy, with the training-time settings
    assert cfg.max_steps == 12 and cfg.learning_rate == 1e-3 and cfg.val_set_size == 8
    out = export_run(alone, tmp_path / "export")
    assert json.loads((out / EXPORT_INFO).read_text())["trained_in"] == "full precision"
    results = evaluate_run(alone, checkpoints="final", include_base=False)
    assert [r.name for r in results] == ["final"]
    st = run_status(alone, plot=False)
    assert st.state == "finished" and st.step == 12 and "12" in format_status(st)


def test_best_carries_the_config_too(alone):
    manifest = json.loads((alone / "best/manifest.json").read_text())
    assert manifest["kind"] == "best" and manifest["run"]["step"] == manifest["step"]
    assert manifest["run"]["config"]["max_steps"] == 12


def test_a_4bit_run_is_labelled_4bit_from_final_alone(tmp_path, tiny_model, one_thread):
    pytest.importorskip("bitsandbytes")
    run = train_run(tmp_path / "q", tiny_model, load_in_4bit=True, max_steps=2, val_set_size=0)
    shutil.rmtree(run / "checkpoints", ignore_errors=True)
    assert run_config(run).load_in_4bit
    out = export_run(run, tmp_path / "export")
    assert json.loads((out / EXPORT_INFO).read_text())["trained_in"] == "4-bit"


def test_the_builtin_model_is_named_by_its_hub_id(tmp_path, monkeypatch):
    monkeypatch.setenv("RELAYTUNE_CACHE", str(tmp_path / "cache"))
    local = tmp_path / "cache" / "SmolLM2-135M-Instruct"
    local.mkdir(parents=True)
    assert resolvable_base(str(local)) == ("HuggingFaceTB/SmolLM2-135M-Instruct", str(local))
    peft = SimpleNamespace(to_dict=lambda: {"base_model_name_or_path": str(local), "r": 8})
    written = json.loads(adapter_config_bytes(SimpleNamespace(peft_config={"default": peft})))
    assert written["base_model_name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_a_local_copy_of_a_hub_model_is_named_by_its_id_else_by_its_path(tmp_path):
    copy = tmp_path / "qwen-copy"
    copy.mkdir()
    (copy / "config.json").write_text(json.dumps({"_name_or_path": "Qwen/Qwen2.5-0.5B"}))
    assert resolvable_base(str(copy)) == ("Qwen/Qwen2.5-0.5B", str(copy))
    own = tmp_path / "mine"
    own.mkdir()
    (own / "config.json").write_text(json.dumps({"_name_or_path": str(own)}))
    assert resolvable_base(str(own)) == (str(own), str(own))
    assert resolvable_base("HuggingFaceTB/SmolLM2-135M-Instruct") == ("HuggingFaceTB/SmolLM2-135M-Instruct", None)


def test_final_loads_with_transformers_peft_integration_and_peft(tmp_path_factory, tiny_model):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run = finished_run(tmp_path_factory, tiny_model)
    final = run / "final"
    config = json.loads((final / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tiny_model)  # a local base: resolvable here
    info = json.loads((final / "manifest.json").read_text())["run"]  # relaytune's own metadata
    assert info["base_model"]["local_path"] == str(tiny_model)
    ids = torch.tensor([[1, 5, 9, 17, 33]])
    via_transformers = AutoModelForCausalLM.from_pretrained(final)  # reads adapter_config.json's base
    assert "default" in via_transformers.peft_config
    assert any("lora_A" in name for name, _ in via_transformers.named_parameters())
    via_peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), str(final))
    base = AutoModelForCausalLM.from_pretrained(tiny_model)
    with torch.no_grad():
        a, b, c = (m.eval()(ids).logits for m in (via_transformers, via_peft, base))
    assert torch.allclose(a, b, atol=1e-5) and not torch.allclose(a, c, atol=1e-6)
