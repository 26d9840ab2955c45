"""`per_device_train_batch_size: auto` and `gradient_checkpointing: auto` on the CPU: the choice, the exact
global batch (byte-identical to the micro-batch set by hand), the trial step's harmlessness, the bisection on
an OOM, and a resume that does not probe again."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_config

from relaytune.config.loader import load_config
from relaytune.data.rows import TokenRow
from relaytune.errors import UserError
from relaytune.training import autobatch


def cfg(**kw):
    return load_config({"dataset": "d.jsonl", "output_dir": "out", **kw})


# --- the config: one clear way to state the global batch ------------------------------------------
def test_auto_needs_global_batch_size_and_names_it():
    with pytest.raises(UserError, match=r"per_device_train_batch_size: auto needs the global batch stated as "
                                        r"global_batch_size: N"):
        cfg(per_device_train_batch_size="auto")
    with pytest.raises(UserError, match=r"gradient_accumulation_steps \(4\) follows from the micro-batch chosen; "
                                        r"remove it and keep global_batch_size: 16"):
        cfg(per_device_train_batch_size="auto", global_batch_size=16, gradient_accumulation_steps=4)
    with pytest.raises(UserError, match="global_batch_size.*must be at least 1"):
        cfg(per_device_train_batch_size="auto", global_batch_size=0)


def test_global_batch_size_with_a_fixed_micro_batch():
    c = cfg(per_device_train_batch_size=4, global_batch_size=16)
    assert (c.gradient_accumulation_steps, c.global_batch_size) == (4, 16)
    assert cfg(per_device_train_batch_size=4, gradient_accumulation_steps=2).global_batch_size == 8  # as HF
    with pytest.raises(UserError, match=r"global_batch_size \(16\) is not per_device_train_batch_size \(3\)"):
        cfg(per_device_train_batch_size=3, global_batch_size=16)
    with pytest.raises(UserError, match="global_batch_size"):
        cfg(per_device_train_batch_size=4, gradient_accumulation_steps=2, global_batch_size=16)
    a = cfg(per_device_train_batch_size="auto", global_batch_size=12, gradient_checkpointing="auto")
    assert (a.per_device_train_batch_size, a.global_batch_size, a.gradient_checkpointing) == ("auto", 12, "auto")


# --- the choice on the CPU, and the resume -------------------------------------------------------------
def test_cpu_choice_and_resume_on_the_same_device_does_not_choose_again(capsys):
    c = cfg(per_device_train_batch_size="auto", global_batch_size=12, gradient_checkpointing="auto")
    first = autobatch.choose(c, None)
    assert (first.micro_batch, first.gradient_checkpointing, first.device, first.probes) == (6, False, "cpu", True)
    saved = {"config": c.model_dump(mode="json"), "auto_choice": {**first.record(), "micro_batch_size": 3}}
    again = autobatch.choose(c, saved)
    assert (again.micro_batch, again.from_checkpoint, again.probes) == (3, True, False)
    assert "from the checkpoint (same GPU: the CPU); not probing again" in capsys.readouterr().err
    moved = {**saved, "auto_choice": {**saved["auto_choice"], "device": "NVIDIA H200", "total_memory": 150 << 30}}
    fresh = autobatch.choose(c, moved)
    assert (fresh.micro_batch, fresh.from_checkpoint) == (6, False)
    assert "was made for NVIDIA H200 (150.0 GiB), this is the CPU: choosing again" in capsys.readouterr().err


# --- the trial step and the bisection ----------------------------------------------------------------------
def test_bisection_on_oom_finds_the_largest_divisor_that_fits():
    c = cfg(per_device_train_batch_size="auto", global_batch_size=24)
    choice = autobatch.choose(c, None)
    choice.micro_batch = 24  # as a plan for a big GPU would say
    tried = []

    def step(parts, rows):
        tried.append(len(rows))
        if len(rows) > 5:
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        return None

    rows = [type("R", (), {"input_ids": [0] * n})() for n in range(30)]
    autobatch.confirm(choice, None, rows, c, step=step)
    assert choice.micro_batch == 4 and choice.trials == len(tried) <= 4  # divisors 1 2 3 4 6 8 12 24
    assert tried[0] == 24 and "bisected 24 down to 4" in choice.how_micro

    def never(parts, rows):
        raise torch.OutOfMemoryError("CUDA out of memory (test)")

    choice = autobatch.choose(c, None)
    with pytest.raises(UserError, match="even at micro-batch 1"):
        autobatch.confirm(choice, None, rows, c, step=never)


def test_trial_step_leaves_rng_weights_and_gradients_untouched(tiny_model, one_thread):
    from relaytune.model import choose_precision, load_model, load_tokenizer
    from relaytune.training.optim import build_optimizer
    from relaytune.training.step import StepParts

    c = cfg(model=str(tiny_model), lora_dropout=0.1, per_device_train_batch_size="auto", global_batch_size=4)
    precision = choose_precision(c)
    tok = load_tokenizer(c)
    torch.manual_seed(0)
    model = load_model(c, precision)
    optimizer = build_optimizer(c, model)
    parts = StepParts(model, optimizer, None, precision, tok.pad_token_id, 1.0)
    ids = tok("1 plus 2 is 3, and 4 plus 5 is 9")["input_ids"]
    rows = [TokenRow(input_ids=ids[: 6 + i], labels=ids[: 6 + i]) for i in range(4)]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    was = model.training
    peak = autobatch.trial_step(parts, rows)
    assert peak is None  # no GPU
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert model.training == was and not optimizer.state


# --- end to end: auto gives the same adapter as that micro-batch set by hand; a resume does not probe ----
def test_auto_is_byte_identical_to_the_micro_batch_set_by_hand_and_resume_keeps_it(tmp_path, tiny_model,
                                                                                   chat_data, fork_cli):
    common = dict(lora_dropout=0.1, max_steps=8, save_steps=3)
    auto = make_config(tmp_path / "auto", tiny_model, chat_data, per_device_train_batch_size="auto",
                       global_batch_size=12, gradient_accumulation_steps=1, gradient_checkpointing="auto", **common)
    hand = make_config(tmp_path / "hand", tiny_model, chat_data, per_device_train_batch_size=6,
                       gradient_accumulation_steps=2, **common)
    # The auto run is killed after its first checkpoint and resumed.
    killed = fork_cli.run("train", str(auto), env={"RELAYTUNE_CRASH_AT": "step:end:7"})
    assert killed.returncode != 0
    assert "micro-batch    6 x 2 = global batch 12 (auto: the CPU default" in killed.stderr
    assert "confirmed by a trial step" in killed.stderr
    resumed = fork_cli.run("train", str(auto))
    assert resumed.returncode == 0, resumed.stderr
    assert "auto: micro-batch 6, checkpointing off, from the checkpoint (same GPU: the CPU); not probing again" \
        in resumed.stderr
    assert "trial step" not in resumed.stderr
    r = fork_cli.run("train", str(hand))
    assert r.returncode == 0, r.stderr
    a = (tmp_path / "auto/run/final/adapter_model.safetensors").read_bytes()
    b = (tmp_path / "hand/run/final/adapter_model.safetensors").read_bytes()
    assert a == b
    newest = sorted((tmp_path / "auto/run/checkpoints").glob("step-*"), key=lambda p: int(p.name[5:]))[-1]
    state = json.loads((newest / "trainer_state.json").read_text())
    assert state["auto_choice"] == {"micro_batch_size": 6, "gradient_checkpointing": False, "device": "cpu",
                                    "total_memory": 0}
    assert state["recovery"]["micro_batch_size"] == 6 and state["recovery"]["accumulation"] == 2


def test_the_planners_view_of_this_gpu_carries_its_peak_so_cuda_graphs_memory_is_counted(monkeypatch):
    """planner_gpu() feeds the auto micro-batch: with the card's peak in it, the planner counts the
    layer inputs held once more where the layers replay CUDA graphs (plan/memory.replays_graphs)."""
    monkeypatch.setattr(autobatch, "device_identity", lambda: ("NVIDIA H200", 150_000_000_000))
    monkeypatch.setattr(autobatch, "gpu_budget_bytes", lambda: 130 * 2**30)
    monkeypatch.setattr(autobatch, "_compiles_here", lambda: True)
    monkeypatch.setattr(autobatch.torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    gpu = autobatch.planner_gpu()
    assert (gpu.tflops, gpu.compiles, gpu.bf16) == (989.0, True, True)
    monkeypatch.setattr(autobatch, "device_identity", lambda: ("Some Future GPU", 150_000_000_000))
    assert autobatch.planner_gpu().tflops is None


def test_once_fsdp_shards_the_base_auto_plans_again_with_each_gpus_share(monkeypatch):
    """Llama-3-8B LoRA on a bf16 base with 15 GiB per GPU: replicated, not even micro-batch 1 fits; sharded
    over 2 GPUs the plan takes each GPU's share of the base, the settings FSDP loads with (layers not
    compiled), and a larger micro-batch (no trial step confirms one under FSDP)."""
    from relaytune.plan import Gpu, parse_gpu, resolve_architecture, settings_from_config

    gpu = Gpu("NVIDIA T4-like (15.0 GiB usable)", 15.0, True, parse_gpu("T4").tflops, compiles=True)
    config = cfg(model="meta-llama/Meta-Llama-3-8B", per_device_train_batch_size="auto", global_batch_size=16,
                 max_seq_length=1024, bf16=True, gradient_checkpointing=True)
    arch = resolve_architecture(config.model)
    choice = autobatch.AutoChoice(micro_batch=0, gradient_checkpointing=True, device="gpu", total_memory=1,
                                  how_micro="", how_gc="as configured", auto_micro=True)
    autobatch._choose_fresh(choice, (arch, settings_from_config(config, gpu), gpu), "auto", True, 16)
    choice.plan_inputs = (arch, settings_from_config(config, gpu), gpu)
    choice.refresh_estimate()
    assert choice.micro_batch == 1 and "not even 1 fits" in choice.how_micro
    replicated = choice.frozen_bytes
    loads = config.model_copy(update={"fsdp": True, "torch_compile": False, "compile_checkpoint": False})
    autobatch.shard(choice, loads, 2)
    settings = choice.plan_inputs[1]
    assert (settings.shards, settings.compiled_layers) == (2, False)
    assert choice.frozen_bytes < 0.65 * replicated and choice.frozen_bytes == choice.estimate.parts["frozen weights"]
    assert choice.micro_batch > 1 and choice.how_micro.startswith("auto: planned for NVIDIA T4-like")
    kept = autobatch.AutoChoice(micro_batch=4, gradient_checkpointing=True, device="gpu", total_memory=1,
                                how_micro="auto, from the checkpoint", how_gc="", auto_micro=True,
                                from_checkpoint=True, plan_inputs=(arch, settings_from_config(config, gpu), gpu))
    autobatch.shard(kept, loads, 2)
    assert kept.micro_batch == 4, "a choice kept from the checkpoint is not made again"


def test_a_micro_batch_whose_compiled_checkpoint_would_not_fit_loads_with_it_outside(monkeypatch, capsys):
    """On an H200 under a 14.5 GiB cap, Llama-3-8B QLoRA at micro-batch 8 ran out of memory with the
    checkpoint compiled inside the layers, then trained with it outside
    (bench/results/vs-trl-h200.md, twentieth session). At start-up the plan now says so: the model
    loads with compile_checkpoint off and a notice says why. Micro-batch 4 keeps it inside."""
    from relaytune.plan import estimate_memory, parse_gpu, resolve_architecture, settings_from_config

    gpu = parse_gpu("H200:14.5")
    config = cfg(model="meta-llama/Meta-Llama-3-8B", per_device_train_batch_size=8, max_seq_length=2048,
                 bf16=True, gradient_checkpointing=True, load_in_4bit=True, adapter_dtype="bfloat16")
    arch = resolve_architecture(config.model)
    monkeypatch.setattr(autobatch, "device_identity", lambda: ("NVIDIA H200", 150_000_000_000))
    monkeypatch.setattr(autobatch, "_plan_inputs", lambda c, d: (arch, settings_from_config(c, gpu), gpu))
    choice = autobatch.choose(config, None)
    assert choice.plan_inputs[1].compile_checkpoint == "off"
    assert choice.load_settings() == {"gradient_checkpointing": True, "compile_checkpoint": False}
    assert ("compile_checkpoint: off (with the checkpoint compiled inside the layers, micro-batch 8 is planned "
            "at 15.14 GiB, more than H200 (14.5 GiB) holds with a 10% margin)") in capsys.readouterr().err
    outside = choice.estimate.total_allocated

    four = autobatch.choose(config.model_copy(update={"per_device_train_batch_size": 4}), None)
    assert four.checkpoint_outside is None and four.plan_inputs[1].compile_checkpoint == "auto"
    assert four.load_settings() == {"gradient_checkpointing": True}
    assert "compile_checkpoint" not in capsys.readouterr().err
    settings = settings_from_config(config, gpu)
    assert outside < estimate_memory(arch, settings, 8, True).total_allocated, "the estimate is the outside one"
