"""Document-masked attention for packed batches (training/attention.py): FlexAttention and
FlashAttention's varlen kernel, checked on the CPU where their paths run there.

Numerics are the contract: either kernel gives SDPA's loss (with transformers' mask of the documents)
within a stated tolerance, and packed samples never see each other. FlexAttention runs forward on
the CPU; the varlen kernel is CUDA's, so the CPU tests put a reference in its place
(tests/support/varlen_reference.py: SDPA per document, a custom op like torch's) and check what
relaytune hands it, what comes back, and that compiled layers take every count of documents in one
graph. The kernel itself runs in the CUDA test at the end.

Measured here (tiny llama, fp32, CPU, torch 2.13): flex vs SDPA, loss within 1e-6 relative;
varlen (reference) vs SDPA, loss equal to the last bit and gradients within 9e-7 relative.
Tolerances: FLEX_RTOL, VARLEN_RTOL.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support import varlen_reference
from support.packed_cases import DIFFERENT_BATCHES, packed_batch, target_count, tiny_config, tiny_lora_model
from support.run_helpers import make_config
from transformers import masking_utils

from relaytune.config.loader import load_config
from relaytune.data.batches import collate, document_ids
from relaytune.data.packing import check_isolation
from relaytune.data.rows import TokenRow
from relaytune.errors import UserError
from relaytune.layers import decoder_layers, is_compiled
from relaytune.training import attention, document_mask, hardware, warmup
from relaytune.training.loss import causal_lm_loss

# A bf16 path may sit this many times eager bf16's distance from fp32, plus these floors. On an H100 every
# correct path sat within 1.01x in gradients and under 4.5e-5 in loss, while the flex decoding kernel
# (attention.FLEX_KERNEL_OPTIONS) was 4.4x-5.8x and up to 4.4e-4 off (bench/results/flex-decoding-h100.md;
# bench/bf16_gradient_error.py prints the distances).
BF16_FACTOR = 2.0
BF16_FLOOR_LOSS = 1e-4
BF16_FLOOR_GRAD = 1e-2

FLEX_RTOL = 1e-5  # measured ~1e-7
VARLEN_RTOL = 1e-5  # measured: loss equal, gradients <= 9e-7
GPU = torch.device("cuda", 0)


# --- decisions -------------------------------------------------------------------------------------
def test_the_cpu_keeps_sdpa_and_says_why_when_asked():
    cpu = torch.device("cpu")
    assert attention.flex_decision("auto", True, cpu) == (False, None)
    on, why = attention.flex_decision("flex", True, cpu)
    assert not on and "no backward on the CPU" in why
    assert attention.flex_decision("flex", False, cpu)[0] is False
    assert attention.varlen_decision(True, cpu, None) == (
        False, "FlashAttention's varlen kernel runs on CUDA GPUs only; using SDPA")


def test_auto_attention_takes_flex_only_where_it_was_measured(monkeypatch):
    """auto: flex on GPUs with Hopper's shared memory per block, SDPA on smaller ones unless asked."""
    monkeypatch.setattr(hardware, "has_triton", lambda: True)
    monkeypatch.setattr(hardware, "capability", lambda device: (9, 0))
    monkeypatch.setattr(hardware, "shared_memory_per_block", lambda device: 232448)  # H100 / H200
    assert attention.flex_decision("auto", True, GPU) == (True, None)
    assert attention.flex_decision("auto", False, GPU) == (False, None), "padded batches keep SDPA"
    assert attention.flex_decision("sdpa", True, GPU) == (False, None)
    monkeypatch.setattr(hardware, "capability", lambda device: (8, 6))
    monkeypatch.setattr(hardware, "shared_memory_per_block", lambda device: 101376)  # sm_86 / sm_89
    assert attention.flex_decision("auto", True, GPU) == (False, None)
    assert attention.flex_decision("flex", True, GPU) == (True, None)
    monkeypatch.setattr(hardware, "capability", lambda device: (7, 0))
    on, why = attention.flex_decision("flex", True, GPU)
    assert not on and why == "compute capability 7.0 is below 7.5"


def test_varlen_runs_where_flash_attention_does(monkeypatch):
    monkeypatch.setattr(hardware, "capability", lambda device: (8, 0))  # A100
    assert attention.varlen_decision(True, GPU, torch.bfloat16) == (True, None)
    assert attention.varlen_decision(True, GPU, torch.float16) == (True, None)
    assert attention.varlen_decision(False, GPU, torch.bfloat16) == (
        False, "only packed batches use it; padded batches keep SDPA")
    assert attention.varlen_decision(True, GPU, None) == (
        False, "FlashAttention computes in bf16 or fp16, and this run computes in float32; using SDPA")
    monkeypatch.setattr(hardware, "capability", lambda device: (7, 5))  # T4
    assert attention.varlen_decision(True, GPU, torch.float16) == (
        False, "compute capability 7.5 is below 8.0, FlashAttention's floor; using SDPA")
    monkeypatch.setattr(hardware, "capability", lambda device: (9, 0))
    monkeypatch.setattr(attention, "_varlen_kernel", lambda: None)  # a torch without it
    on, why = attention.varlen_decision(True, GPU, torch.bfloat16)
    assert not on
    assert why == f"torch {torch.__version__} has no causal torch.nn.attention.varlen.varlen_attn; using SDPA"


def test_model_blockers():
    from transformers import AutoConfig

    assert attention.model_blocker(AutoConfig.for_model("llama")) is None
    assert attention.model_blocker(AutoConfig.for_model("qwen2")) is None  # sliding window off by default
    assert "dropout" in attention.model_blocker(AutoConfig.for_model("llama", attention_dropout=0.1))
    assert "sliding" in attention.model_blocker(AutoConfig.for_model("mistral", sliding_window=4096))
    assert attention.model_blocker(AutoConfig.for_model("llama", head_dim=128), "varlen") is None
    wide = AutoConfig.for_model("llama", hidden_size=2048, num_attention_heads=4)  # heads 512 wide
    assert attention.model_blocker(wide, "flex") is None
    assert attention.model_blocker(wide, "varlen") == (
        "its heads are 512 wide, and FlashAttention takes at most 256, in multiples of 8")


def test_cuda_graphs_true_beside_varlen_is_a_config_error(tiny_model, chat_data, tmp_path):
    cfg = make_config(tmp_path, tiny_model, chat_data, cuda_graphs=True, packing=True, attention="varlen",
                      gradient_checkpointing=True)
    with pytest.raises(UserError) as e:
        load_config(str(cfg))
    assert e.value.exit_code == 2 and str(cfg) in str(e.value)
    assert ("cuda_graphs: true replays the compiled, checkpointed layers on fixed-width packed batches, so it "
            "needs attention: auto, flex or sdpa (varlen's document starts change shape with every batch); "
            "set those, or cuda_graphs: auto") in str(e.value)
    assert load_config(str(make_config(tmp_path / "ok", tiny_model, chat_data, packing=True,
                                       attention="varlen"))).attention == "varlen"


def test_asking_for_varlen_on_the_cpu_trains_with_sdpa_and_says_so(tiny_model, tmp_path, one_thread, capsys):
    model = tiny_lora_model(tiny_config(tiny_model, tmp_path, packing=True, attention="varlen"))
    assert model.relaytune_speedups == []
    assert model.get_base_model().config._attn_implementation == "sdpa"
    assert ("attention: varlen off (FlashAttention's varlen kernel runs on CUDA GPUs only; using SDPA)"
            in capsys.readouterr().err)


def test_cuda_graphs_auto_gives_way_to_varlen(tiny_model, tmp_path, one_thread, monkeypatch, capsys):
    """Where auto would replay CUDA graphs (the host bounds the step), varlen keeps them off: the
    document starts change shape with every batch, and a graph replays one shape."""
    from relaytune.training import speedups

    varlen_reference.install(monkeypatch)
    monkeypatch.setattr(attention, "varlen_decision", lambda *a: (True, None))  # the CPU, as a GPU would
    monkeypatch.setattr(speedups, "graphs_decision", lambda *a, **k: (True, None))  # as auto on a fast GPU
    cfg = tiny_config(tiny_model, tmp_path, packing=True, gradient_checkpointing=True, torch_compile=True,
                      attention="varlen")
    model = tiny_lora_model(cfg)
    assert model.relaytune_speedups == ["FlashAttention's varlen kernel over each packed batch's documents",
                                        "torch.compile on each of 2 decoder layers"]
    assert ("cuda_graphs: off (varlen attention's document starts change shape with every batch; graphs "
            "replay one)") in capsys.readouterr().err


# --- a batch's documents ---------------------------------------------------------------------------
def test_document_ids_follow_position_restarts():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1], [0, 1, 2, 3, 4, 5, 6, 7]])
    assert document_ids(pos).tolist() == [[1, 1, 1, 2, 2, 3, 4, 4], [1] * 8]


def test_document_starts_are_the_restarts_and_every_row_laid_end_to_end():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1], [0, 1, 2, 3, 4, 5, 6, 7], [5, 6, 0, 1, 2, 3, 0, 1]])
    starts = attention.document_starts(pos)
    assert starts.dtype == torch.int32
    # The third row's first positions do not restart at 0 and still begin a document: rows never join.
    assert starts.tolist() == [0, 3, 5, 6, 8, 16, 18, 22, 24]
    batch = packed_batch(200, width=32)  # collate's padding after the last sample is a document too
    assert attention.document_starts(batch["position_ids"]).tolist() == [0, 7, 19, 24, 32, 52, 56, 64, 73, 96]


# --- FlexAttention ---------------------------------------------------------------------------------
def test_flex_equals_sdpa_on_a_packed_batch_and_keeps_samples_apart(tiny_model, tmp_path, one_thread):
    """One BlockMask per batch, built once, handed to every layer; loss equal to SDPA's packed mask."""
    from torch.nn.attention.flex_attention import create_block_mask

    model = tiny_lora_model(tiny_config(tiny_model, tmp_path, packing=True))
    batch = packed_batch(model.config.vocab_size)
    assert "attention_mask" not in batch
    n = target_count(batch)
    lm = model.get_base_model()
    targets = torch.cat([batch["labels"][:, 1:], torch.full_like(batch["labels"][:, :1], -100)], 1).reshape(-1)
    with torch.no_grad():
        sdpa = causal_lm_loss(model, batch, n).item()
        attention.enable_flex(model)
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
        other = packed_batch(model.config.vocab_size, ((12, 7, 5), (4, 20), (3, 6)))
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

    model = tiny_lora_model(tiny_config(tiny_model, tmp_path, packing=True))
    attention.enable_flex(model)
    fa._WARNINGS_SHOWN.discard("flex_attention_performance")  # as in a fresh process
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert check_isolation(model) is None
        assert [str(w.message) for w in seen if "without torch.compile" in str(w.message)] == []
        q = torch.randn(1, 1, 16, 8)
        with torch.no_grad():
            fa.flex_attention(q, q, q)
    assert [w for w in seen if "flex_attention called without torch.compile" in str(w.message)]


@pytest.mark.parametrize("kind", ["flex", "varlen"])
def test_padded_batches_keep_sdpa_bit_for_bit(tiny_model, tmp_path, one_thread, monkeypatch, kind):
    model = tiny_lora_model(tiny_config(tiny_model, tmp_path))
    rows = [TokenRow(np.arange(10, 30), np.arange(10, 30)), TokenRow(np.arange(40, 52), np.arange(40, 52))]
    batch = collate(rows, pad_id=0)
    assert "attention_mask" in batch
    with torch.no_grad():
        before = causal_lm_loss(model, batch, 30)
        varlen_reference.install(monkeypatch)
        attention.enable_flex(model) if kind == "flex" else attention.enable_varlen(model)
        after = causal_lm_loss(model, batch, 30)
    assert torch.equal(before, after), "the same SDPA call, bit for bit"
    assert varlen_reference.CALLS == []


# --- FlashAttention's varlen kernel (the reference in its place) -----------------------------------
def _loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    loss = causal_lm_loss(model, batch, target_count(batch))
    loss.backward()
    return loss.item(), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def _assert_close(got, want):
    (loss, grads), (want_loss, want_grads) = got, want
    assert loss == pytest.approx(want_loss, rel=VARLEN_RTOL)
    assert grads.keys() == want_grads.keys()
    for k, g in grads.items():
        scale = want_grads[k].abs().max().clamp_min(1e-12)
        assert float((g - want_grads[k]).abs().max() / scale) <= VARLEN_RTOL, k


@pytest.mark.parametrize("api", ["window_size and enable_gqa", "is_causal, no enable_gqa, no scale"])
def test_varlen_equals_sdpa_on_a_packed_batch_and_keeps_samples_apart(tiny_model, tmp_path, one_thread,
                                                                      monkeypatch, api):
    """The document starts are found once per batch and reach every layer; loss and gradients equal
    SDPA's with transformers' mask of the documents, under either API torch's varlen_attn has had
    (the older one without GQA gets the key heads repeated)."""
    model = tiny_lora_model(tiny_config(tiny_model, tmp_path, packing=True))
    batch = packed_batch(model.config.vocab_size)
    sdpa = _loss_and_grads(model, batch)
    options = {} if api.startswith("window_size") else {"gqa": False, "causal": {"is_causal": True}, "scale": False}
    varlen_reference.install(monkeypatch, **options)
    attention.enable_varlen(model)
    found, searched = [], []
    with monkeypatch.context() as m:
        m.setattr(attention, "document_starts",
                  lambda pos, real=attention.document_starts: found.append(real(pos)) or found[-1])
        m.setattr(masking_utils, "find_packed_sequence_indices", lambda pos: searched.append(pos))
        _assert_close(_loss_and_grads(model, batch), sdpa)
    assert len(found) == 1, "one set of starts per batch, not per layer"
    assert searched == [], "transformers built no mask of its own (its search for documents waits on the GPU)"
    heads = model.config.num_key_value_heads if api.startswith("window_size") else model.config.num_attention_heads
    assert varlen_reference.CALLS == [{"starts": [0, 7, 19, 24, 44, 48, 57, 72], "max": 24,
                                       "gqa": api.startswith("window_size"), "heads": heads}] * 2
    # The test has teeth: a kernel told that every row is one document leaks, and the loss moves.
    with monkeypatch.context() as m:
        m.setattr(attention, "document_starts", lambda pos: torch.arange(0, pos.numel() + 1, pos.shape[1],
                                                                          dtype=torch.int32))
        leaked = _loss_and_grads(model, batch)[0]
    assert abs(leaked - sdpa[0]) > 10 * VARLEN_RTOL * abs(sdpa[0])
    assert check_isolation(model) is None
    other = packed_batch(model.config.vocab_size, ((12, 7, 5), (4, 20), (3, 6)))
    varlen = _loss_and_grads(model, other)
    model.get_base_model().set_attn_implementation("sdpa")
    _assert_close(varlen, _loss_and_grads(model, other))


def test_float32_tensors_reach_the_kernel_in_the_runs_compute_dtype(monkeypatch):
    """FlashAttention takes bf16 or fp16: under autocast, float32 query, key and value (an fp32 layer
    norm's output, say) go in autocast's dtype, and the output comes back in theirs."""
    varlen_reference.install(monkeypatch)
    q, k, v = (torch.randn(2, heads, 8, 16) for heads in (4, 2, 2))
    starts = attention.document_starts(torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 6, 7]]))
    mask = starts.view(1, 1, 1, -1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = attention.varlen_or_sdpa_attention(None, q, k, v, mask, scaling=0.25)
    assert varlen_reference.DTYPES == [torch.bfloat16] and out.dtype == torch.float32
    plain, _ = attention.varlen_or_sdpa_attention(None, q, k, v, mask, scaling=0.25)
    assert varlen_reference.DTYPES[-1] == torch.float32 and out.shape == plain.shape == (2, 8, 4, 16)
    assert torch.allclose(out, plain, atol=3e-2), "the same attention, rounded to bf16"


@pytest.mark.slow  # one inductor C++ compile each: ~15 s on a 2-core machine
@pytest.mark.parametrize("checkpoint_inside", [False, True], ids=["checkpoint outside", "checkpoint compiled inside"])
def test_compiled_layers_take_every_count_of_documents_in_one_graph(tiny_model, tmp_path, one_thread,
                                                                    monkeypatch, checkpoint_inside):
    """The count of documents changes every batch; the compiled layers neither recompile nor break
    their graph for it, and give the eager loss and gradients, with the checkpoint outside the
    compiled layer or compiled with it (as on Llama-3-8B on a GPU)."""
    varlen_reference.install(monkeypatch)
    monkeypatch.setattr(attention, "varlen_decision", lambda *a: (True, None))  # the CPU, as a GPU would
    cfg = tiny_config(tiny_model, tmp_path, packing=True, gradient_checkpointing=True, torch_compile=True,
                      attention="varlen", max_seq_length=32, compile_checkpoint=checkpoint_inside)
    torch._dynamo.reset()
    model = tiny_lora_model(cfg)
    assert model.relaytune_speedups[0] == "FlashAttention's varlen kernel over each packed batch's documents"
    assert model.relaytune_speedups[1].endswith(", checkpoint compiled inside") == checkpoint_inside
    assert all(is_compiled(layer) for layer in decoder_layers(model))
    model.train()
    eager = tiny_lora_model(cfg.model_copy(update={"torch_compile": False}))
    eager.train()
    vocab = model.config.vocab_size
    batches = [packed_batch(vocab, segments, width=32) for segments in
               (((7, 12, 5), (20, 4), (9,)), ((3, 3, 3, 3), (30,), (2,) * 6), ((16, 16), (31,), (10, 10, 10)))]
    counts, before, breaks = set(), warmup.compile_stats(), warmup.graph_breaks()  # dynamo counts per process
    for i, batch in enumerate(batches):
        _assert_close(_loss_and_grads(model, batch), _loss_and_grads(eager, batch))
        counts.add(len(attention.document_starts(batch["position_ids"])))
        if i == 0:
            after_first = warmup.compile_stats()
    assert len(counts) == 3
    assert after_first["graphs"] == before["graphs"] + 1 and warmup.compile_stats() == after_first
    assert warmup.new_graph_breaks(breaks, warmup.graph_breaks()) == {}


def _cuda_losses_and_gradients(tiny_model, tmp_path, dtype, **settings) -> tuple[list[str], list]:
    """(speed-ups applied, [(loss, the adapters' gradients as one fp32 vector)] per batch of DIFFERENT_BATCHES),
    all at the same weights: no optimizer step between the batches, so that rounding does not compound
    (in a 5-step AdamW trajectory at lr 1e-2 in bf16, compiled flex without CUDA graphs already drifted
    9% from eager in gradient norm by the fifth step on an H200, with every loss within 0.1%)."""
    cfg = tiny_config(tiny_model, tmp_path, packing=True, gradient_checkpointing=True, max_seq_length=32,
                      bf16=dtype == torch.bfloat16, **settings)
    torch._dynamo.reset()
    model = tiny_lora_model(cfg)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    out = []
    for segments in DIFFERENT_BATCHES:
        batch = {k: v.cuda() for k, v in packed_batch(model.config.vocab_size, segments, width=32).items()}
        with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
            loss = causal_lm_loss(model, batch, target_count(batch))
        loss.backward()
        out.append((loss.item(), torch.cat([p.grad.float().flatten() for p in params])))
        model.zero_grad(set_to_none=True)
    return model.relaytune_speedups, out


def _assert_same_per_batch(got, want, loss_rtol: float, grad_rtol: float) -> None:
    for i, ((l1, g1), (l2, g2)) in enumerate(zip(want, got)):
        assert l2 == pytest.approx(l1, rel=loss_rtol), f"batch {i}"
        error = float(torch.linalg.vector_norm(g2 - g1) / torch.linalg.vector_norm(g1))
        assert error <= grad_rtol, f"batch {i}: gradients {error:.4f} off (relative)"


def _errors(got, want) -> list[tuple[float, float]]:
    """(loss, gradient) relative error per batch (also bench/bf16_gradient_error.py's figures)."""
    return [(abs(l2 - l1) / abs(l1), float(torch.linalg.vector_norm(g2 - g1) / torch.linalg.vector_norm(g1)))
            for (l1, g1), (l2, g2) in zip(want, got)]


def _assert_within_bf16_rounding(got, bf16, fp32) -> None:
    """Each batch's loss and gradients are no further from fp32 than BF16_FACTOR times eager bf16's own
    rounding (plus a floor): two bf16 paths differ from each other by about their rounding, while a
    wrong document mask (another batch's documents) moves the gradients by far more."""
    for i, ((loss, grad), (loss_bf16, grad_bf16)) in enumerate(zip(_errors(got, fp32), _errors(bf16, fp32))):
        assert loss <= BF16_FACTOR * loss_bf16 + BF16_FLOOR_LOSS, (
            f"batch {i}: loss {loss:.2e} from fp32 ({loss_bf16:.2e})")
        assert grad <= BF16_FACTOR * grad_bf16 + BF16_FLOOR_GRAD, (
            f"batch {i}: gradients {grad:.4f} from fp32 (eager bf16 {grad_bf16:.4f})")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled layers + document-masked kernels train on GPUs")
@pytest.mark.parametrize("graphs", [False, True], ids=["graphs off", "CUDA graphs"])
def test_cuda_compiled_flex_matches_eager_sdpa_in_fp32(tiny_model, tmp_path, graphs):
    """On the GPU: eager SDPA vs compiled layers + FlexAttention, loss and gradients of 5 different packed
    batches of width 32, in fp32 (FlashAttention's varlen kernel has no fp32). With CUDA graphs the
    first forward runs without gradients, where Inductor would take its flex decoding kernel for so few
    queries: that kernel was 5% off in gradients (attention.FLEX_KERNEL_OPTIONS keeps it out)."""
    applied, eager = _cuda_losses_and_gradients(tiny_model, tmp_path, torch.float32, torch_compile=False,
                                                attention="sdpa")
    assert applied == []
    applied, fast = _cuda_losses_and_gradients(tiny_model, tmp_path, torch.float32, torch_compile=True,
                                               attention="flex", cuda_graphs=graphs)
    assert len(applied) == 2 and applied[1].endswith(", CUDA graphs") == graphs, applied
    _assert_same_per_batch(fast, eager, loss_rtol=1e-3, grad_rtol=1e-3)


@pytest.fixture(scope="module")
def references(tiny_model, tmp_path_factory):
    """Eager SDPA's per-batch losses and gradients in fp32 (the truth) and in bf16 (bf16's own rounding)."""
    tmp = tmp_path_factory.mktemp("references")
    return tuple(_cuda_losses_and_gradients(tiny_model, tmp, dtype, torch_compile=False, attention="sdpa")[1]
                 for dtype in (torch.float32, torch.bfloat16))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled layers + document-masked kernels train on GPUs")
@pytest.mark.parametrize("settings", [dict(attention="flex", cuda_graphs=False),
                                      dict(attention="flex", cuda_graphs=True), dict(attention="varlen")],
                         ids=["flex", "flex, CUDA graphs", "varlen"])
def test_cuda_bf16_document_attention_is_as_close_to_fp32_as_eager_bf16(tiny_model, tmp_path, references, settings):
    """In bf16 each path rounds differently, so each is held to fp32 truth within eager bf16's own rounding.
    With CUDA graphs the layers warm up on the first batch, record on the second and replay on the rest,
    on new document ids each time: a replay that read the recorded batch's mask would miss by far more.
    bench/bf16_gradient_error.py prints the distances the bound must hold (bench/results/vs-trl-h200.md)."""
    if settings["attention"] == "varlen" and torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("FlashAttention needs sm_80+ and bf16 or fp16")
    fp32, bf16 = references
    applied, fast = _cuda_losses_and_gradients(tiny_model, tmp_path, torch.bfloat16, torch_compile=True, **settings)
    assert len(applied) == 2 and applied[1].endswith(", CUDA graphs") == settings.get("cuda_graphs", False), applied
    _assert_within_bf16_rounding(fast, bf16, fp32)
