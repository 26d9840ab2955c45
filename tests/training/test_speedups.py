"""GPU speed-ups (training/speedups.py), checked on the CPU where their paths run there.

Numerics are the contract: regional compilation gives the eager loss and gradient norm within a
stated tolerance, and on the CPU it defaults to off (so CPU runs, and their exact resumes, are
untouched). Document-masked attention has its own tests (test_attention.py).

Measured here (tiny llama, fp32, CPU, torch 2.13): compiled vs eager over 3 AdamW steps with
gradient checkpointing, loss within 2e-7 relative and grad norm within 3e-6. Tolerance: COMPILE_RTOL.
"""

from __future__ import annotations

import pytest
import torch
from support.packed_cases import packed_batch, packed_rows, tiny_config, tiny_lora_model

from relaytune.data.batches import collate, document_ids
from relaytune.data.packing import check_isolation
from relaytune.layers import decoder_layers, is_compiled
from relaytune.model import choose_precision
from relaytune.training import evaluation, mfu, speedups, warmup
from relaytune.training.loss import causal_lm_loss

COMPILE_RTOL = 1e-4  # measured <= 3e-6 (grad norm), 2e-7 (loss)


def test_defaults_leave_a_cpu_model_untouched(tiny_model, tmp_path, one_thread):
    model = tiny_lora_model(tiny_config(tiny_model, tmp_path, packing=True, gradient_checkpointing=True))
    assert model.relaytune_speedups == []
    assert not any(is_compiled(layer) for layer in decoder_layers(model))
    assert model.get_base_model().config._attn_implementation == "sdpa"
    assert speedups.compile_decision("auto", torch.device("cpu")) == (False, None)


def test_a_failing_speedup_never_stops_the_run(tiny_model, tmp_path, monkeypatch, one_thread):
    def boom(*a, **k):
        raise RuntimeError("no compiler today")

    monkeypatch.setattr(torch, "compile", boom)
    model = tiny_lora_model(tiny_config(tiny_model, tmp_path, torch_compile=True))
    assert model.relaytune_speedups == []
    assert not any(is_compiled(layer) for layer in decoder_layers(model))


@pytest.mark.slow  # inductor's C++ compile: ~25 s on a 2-core machine
def test_compiled_layers_match_eager(tiny_model, tmp_path, one_thread):
    """torch_compile: true on the CPU: 3 AdamW steps with gradient checkpointing, packed rows."""
    def trajectory(setting):
        cfg = tiny_config(tiny_model, tmp_path, gradient_checkpointing=True, torch_compile=setting)
        model = tiny_lora_model(cfg)
        compiled = [is_compiled(layer) for layer in decoder_layers(model)]
        model.train()  # as the trainer's loop does (dropout is 0)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-2)
        batch = packed_batch(model.config.vocab_size)
        n = int((batch["labels"][:, 1:] != -100).sum())
        out = []
        for _ in range(3):
            loss = causal_lm_loss(model, batch, n)
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            out.append((loss.item(), norm.item()))
        return compiled, out, model

    eager_flags, eager, _ = trajectory(False)
    compiled_flags, compiled, model = trajectory(True)
    assert not any(eager_flags) and all(compiled_flags)
    assert model.relaytune_warmup.seconds is not None, "the warm-up was timed and printed"
    for (l1, g1), (l2, g2) in zip(eager, compiled):
        assert l2 == pytest.approx(l1, rel=COMPILE_RTOL)
        assert g2 == pytest.approx(g1, rel=COMPILE_RTOL)


def test_compiled_layers_get_packed_batches_of_one_width(tiny_model, tmp_path, one_thread):
    """Packed micro-batches are padded to max_seq_length for compiled layers; the loss is unchanged."""
    cfg = tiny_config(tiny_model, tmp_path, packing=True, gradient_checkpointing=True, torch_compile=True,
                      max_seq_length=64)
    model = tiny_lora_model(cfg)
    assert speedups.batch_width(model, cfg) == 64
    assert speedups.batch_width(model, cfg.model_copy(update={"packing": False})) is None
    eager_cfg = cfg.model_copy(update={"torch_compile": False})
    eager = tiny_lora_model(eager_cfg)
    assert speedups.batch_width(eager, eager_cfg) is None

    rows = packed_rows(eager.config.vocab_size, ((7, 12, 5), (20, 4)))
    narrow, wide = collate(rows, pad_id=0), collate(rows, pad_id=0, width=64)
    assert narrow["input_ids"].shape == (2, 24) and wide["input_ids"].shape == (2, 64)
    assert wide["position_ids"][0, 24:].tolist() == list(range(40)), "the padding is a sample of its own"
    assert (wide["labels"][:, 24:] == -100).all() and torch.equal(wide["input_ids"][:, :24], narrow["input_ids"])
    assert "attention_mask" not in wide
    assert document_ids(wide["position_ids"])[1].unique().tolist() == [1, 2, 3]
    with torch.no_grad():
        assert causal_lm_loss(eager, wide, 44).item() == pytest.approx(causal_lm_loss(eager, narrow, 44).item(),
                                                                       rel=1e-6)


@pytest.mark.slow  # one inductor C++ compile: ~30 s on a 2-core machine
def test_packed_steps_of_other_lengths_do_not_recompile(tiny_model, tmp_path, one_thread):
    from relaytune.training.step import StepParts, optimizer_step

    cfg = tiny_config(tiny_model, tmp_path, packing=True, gradient_checkpointing=True, torch_compile=True,
                      max_seq_length=64)
    model = tiny_lora_model(cfg)
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    parts = StepParts(model, optimizer, None, choose_precision(cfg), 0, 1.0, width=speedups.batch_width(model, cfg))
    vocab = model.config.vocab_size
    optimizer_step(parts, packed_rows(vocab, ((7, 12, 5), (20, 4))), 2, 0)
    before = warmup.compile_stats()
    result = optimizer_step(parts, packed_rows(vocab, ((30, 9), (50,))), 2, 1)
    assert result.updated
    assert warmup.compile_stats() == before, "a second length compiled the layer again"


def test_packed_evaluation_of_compiled_layers_has_one_shape_and_the_same_loss(tiny_model, tmp_path, one_thread,
                                                                              monkeypatch):
    """With a width (compiled layers, packed rows), evaluation pads every micro-batch to it and fills
    the last one with rows of padding alone; its loss and target count are those of the plain batches."""
    model = tiny_lora_model(tiny_config(tiny_model, tmp_path, packing=True))
    rows = packed_rows(model.config.vocab_size, ((7, 12, 5), (20, 4), (9,), (30,), (3, 3)))
    precision = choose_precision(tiny_config(tiny_model, tmp_path))
    plain = evaluation.eval_loss(model, rows, 2, 0, precision)
    shapes = []
    real = evaluation.to_device
    monkeypatch.setattr(evaluation, "to_device", lambda batch, device: shapes.append(
        tuple(batch["input_ids"].shape)) or real(batch, device))
    padded = evaluation.eval_loss(model, rows, 2, 0, precision, width=64)
    assert shapes == [(2, 64)] * 3, "five rows and one of padding alone"
    assert padded[1] == plain[1] and padded[0] == pytest.approx(plain[0], rel=1e-6)


def test_only_a_forward_with_grad_makes_the_first_layer_input_require_grad(tiny_model, tmp_path, one_thread):
    """transformers' and PEFT's hooks (one per call) set requires_grad under no_grad too; relaytune's
    one hook does not, so no-grad evaluation gives compiled layers the same input at every depth."""
    model = tiny_lora_model(tiny_config(tiny_model, tmp_path, gradient_checkpointing=True))
    embedding = model.get_base_model().get_input_embeddings()
    assert [h.__name__ for h in embedding._forward_hooks.values()] == ["_require_grad_with_grad_on"]
    ids = torch.tensor([[5, 6, 7]])
    assert embedding(ids).requires_grad
    with torch.no_grad():
        assert not embedding(ids).requires_grad


@pytest.mark.slow  # two inductor C++ compiles: ~20 s on a 2-core machine
def test_evaluations_of_a_compiled_packed_run_compile_the_layers_once(tiny_model, tmp_path, one_thread,
                                                                      monkeypatch, capsys):
    """The first evaluation adds one graph (no grad), and says so; later ones add none. Before, the first
    added four: the first layer's input required grad under no_grad, and the last micro-batch was smaller."""
    from support.run_helpers import chat_rows, make_config, write_jsonl

    from relaytune import train
    from relaytune.training import trainer

    data = write_jsonl(tmp_path / "data.jsonl", chat_rows(120))
    cfg = make_config(tmp_path, tiny_model, data, packing=True, torch_compile=True, max_seq_length=256,
                      gradient_checkpointing=True, val_set_size=0.3, eval_steps=2, max_steps=6,
                      per_device_train_batch_size=2, gradient_accumulation_steps=1)
    added = []

    def counted(*args, **kwargs):
        before = warmup.compile_stats()["graphs"]
        out = evaluation.eval_loss(*args, **kwargs)
        added.append(warmup.compile_stats()["graphs"] - before)
        return out

    monkeypatch.setattr(trainer, "eval_loss", counted)
    torch._dynamo.reset()
    train(str(cfg))
    assert added == [1, 0, 0]
    said = [line for line in capsys.readouterr().err.splitlines() if "this evaluation compiled" in line]
    assert len(said) == 1 and said[0].startswith(
        "relaytune: torch.compile: this evaluation compiled 1 graph(s) for its no-grad forwards and took "), said
    assert said[0].endswith("s; later evaluations reuse them")


def test_a_warm_up_timer_left_before_its_first_step_stays_silent(tiny_model, tmp_path, one_thread, capsys):
    """A run stopped before its first optimizer step (in a notebook, say) leaves its timer's hook in the
    process; the next run's steps neither print its figure nor break the optimizer's hook loop."""
    def model_and_optimizer():
        model = tiny_lora_model(tiny_config(tiny_model, tmp_path))
        model.train()
        timer = warmup.WarmUpTimer.install(model)
        return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3), timer

    batch = packed_batch(64)
    left, _, left_timer = model_and_optimizer()
    causal_lm_loss(left, batch, 10)  # its forward starts its clock; its step never comes
    model, optimizer, timer = model_and_optimizer()
    for _ in range(2):
        causal_lm_loss(model, batch, 10).backward()
        optimizer.step()
    assert timer.seconds is not None and left_timer.seconds is None
    assert capsys.readouterr().err.count("torch.compile warm-up") == 1
    assert timer.handles == [], "its hooks went at the next forward, after the step"


def test_the_warm_up_counts_this_runs_graphs_not_the_processs(tiny_model, tmp_path, one_thread, capsys,
                                                             monkeypatch):
    """Dynamo's graph counter is the process's: in a notebook, a second run that compiled 2 graphs on
    top of an earlier run's 5 says 2."""
    counter = iter([{"graphs": 5}, {"graphs": 7}])
    monkeypatch.setattr(warmup, "compile_stats", lambda: next(counter))
    model = tiny_lora_model(tiny_config(tiny_model, tmp_path))
    model.train()
    warmup.WarmUpTimer.install(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    causal_lm_loss(model, packed_batch(64), 10).backward()
    optimizer.step()
    said = [line for line in capsys.readouterr().err.splitlines() if "torch.compile warm-up" in line]
    assert len(said) == 1 and said[0].endswith("s (2 graphs compiled)"), said


def test_isolation_check_compiles_nothing(tiny_model, tmp_path, one_thread):
    """Its tiny inference rows once made Inductor fail on a GPU and leave flex unfused for the run."""
    cfg = tiny_config(tiny_model, tmp_path, packing=True, gradient_checkpointing=True, torch_compile=True)
    model = tiny_lora_model(cfg)
    assert all(is_compiled(layer) for layer in decoder_layers(model))
    before = warmup.compile_stats()
    assert check_isolation(model) is None
    assert warmup.compile_stats() == before


# --- MFU -------------------------------------------------------------------------------------
def test_peak_table():
    assert mfu.peak_flops("NVIDIA H200") == 989e12
    assert mfu.peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert mfu.peak_flops("NVIDIA H100 PCIe") == 756e12
    assert mfu.peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert mfu.peak_flops("Tesla T4") == 65e12
    assert mfu.peak_flops("NVIDIA L4") == 121e12
    assert mfu.peak_flops("NVIDIA L40S") == 362e12
    assert mfu.peak_flops("NVIDIA A10G") == 125e12
    assert mfu.peak_flops("Some Future GPU") is None


def test_flops_per_token_qwen25_3b_matches_the_review():
    """6N + 12*L*H*head_dim*S for Qwen2.5-3B at S=2048: N = 3.086e9 (tied head counted), 20.3 GFLOP."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("qwen2", hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                                  num_attention_heads=16, num_key_value_heads=2, vocab_size=151936,
                                  tie_word_embeddings=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model.requires_grad_(False)
    f = mfu.flops_per_token(model, 2048)
    assert f.n_matmul == pytest.approx(3.086e9, rel=1e-3)
    attention = 12 * 36 * 16 * 128 * 2048
    assert f.six_n == 6 * f.n_matmul + attention
    assert f.six_n / 1e9 == pytest.approx(20.3, abs=0.05)
    assert f.lora == 4 * f.n_matmul + attention  # nothing trainable here: all frozen


def test_mfu_is_absent_on_the_cpu(tiny_model, tmp_path, one_thread):
    cfg = tiny_config(tiny_model, tmp_path)
    model = tiny_lora_model(cfg)
    assert mfu.MfuMeter(model, 128, choose_precision(cfg)).fields(1000.0) == {}
    f = mfu.flops_per_token(model, 128)
    assert 0 < f.n_trainable < f.n_matmul
    assert f.lora < f.six_n


# --- checkpoint staging ----------------------------------------------------------------------
def _state_tensors(device) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {"a": torch.randn(4, 8, generator=g).to(device), "b": torch.randn(3, generator=g).to(device).bfloat16(),
            "step": torch.tensor(7.0).to(device), "t": torch.randn(8, 4, generator=g).to(device).t()}


def test_cpu_snapshot_bytes_are_unchanged():
    from safetensors.torch import save

    from relaytune.checkpoint.state import deferred_safetensors

    tensors = _state_tensors("cpu")
    expected = save({k: v.contiguous() for k, v in tensors.items()}, metadata={"format": "pt"})
    deferred = deferred_safetensors(tensors, {"format": "pt"})
    for v in tensors.values():
        v.add_(1)  # training goes on: the snapshot keeps the values it was taken with
    assert deferred() == expected


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned staging is the CUDA path")
def test_cuda_snapshot_stages_in_reused_pinned_buffers():
    from safetensors.torch import save

    from relaytune.checkpoint.state import _PinnedSnapshot, deferred_safetensors

    tensors = _state_tensors("cuda")
    expected = save({k: v.cpu().contiguous() for k, v in tensors.items()}, metadata={"format": "pt"})
    before = torch.cuda.memory_allocated()
    deferred = deferred_safetensors(tensors, {"format": "pt"})
    assert torch.cuda.memory_allocated() == before, "no GPU clone"
    for v in tensors.values():
        v.add_(1)  # queued after the copies on the training stream
    assert deferred() == expected and deferred() == expected
    pooled = {id(b) for bufs in _PinnedSnapshot._free.values() for b in bufs}
    again = deferred_safetensors(_state_tensors("cuda"), {"format": "pt"})
    assert {id(b) for b in again.owned} <= pooled, "the buffers are reused"
    assert all(b.is_pinned() for b in again.owned)


def test_a_run_puts_back_the_compiler_settings_it_found(tiny_model, tmp_path, one_thread, monkeypatch):
    """Dynamo's settings are the process's: during a compiled run errors fall back to eager, recompiles
    are bounded at RECOMPILE_LIMIT and a compiled checkpoint may skip replaying side effects; after it,
    a notebook's own torch.compile finds torch's settings again. Compiles go through a backend that
    returns the traced graph (Inductor's compile_fx, replaced), so no C++ compiler runs."""
    import torch._dynamo.config as dynamo
    import torch._inductor.compile_fx as inductor
    from support.run_helpers import chat_rows, make_config, write_jsonl

    from relaytune import train

    seen = []

    def traced_graph(graph_module, example_inputs, **kwargs):
        seen.append((dynamo.suppress_errors, dynamo.recompile_limit,
                     dynamo.skip_fwd_side_effects_in_bwd_under_checkpoint))
        return graph_module.forward

    # A model loaded without a Trainer (earlier tests) leaves its settings until the next run: as at a
    # process's start, torch's defaults, set here.
    # (Not monkeypatch: its undo deletes a config attribute, which hides it from the later tests.)
    speedups.restore_compiler_settings()
    defaults = dynamo.patch(suppress_errors=False, recompile_limit=8,
                            skip_fwd_side_effects_in_bwd_under_checkpoint=False)
    defaults.__enter__()
    found = (False, 8, False)
    monkeypatch.setattr(inductor, "compile_fx", traced_graph)
    data = write_jsonl(tmp_path / "data.jsonl", chat_rows(40))
    cfg = make_config(tmp_path, tiny_model, data, torch_compile=True, gradient_checkpointing=True,
                      compile_checkpoint=True, max_steps=2)
    torch._dynamo.reset()
    try:
        train(str(cfg))
        after = (dynamo.suppress_errors, dynamo.recompile_limit, dynamo.skip_fwd_side_effects_in_bwd_under_checkpoint)
    finally:
        torch._dynamo.reset()
        defaults.__exit__(None, None, None)
    assert seen and set(seen) == {(True, speedups.RECOMPILE_LIMIT, True)}
    assert after == found
