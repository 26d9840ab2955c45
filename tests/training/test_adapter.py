"""The finished adapter is a plain PEFT adapter; QLoRA and the 8-bit optimizers work on CPU.

- final/ loads with `PeftModel.from_pretrained(base, final_dir)`, holds exactly the adapter
  (no model.safetensors), and changes the base model's logits.
- QLoRA (load_in_4bit, NF4 through bitsandbytes on CPU) trains: the loss falls.
- adamw_8bit and paged_adamw_8bit train, checkpoint and resume byte-identically.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch
from conftest import chat_rows, make_config, run_until_done, step_records, write_jsonl
from safetensors.torch import load_file

from relaytune.training import recipe as loop
from relaytune.training import trainer as trainer_module


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("adata") / "data.jsonl", chat_rows(40, seed=1))


@pytest.fixture(scope="module")
def finished(tmp_path_factory, tiny_model, data_file, fork_cli) -> Path:
    tmp = tmp_path_factory.mktemp("adapter")
    cfg = make_config(tmp, tiny_model, data_file, max_steps=8, learning_rate=1e-2, lora_r=8, lora_alpha=16)
    r = fork_cli.run("train", str(cfg))
    assert r.returncode == 0, r.stderr[-3000:]
    return tmp / "run" / "final"


def test_final_holds_exactly_a_peft_adapter(finished, tiny_model):
    assert sorted(p.name for p in finished.iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors", "manifest.json"]
    assert not (finished / "model.safetensors").exists()
    config = json.loads((finished / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
    assert config["r"] == 8 and config["lora_alpha"] == 16
    assert config["inference_mode"] is True
    assert Path(config["base_model_name_or_path"]) == Path(tiny_model)
    # all-linear: every projection of the llama blocks, never the head
    targets = config["target_modules"]  # peft may write names or full module paths
    assert {t.rsplit(".", 1)[-1] for t in targets} == {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert not any("lm_head" in t for t in targets)
    weights = load_file(str(finished / "adapter_model.safetensors"))
    assert weights and all(".lora_A." in k or ".lora_B." in k for k in weights)
    assert not any("lm_head" in k or "embed" in k for k in weights)


def test_final_loads_with_peft_and_changes_the_logits(finished, tiny_model, one_thread):
    from peft import PeftModel
    from peft.utils import get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[1, 40, 41, 42, 43, 44, 45, 46]])
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    with torch.no_grad():
        base_logits = base(input_ids=ids).logits.clone()
    model = PeftModel.from_pretrained(base, str(finished)).eval()
    saved = load_file(str(finished / "adapter_model.safetensors"))
    loaded = get_peft_model_state_dict(model)
    assert sorted(loaded) == sorted(saved), "every saved tensor maps onto a LoRA weight, and back"
    for k, v in saved.items():
        assert torch.equal(loaded[k], v), k
    assert any(v.abs().sum() > 0 for k, v in saved.items() if "lora_B" in k), "the adapter was trained"
    with torch.no_grad():
        tuned = model(input_ids=ids).logits
        assert (tuned - base_logits).abs().max() > 1e-3
        with model.disable_adapter():
            torch.testing.assert_close(model(input_ids=ids).logits, base_logits)


def test_qlora_on_cpu_trains_and_lowers_the_loss(tmp_path, tiny_model, monkeypatch, one_thread):
    import bitsandbytes as bnb

    rows = [{"messages": [{"role": "user", "content": "what is the capital of france?"},
                          {"role": "assistant", "content": "the capital of france is paris."}]}] * 16
    data = write_jsonl(tmp_path / "repeat.jsonl", rows)
    cfg = make_config(tmp_path, tiny_model, data, load_in_4bit=True, max_steps=20, learning_rate=3e-3,
                      lora_dropout=0.0, per_device_train_batch_size=4, gradient_accumulation_steps=1,
                      save_steps=10)
    built = []
    real_load = trainer_module.load_model

    def spy(*args, **kwargs):
        built.append(real_load(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(trainer_module, "load_model", spy)
    loop.train(str(cfg))
    quantized = [m for m in built[0].modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(quantized) == 14, "every projection of both blocks is a 4-bit layer"
    assert all(m.weight.quant_state.quant_type == "nf4" for m in quantized)
    losses = [r["loss"] for r in step_records(tmp_path / "run" / "metrics.jsonl")]
    assert len(losses) == 20
    assert losses[-1] < losses[0] - 0.5, losses
    assert (tmp_path / "run" / "final" / "adapter_model.safetensors").is_file()
    assert not (tmp_path / "run" / "final" / "model.safetensors").exists()


@pytest.mark.parametrize("optim", ["adamw_8bit", "paged_adamw_8bit"])
def test_8bit_optimizers_train_and_resume_exactly(optim, tmp_path, tiny_model, data_file, fork_cli):
    # lora_r 64: the LoRA A matrices have 64 x 64 = 4096 elements, the size from which
    # bitsandbytes keeps the Adam moments in 8 bits (smaller tensors stay 32-bit). Its state
    # nests them in a dict (`__bnb_optimizer_quant_state__`) whose qmaps are shared between
    # parameters: the checkpoint must store both. On CPU, bitsandbytes warns "Paged optimizers
    # are not supported on CPU" and runs paged_adamw_8bit unpaged.
    settings = dict(optim=optim, max_steps=10, save_steps=4, lora_r=64, lora_dropout=0.1)
    ref = make_config(tmp_path / "ref", tiny_model, data_file, **settings)
    r = fork_cli.run("train", str(ref))
    assert r.returncode == 0, r.stderr[-3000:]
    state = load_file(str(tmp_path / "ref" / "run" / "checkpoints" / "step-8" / "optimizer.safetensors"))
    assert any(t.dtype == torch.uint8 for t in state.values()), "8-bit moments are checkpointed"
    losses = [x["loss"] for x in step_records(tmp_path / "ref" / "run" / "metrics.jsonl")]
    assert len(losses) == 10 and losses[-1] < losses[0]

    cfg = make_config(tmp_path / "cut", tiny_model, data_file, **settings)
    crashed = fork_cli.run("train", str(cfg), env={"RELAYTUNE_CRASH_AT": "step:end:5"})
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-3000:]
    run_until_done(fork_cli, cfg)
    assert (tmp_path / "cut" / "run" / "final" / "adapter_model.safetensors").read_bytes() == \
        (tmp_path / "ref" / "run" / "final" / "adapter_model.safetensors").read_bytes()
    assert [x["step"] for x in step_records(tmp_path / "cut" / "run" / "metrics.jsonl")] == list(range(1, 11))
