"""The opt-in memory levers, checked on the CPU where their paths run there.

- offload_activations: it needs checkpointing; the preflight says how much host memory it pins and
  refuses (exit 2) more than the host has available (its copies: test_activation_offload.py).
- adapter_dtype: bfloat16 makes the LoRA weights, their gradients, their AdamW moments and the
  saved adapter bf16, and a run killed mid-way still ends byte-identical to an uninterrupted one.
- prefer_expandable_segments leaves an allocator the user configured alone.

The GPU side (pinned copies, memory saved, speed) is measured in bench/results/vs-trl-h200.md.
"""

from __future__ import annotations

import signal

import pytest
import torch
from safetensors.torch import load_file
from support.run_helpers import make_config, run_until_done, step_records

from relaytune.config.loader import load_config
from relaytune.config.schema import TrainConfig
from relaytune.errors import UserError
from relaytune.model import Precision, check_trainable, choose_precision, load_model
from relaytune.plan.architectures import from_table
from relaytune.plan.memory import Settings, estimate_memory
from relaytune.training.loss import causal_lm_loss
from relaytune.training.preflight import Report, check_offload, predicted_checkpoint_bytes
from relaytune.training.recovery import prefer_expandable_segments

BATCH, SEQ = 3, 17


def _model(tiny_model, tmp_path, **kw):
    cfg = TrainConfig(model=str(tiny_model), dataset="unused.jsonl", output_dir=str(tmp_path / "run"),
                      lora_dropout=0.0, gradient_checkpointing=True, **kw)
    torch.manual_seed(0)
    model = load_model(cfg, choose_precision(cfg))
    with torch.no_grad():  # a nonzero adapter, so that its gradients flow through every layer
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    model.train()
    return model


def _batch(vocab: int) -> dict:
    ids = torch.randint(10, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def test_offload_needs_checkpointing(tiny_model, chat_data, tmp_path):
    cfg = make_config(tmp_path, tiny_model, chat_data, offload_activations=True)
    with pytest.raises(UserError, match="offload_activations: true moves the checkpointed layer inputs to the "
                                        "CPU, so it needs gradient_checkpointing: true") as e:
        load_config(str(cfg))
    assert str(cfg) in str(e.value)
    assert load_config(str(make_config(tmp_path / "auto", tiny_model, chat_data, offload_activations=True,
                                       gradient_checkpointing="auto"))).offload_activations


def test_bf16_adapters_train_in_bf16(tiny_model, tmp_path, one_thread):
    model = _model(tiny_model, tmp_path, adapter_dtype="bfloat16")
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable and {p.dtype for p in trainable} == {torch.bfloat16}
    assert {p.dtype for p in model.parameters() if not p.requires_grad} == {torch.float32}
    batch = _batch(model.config.vocab_size)
    causal_lm_loss(model, batch, BATCH * (SEQ - 1)).backward()
    assert {p.grad.dtype for p in trainable} == {torch.bfloat16}


def test_bf16_adapters_are_refused_with_fp16_training(tiny_model, chat_data, tmp_path):
    cfg = make_config(tmp_path, tiny_model, chat_data, adapter_dtype="bfloat16", fp16=True)
    with pytest.raises(UserError, match=r"config.yaml:\d+: adapter_dtype: bfloat16 needs bf16 \(or fp32\) "
                                        "training, and fp16: true trains with a gradient scaler"):
        load_config(str(cfg))
    t4 = Precision(torch.device("cpu"), torch.float16, torch.float16, True)  # fp16 chosen for a GPU without bf16
    loaded = TrainConfig(model=str(tiny_model), dataset="d.jsonl", output_dir=str(tmp_path / "run"),
                         adapter_dtype="bfloat16")
    with pytest.raises(UserError, match="this run trains in fp16 with a gradient scaler .* set adapter_dtype: float32"):
        check_trainable(loaded, t4)
    check_trainable(loaded, choose_precision(loaded))  # fp32 on the CPU: no scaler, fine


def test_bf16_adapters_resume_byte_identical(tiny_model, chat_data, tmp_path, fork_cli):
    settings = dict(adapter_dtype="bfloat16", max_steps=8, save_steps=3, lora_dropout=0.1)
    ref = make_config(tmp_path / "ref", tiny_model, chat_data, **settings)
    assert fork_cli.run("train", str(ref)).returncode == 0
    saved = tmp_path / "ref/run/checkpoints/step-6"
    assert {t.dtype for t in load_file(str(saved / "adapter_model.safetensors")).values()} == {torch.bfloat16}
    moments = {k: t.dtype for k, t in load_file(str(saved / "optimizer.safetensors")).items() if "exp_avg" in k}
    assert moments and set(moments.values()) == {torch.bfloat16}

    cut = make_config(tmp_path / "cut", tiny_model, chat_data, **settings)
    killed = fork_cli.run("train", str(cut), env={"RELAYTUNE_CRASH_AT": "step:end:5"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    run_until_done(fork_cli, cut)
    final = "run/final/adapter_model.safetensors"
    assert (tmp_path / "cut" / final).read_bytes() == (tmp_path / "ref" / final).read_bytes()
    assert [x["step"] for x in step_records(tmp_path / "cut/run/metrics.jsonl")] == list(range(1, 9))


def test_changing_adapter_dtype_on_resume_is_refused(tiny_model, chat_data, tmp_path, fork_cli):
    first = make_config(tmp_path, tiny_model, chat_data, max_steps=4, save_steps=2)
    # Killed once the step-2 checkpoint is committed: a kill at a step's end may come before the background
    # save of an earlier step commits, and the re-run then starts afresh with nothing to compare.
    killed = fork_cli.run("train", str(first), env={"RELAYTUNE_CRASH_AT": "save:after_rename:1"})
    assert killed.returncode == -signal.SIGKILL
    again = make_config(tmp_path, tiny_model, chat_data, max_steps=4, save_steps=2, adapter_dtype="bfloat16")
    r = fork_cli.run("train", str(again))
    assert r.returncode == 2, r.stderr[-2000:]
    assert "`adapter_dtype`: 'float32' -> 'bfloat16'" in r.stderr


def test_planner_counts_both_levers():
    arch = from_table("meta-llama/Meta-Llama-3-8B")
    def estimate(**kw):
        return estimate_memory(arch, Settings(max_seq_length=2048, quantization="nf4", **kw), 8, True)

    plain, offload, bf16 = estimate(), estimate(offload_activations=True), estimate(adapter_bytes=2)
    assert plain.parts["saved activations"] == 32 * 8 * 2048 * 2 * 4096  # 4 GiB: each layer's bf16 input
    assert offload.parts["saved activations"] == 8 * 2048 * 34 * 1024  # the residual measured on an H200
    assert "pinned CPU memory" in offload.details["saved activations"]
    # Backward copies the next layer's input back while this layer is recomputed (activation_offload.py).
    assert offload.peak_phase == "layer backward" and "prefetched layer input" not in plain.parts
    assert offload.parts["prefetched layer input"] == 8 * 2048 * 2 * 4096
    # The last layer's input stays on the GPU from its forward to its backward, through the loss.
    assert offload.off_peak["last layer input"] == 8 * 2048 * 2 * 4096 and "last layer input" not in plain.off_peak
    for part in ("LoRA parameters", "LoRA gradients", "optimizer state"):
        assert bf16.parts[part] * 2 == plain.parts[part], part


def test_offload_preflight_counts_the_pinned_memory_and_refuses_what_the_host_cannot_hold(
        tiny_model, tmp_path, one_thread, monkeypatch):
    model = _model(tiny_model, tmp_path, offload_activations=True)
    cfg = TrainConfig(model=str(tiny_model), dataset="d.jsonl", output_dir=str(tmp_path / "run"),
                      gradient_checkpointing=True, offload_activations=True, max_seq_length=1024)
    gpu = Precision(torch.device("cuda", 0), torch.bfloat16, torch.bfloat16, False)  # nothing here touches CUDA
    layers, hidden = model.config.num_hidden_layers, model.config.hidden_size
    need = layers * 8 * 1024 * hidden * 2  # every layer's bf16 input of micro-batch 8
    report = Report()
    check_offload(report, model, cfg, 8, True, gpu, available=4 * need)
    assert report.rows == [("offload", f"{need / 2**30:.2f} GiB of pinned host memory for the layer inputs "
                                       f"({4 * need / 2**30:.1f} GiB available)")]
    with pytest.raises(UserError, match=r"offload_activations: true pins about .* \(micro-batch 8 x 1024 tokens "
                                        rf"x {layers} layers x 2 processes\)"):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        check_offload(Report(), model, cfg, 8, True, gpu, available=int(2 * need))
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    six = Report()  # 6 x 1024 x hidden 64 x 2 bytes = 768 KiB per layer input, pinned in a 1 MiB block
    check_offload(six, model, cfg, 6, True, gpu, available=4 * need)
    assert six.rows == report.rows
    for micro, gc, precision in ((8, False, gpu), (8, True, choose_precision(cfg))):
        quiet = Report()
        check_offload(quiet, model, cfg, micro, gc, precision, available=1)
        assert quiet.rows == []


def test_checkpoint_size_follows_the_adapter_dtype(tiny_model, tmp_path, one_thread):
    cfg = TrainConfig(model=str(tiny_model), dataset="d.jsonl", output_dir=str(tmp_path / "run"))
    fp32 = predicted_checkpoint_bytes(_model(tiny_model, tmp_path), cfg)
    bf16 = predicted_checkpoint_bytes(_model(tiny_model, tmp_path, adapter_dtype="bfloat16"), cfg)
    assert fp32 - 64 * 1024 == 2 * (bf16 - 64 * 1024)


def test_expandable_segments_leave_a_configured_allocator_alone():
    assert prefer_expandable_segments({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}) is False
    if not torch.cuda.is_available():
        assert prefer_expandable_segments({}) is False
