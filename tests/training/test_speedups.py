"""GPU speed-ups (training/speedups.py), checked on the CPU where their paths run there.

Numerics are the contract: regional compilation and document-masked FlexAttention give the
eager-SDPA loss and gradient norm within a stated tolerance, and on the CPU both default to off
(so CPU runs, and their exact resumes, are untouched).

Measured here (tiny llama, fp32, CPU, torch 2.13): compiled vs eager over 3 AdamW steps with
gradient checkpointing, loss within 2e-7 relative and grad norm within 3e-6; flex vs SDPA on a
packed batch, loss within 1e-6. Tolerances: COMPILE_RTOL, FLEX_RTOL.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from relaytune.config.schema import TrainConfig
from relaytune.data.batches import collate, document_ids
from relaytune.data.packing import check_isolation, concat
from relaytune.data.rows import TokenRow
from relaytune.layers import decoder_layers, is_compiled
from relaytune.model import choose_precision, load_model
from relaytune.training import document_mask, mfu, speedups, warmup
from relaytune.training.loss import causal_lm_loss

COMPILE_RTOL = 1e-4  # measured <= 3e-6 (grad norm), 2e-7 (loss)
FLEX_RTOL = 1e-5  # measured ~1e-7


def _cfg(tiny_model, tmp_path, **kw) -> TrainConfig:
    return TrainConfig(model=str(tiny_model), dataset="unused.jsonl", output_dir=str(tmp_path / "run"),
                       lora_dropout=0.0, **kw)


def _model(cfg: TrainConfig):
    torch.manual_seed(0)
    model = load_model(cfg, choose_precision(cfg))
    with torch.no_grad():  # a nonzero adapter, so that it matters
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode()))))
    return model


def _packed_rows(vocab: int, segments) -> list[TokenRow]:
    rng = np.random.default_rng(3)
    rows = []
    for lengths in segments:
        ids, labels, segs = concat([(rng.integers(10, vocab, n), rng.integers(10, vocab, n)) for n in lengths])
        rows.append(TokenRow(ids, labels, segs))
    return rows


def _packed_batch(vocab: int, segments=((7, 12, 5), (20, 4), (9,))) -> dict:
    return collate(_packed_rows(vocab, segments), pad_id=0)


def test_defaults_leave_a_cpu_model_untouched(tiny_model, tmp_path, one_thread):
    model = _model(_cfg(tiny_model, tmp_path, packing=True, gradient_checkpointing=True))
    assert model.relaytune_speedups == []
    assert not any(is_compiled(layer) for layer in decoder_layers(model))
    assert model.get_base_model().config._attn_implementation == "sdpa"
    assert speedups.compile_decision("auto", torch.device("cpu")) == (False, None)
    assert speedups.flex_decision("auto", True, torch.device("cpu")) == (False, None)
    on, why = speedups.flex_decision("flex", True, torch.device("cpu"))
    assert not on and "no backward on the CPU" in why
    assert speedups.flex_decision("flex", False, torch.device("cpu"))[0] is False


def test_auto_attention_takes_flex_only_where_it_was_measured(monkeypatch):
    """auto: flex on GPUs with Hopper's shared memory per block, SDPA on smaller ones unless asked."""
    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(speedups, "_has_triton", lambda: True)
    monkeypatch.setattr(speedups, "_capability", lambda device: (9, 0))
    monkeypatch.setattr(speedups, "_shared_memory_per_block", lambda device: 232448)  # H100 / H200
    assert speedups.flex_decision("auto", True, gpu) == (True, None)
    assert speedups.flex_decision("auto", False, gpu) == (False, None), "padded batches keep SDPA"
    assert speedups.flex_decision("sdpa", True, gpu) == (False, None)
    monkeypatch.setattr(speedups, "_capability", lambda device: (8, 6))
    monkeypatch.setattr(speedups, "_shared_memory_per_block", lambda device: 101376)  # sm_86 / sm_89
    assert speedups.flex_decision("auto", True, gpu) == (False, None)
    assert speedups.flex_decision("flex", True, gpu) == (True, None)
    monkeypatch.setattr(speedups, "_capability", lambda device: (7, 0))
    on, why = speedups.flex_decision("flex", True, gpu)
    assert not on and why == "compute capability 7.0 is below 7.5"


def test_flex_blockers():
    from transformers import AutoConfig

    assert speedups.flex_blocker(AutoConfig.for_model("llama")) is None
    assert speedups.flex_blocker(AutoConfig.for_model("qwen2")) is None  # sliding window off by default
    assert "dropout" in speedups.flex_blocker(AutoConfig.for_model("llama", attention_dropout=0.1))
    assert "sliding" in speedups.flex_blocker(AutoConfig.for_model("mistral", sliding_window=4096))


def test_a_failing_speedup_never_stops_the_run(tiny_model, tmp_path, monkeypatch, one_thread):
    def boom(*a, **k):
        raise RuntimeError("no compiler today")

    monkeypatch.setattr(torch, "compile", boom)
    model = _model(_cfg(tiny_model, tmp_path, torch_compile=True))
    assert model.relaytune_speedups == []
    assert not any(is_compiled(layer) for layer in decoder_layers(model))


def test_document_ids_follow_position_restarts():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1], [0, 1, 2, 3, 4, 5, 6, 7]])
    assert document_ids(pos).tolist() == [[1, 1, 1, 2, 2, 3, 4, 4], [1] * 8]


def test_flex_equals_sdpa_on_a_packed_batch_and_keeps_samples_apart(tiny_model, tmp_path, one_thread):
    """One BlockMask per batch, built once, handed to every layer; loss equal to SDPA's packed mask."""
    from torch.nn.attention.flex_attention import create_block_mask

    model = _model(_cfg(tiny_model, tmp_path, packing=True))
    batch = _packed_batch(model.config.vocab_size)
    assert "attention_mask" not in batch
    n = int((batch["labels"][:, 1:] != -100).sum())
    lm = model.get_base_model()
    targets = torch.cat([batch["labels"][:, 1:], torch.full_like(batch["labels"][:, :1], -100)], 1).reshape(-1)
    with torch.no_grad():
        sdpa = causal_lm_loss(model, batch, n).item()
        speedups.enable_flex(model)
        # The test has teeth: a causal mask that ignores documents leaks, and the loss moves. (First:
        # eager CPU flex goes through dynamo's cache keyed on the mask function.)
        b, s = batch["input_ids"].shape
        leaky = create_block_mask(lambda b_, h, q, kv: q >= kv, b, None, s, s, device="cpu")
        hidden = lm.get_decoder()(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                                  attention_mask=leaky).last_hidden_state
        logits = lm.get_output_embeddings()(hidden)
        leaked = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets,
                                                   reduction="sum").item() / n
        assert abs(leaked - sdpa) > 10 * FLEX_RTOL * abs(sdpa)  # measured ~5e-4 relative
        masks = []
        real = document_mask.document_block_mask
        document_mask.document_block_mask = lambda pos: masks.append(real(pos)) or masks[-1]
        try:
            flex = causal_lm_loss(model, batch, n).item()
        finally:
            document_mask.document_block_mask = real
        assert len(masks) == 1, "one mask per batch, not per layer"
        assert abs(flex - sdpa) <= FLEX_RTOL * abs(sdpa), (flex, sdpa)
        assert check_isolation(model) is None
        # Another batch of the same shape, other documents: the mask follows (no stale graph).
        other = _packed_batch(model.config.vocab_size, ((12, 7, 5), (4, 20), (3, 6)))
        flex2 = causal_lm_loss(model, other, n).item()
        model.get_base_model().set_attn_implementation("sdpa")
        sdpa2 = causal_lm_loss(model, other, n).item()
        assert abs(flex2 - sdpa2) <= FLEX_RTOL * abs(sdpa2), (flex2, sdpa2)


def test_the_isolation_check_keeps_back_torchs_unfused_flex_warning_and_leaves_it_for_later(
        tiny_model, tmp_path, one_thread):
    """The check's tiny eager forward runs flex unfused on purpose: torch's once-per-process warning
    would read as if training did (seen on an H200 before every packed run), so the check keeps it
    back, and a later unfused call still gets it."""
    import warnings

    from torch.nn.attention import flex_attention as fa

    model = _model(_cfg(tiny_model, tmp_path, packing=True))
    speedups.enable_flex(model)
    fa._WARNINGS_SHOWN.discard("flex_attention_performance")  # as in a fresh process
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert check_isolation(model) is None
        assert [str(w.message) for w in seen if "without torch.compile" in str(w.message)] == []
        q = torch.randn(1, 1, 16, 8)
        with torch.no_grad():
            fa.flex_attention(q, q, q)
    assert [w for w in seen if "flex_attention called without torch.compile" in str(w.message)]


def test_flex_leaves_padded_batches_on_sdpa(tiny_model, tmp_path, one_thread):
    model = _model(_cfg(tiny_model, tmp_path))
    rows = [TokenRow(np.arange(10, 30), np.arange(10, 30)), TokenRow(np.arange(40, 52), np.arange(40, 52))]
    batch = collate(rows, pad_id=0)
    assert "attention_mask" in batch
    with torch.no_grad():
        before = causal_lm_loss(model, batch, 30)
        speedups.enable_flex(model)
        after = causal_lm_loss(model, batch, 30)
    assert torch.equal(before, after), "the same SDPA call, bit for bit"


@pytest.mark.slow  # inductor's C++ compile: ~25 s on a 2-core machine
def test_compiled_layers_match_eager(tiny_model, tmp_path, one_thread):
    """torch_compile: true on the CPU: 3 AdamW steps with gradient checkpointing, packed rows."""
    def trajectory(setting):
        model = _model(_cfg(tiny_model, tmp_path, gradient_checkpointing=True, torch_compile=setting))
        compiled = [is_compiled(layer) for layer in decoder_layers(model)]
        model.train()  # as the trainer's loop does (dropout is 0)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-2)
        batch = _packed_batch(model.config.vocab_size)
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
    cfg = _cfg(tiny_model, tmp_path, packing=True, gradient_checkpointing=True, torch_compile=True,
               max_seq_length=64)
    model = _model(cfg)
    assert speedups.batch_width(model, cfg) == 64
    assert speedups.batch_width(model, cfg.model_copy(update={"packing": False})) is None
    eager_cfg = cfg.model_copy(update={"torch_compile": False})
    eager = _model(eager_cfg)
    assert speedups.batch_width(eager, eager_cfg) is None

    rows = _packed_rows(eager.config.vocab_size, ((7, 12, 5), (20, 4)))
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

    cfg = _cfg(tiny_model, tmp_path, packing=True, gradient_checkpointing=True, torch_compile=True,
               max_seq_length=64)
    model = _model(cfg)
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    parts = StepParts(model, optimizer, None, choose_precision(cfg), 0, 1.0, width=speedups.batch_width(model, cfg))
    vocab = model.config.vocab_size
    optimizer_step(parts, _packed_rows(vocab, ((7, 12, 5), (20, 4))), 2, 0)
    before = warmup.compile_stats()
    result = optimizer_step(parts, _packed_rows(vocab, ((30, 9), (50,))), 2, 1)
    assert result.updated
    assert warmup.compile_stats() == before, "a second length compiled the layer again"


def test_a_warm_up_timer_left_before_its_first_step_stays_silent(tiny_model, tmp_path, one_thread, capsys):
    """A run stopped before its first optimizer step (in a notebook, say) leaves its timer's hook in the
    process; the next run's steps neither print its figure nor break the optimizer's hook loop."""
    def model_and_optimizer():
        model = _model(_cfg(tiny_model, tmp_path))
        model.train()
        timer = warmup.WarmUpTimer.install(model)
        return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3), timer

    batch = _packed_batch(64)
    left, _, left_timer = model_and_optimizer()
    causal_lm_loss(left, batch, 10)  # its forward starts its clock; its step never comes
    model, optimizer, timer = model_and_optimizer()
    for _ in range(2):
        causal_lm_loss(model, batch, 10).backward()
        optimizer.step()
    assert timer.seconds is not None and left_timer.seconds is None
    assert capsys.readouterr().err.count("torch.compile warm-up") == 1
    assert timer.handles == [], "its hooks went at the next forward, after the step"


def test_isolation_check_compiles_nothing(tiny_model, tmp_path, one_thread):
    """Its tiny inference rows once made Inductor fail on a GPU and leave flex unfused for the run."""
    model = _model(_cfg(tiny_model, tmp_path, packing=True, gradient_checkpointing=True, torch_compile=True))
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
    cfg = _cfg(tiny_model, tmp_path)
    model = _model(cfg)
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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled layers + FlexAttention training is the GPU path")
@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 1e-3), (torch.bfloat16, 2e-2)])
def test_cuda_compiled_flex_matches_eager_sdpa(tiny_model, tmp_path, dtype, rtol):
    """On the GPU: eager SDPA vs compiled layers + document-masked FlexAttention, 3 AdamW steps."""
    def trajectory(**settings):
        cfg = _cfg(tiny_model, tmp_path, packing=True, gradient_checkpointing=True,
                   bf16=dtype == torch.bfloat16, **settings)
        model = _model(cfg)
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-2)
        batch = {k: v.cuda() for k, v in _packed_batch(model.config.vocab_size).items()}
        n = int((batch["labels"][:, 1:] != -100).sum())
        out = []
        for _ in range(3):
            with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
                loss = causal_lm_loss(model, batch, n)
            loss.backward()
            out.append((loss.item(), torch.nn.utils.clip_grad_norm_(params, 1.0).item()))
            opt.step()
            opt.zero_grad(set_to_none=True)
        return model.relaytune_speedups, out

    applied, eager = trajectory(torch_compile=False, attention="sdpa")
    assert applied == []
    applied, fast = trajectory(torch_compile=True, attention="flex")
    assert len(applied) == 2, applied
    for (l1, g1), (l2, g2) in zip(eager, fast):
        assert l2 == pytest.approx(l1, rel=rtol) and g2 == pytest.approx(g1, rel=rtol)
