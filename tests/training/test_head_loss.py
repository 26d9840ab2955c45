"""The output head's loss with its gradient computed in forward (`HeadLoss`) gives the loss and the
gradients that autograd gives through the recomputed chunks, and is used only where that holds."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

import relaytune.training.loss as loss_module
from relaytune.training.loss import HeadLoss, causal_lm_loss, fused_gradient
from relaytune.training.loss_settings import CHUNK_TOKENS

ROWS = 2 * CHUNK_TOKENS + 37  # two whole chunks and a partial one


def _case(dtype=torch.float32, bias=True):
    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(24, 301, bias=bias).to(dtype).requires_grad_(False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(head.weight.shape, generator=g))
    hidden = torch.randn(ROWS, 24, generator=g).to(dtype).requires_grad_(True)
    targets = torch.randint(0, 301, (ROWS,), generator=g)
    return head, hidden, targets


def test_loss_and_hidden_gradient_equal_autograd_in_fp32(one_thread):
    head, hidden, targets = _case()
    expected = F.cross_entropy(head(hidden).float(), targets, reduction="sum") / 7
    expected.backward()
    want = hidden.grad.clone()
    hidden.grad = None
    got = HeadLoss.apply(hidden, head.weight, head.bias, targets, torch.float32) / 7
    got.backward()
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(hidden.grad, want, rtol=1e-5, atol=1e-6)


def test_under_bf16_autocast_it_matches_the_recomputed_chunks_to_bf16_rounding(one_thread):
    head, hidden, targets = _case(bias=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = sum(loss_module._chunk_loss(head, hidden[i:i + CHUNK_TOKENS], targets[i:i + CHUNK_TOKENS])
                       for i in range(0, ROWS, CHUNK_TOKENS))
        assert fused_gradient(head, loss_module.compute_dtype(head, hidden))
        got = HeadLoss.apply(hidden, head.weight, head.bias, targets, torch.bfloat16)
    expected.backward()
    want = hidden.grad.clone()
    hidden.grad = None
    got.backward()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-2)
    assert hidden.grad.dtype == want.dtype == torch.float32
    torch.testing.assert_close(hidden.grad, want, rtol=2e-2, atol=2e-2)


def test_through_the_model_the_adapter_gradients_match_the_recomputed_path(tiny_model, one_thread, monkeypatch):
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model), LoraConfig(r=4, lora_dropout=0.0,
                                                                                       init_lora_weights=False))
    ids = torch.randint(5, model.config.vocab_size, (3, 200), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    results = []
    for fused in (True, False):
        monkeypatch.setattr(loss_module, "fused_gradient", lambda head, dtype, fused=fused: fused)
        model.zero_grad(set_to_none=True)
        loss = causal_lm_loss(model, batch, 597)
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}))
    (fused_loss, fused_grads), (plain_loss, plain_grads) = results
    torch.testing.assert_close(fused_loss, plain_loss, rtol=1e-6, atol=1e-6)
    assert fused_grads.keys() == plain_grads.keys() and fused_grads
    for name, grad in plain_grads.items():
        torch.testing.assert_close(fused_grads[name], grad, rtol=1e-4, atol=1e-7, msg=name)


def test_the_gradient_is_computed_in_forward_only_where_it_equals_autograd(tiny_model):
    head, _, _ = _case(torch.bfloat16)
    assert fused_gradient(head, torch.bfloat16) and fused_gradient(head, torch.float32)
    assert not fused_gradient(head, torch.float16)  # fp16 without the loss scale: recomputed chunks
    assert fused_gradient(head, torch.float16, scaled=True)
    trained = torch.nn.Linear(4, 5)
    assert not fused_gradient(trained, torch.float32)
    hooked = torch.nn.Linear(4, 5).requires_grad_(False)
    hooked.register_forward_hook(lambda *a: None)
    assert not fused_gradient(hooked, torch.float32)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model),
                           LoraConfig(r=4, target_modules=["q_proj", "lm_head"]))
    assert not fused_gradient(model.get_output_embeddings(), torch.float32)  # PEFT's LoRA wrapper


@pytest.mark.parametrize("grad", [False, True])
def test_without_gradients_the_loss_is_the_same_number(grad, one_thread):
    head, hidden, targets = _case()
    with torch.no_grad():
        expected = F.cross_entropy(head(hidden), targets, reduction="sum")
    with torch.set_grad_enabled(grad):
        got = HeadLoss.apply(hidden, head.weight, head.bias, targets, torch.float32)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-5)


def _confident_case(vocab=4001, width=24):
    """Predictions late in training: the target's logit ~20 above the rest, so the other tokens'
    probabilities (~1e-9) lie far below fp16's smallest number, yet their gradient adds up."""
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(vocab, width, generator=g)
    targets = torch.randint(0, vocab, (ROWS,), generator=g)
    hidden = (3.0 * weight[targets] + 0.3 * torch.randn(ROWS, width, generator=g)).requires_grad_(True)
    head = torch.nn.Linear(width, vocab, bias=False).half().requires_grad_(False)
    with torch.no_grad():
        head.weight.copy_(weight)
    return head, hidden, targets


def test_fp16_with_the_loss_scale_rounds_what_autograd_rounds(one_thread):
    """fp16 with the gradient scaler's scale: the hidden states' gradient equals autograd's through the
    recomputed fp16 chunks, and the fp32 one to fp16 rounding; exactly the same tokens' gradients round
    away entirely (131 of 549 here). Without the scale more do (274): what the scale is for."""
    head, hidden, targets = _confident_case()
    scale, items = torch.tensor(2.0 ** 16), 4  # a short global batch: the scale is 16,384 per token

    def grad_of(loss_fn):
        hidden.grad = None
        (loss_fn() * scale).backward()
        return hidden.grad / scale

    exact = grad_of(lambda: F.cross_entropy(hidden @ head.weight.float().T, targets, reduction="sum") / items)
    with torch.autocast("cpu", dtype=torch.float16):
        autograd = grad_of(lambda: sum(loss_module._chunk_loss(head, hidden[i:i + CHUNK_TOKENS],
                                                               targets[i:i + CHUNK_TOKENS])
                                       for i in range(0, ROWS, CHUNK_TOKENS)) / items)
        assert fused_gradient(head, loss_module.compute_dtype(head, hidden), scaled=True)
        scaled = grad_of(lambda: HeadLoss.apply(hidden, head.weight, None, targets, torch.float16,
                                                scale / items) / items)
        unscaled = grad_of(lambda: HeadLoss.apply(hidden, head.weight, None, targets, torch.float16) / items)

    def error(g):
        return ((g - exact).norm() / exact.norm()).item()

    assert error(autograd) < 0.01 and error(scaled) < 0.01
    torch.testing.assert_close(scaled, autograd, rtol=0.01, atol=0.01 * exact.abs().max().item())

    def lost_rows(g):  # tokens whose gradient rounded away entirely
        return int((g.abs().sum(dim=1) == 0).sum())

    assert lost_rows(exact) == 0 and lost_rows(scaled) == lost_rows(autograd) < lost_rows(unscaled)


def test_fp16_given_the_scalers_scale_the_loss_takes_the_fused_path(tiny_model, one_thread, monkeypatch):
    """Handed a GradScaler's scale as a tensor, causal_lm_loss computes the head's gradient in forward
    with scale / target tokens, and the adapters' gradients equal those of the recomputed chunks."""
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model), LoraConfig(r=4, lora_dropout=0.0,
                                                                                       init_lora_weights=False))
    model.get_output_embeddings().half()
    ids = torch.randint(5, model.config.vocab_size, (3, 200), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
    seen, results = [], []
    real = HeadLoss.apply
    monkeypatch.setattr(HeadLoss, "apply", lambda *a: seen.append(a[-1]) or real(*a))
    for loss_scale in (scaler.scale(torch.ones(())), None):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = causal_lm_loss(model, batch, 597, loss_scale=loss_scale)
        scaler.scale(loss).backward()
        results.append({n: p.grad.float() / scaler.get_scale() for n, p in model.named_parameters()
                        if p.requires_grad})
    assert len(seen) == 1 and seen[0].item() == pytest.approx(2.0 ** 12 / 597)  # the fused path, once, with S / n
    fused, recomputed = results
    for name, grad in recomputed.items():
        torch.testing.assert_close(fused[name], grad, rtol=0.02, atol=1e-6, msg=name)


def test_the_labelled_positions_come_from_the_batchs_host_copy_when_it_has_one(tiny_model, one_thread):
    """On a GPU the batch keeps its pinned source as `host_copy` (data/batches.to_device); the
    positions are found there, so the host never waits for the forward. Here the copy differs
    from the tensor on purpose, to show which one is read; with equal copies the loss is the same."""
    from relaytune.training.loss import labelled_positions

    labels = torch.tensor([[-100, 5, 6, -100], [7, -100, 8, 9]])
    keep, targets = labelled_positions(labels, torch.device("cpu"))
    assert keep.tolist() == [0, 1, 5, 6] and targets.tolist() == [5, 6, 8, 9]
    other = labels.clone()
    other[0, 1] = -100
    labels.host_copy = other
    keep, targets = labelled_positions(labels, torch.device("cpu"))
    assert keep.tolist() == [1, 5, 6] and targets.tolist() == [6, 8, 9]

    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model), LoraConfig(r=4, lora_dropout=0.0))
    ids = torch.randint(5, model.config.vocab_size, (2, 50), generator=torch.Generator().manual_seed(1))
    plain = {"input_ids": ids, "labels": ids.clone()}
    plain["labels"][:, :10] = -100
    copied = dict(plain, labels=plain["labels"].clone())
    copied["labels"].host_copy = plain["labels"].clone()
    with torch.no_grad():
        assert torch.equal(causal_lm_loss(model, plain, 80), causal_lm_loss(model, copied, 80))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the sync it guards against is a GPU's")
def test_on_a_gpu_the_labelled_positions_never_wait_for_the_device():
    from relaytune.data.batches import to_device
    from relaytune.training.loss import labelled_positions

    labels = torch.tensor([[-100, 5, 6, -100], [7, -100, 8, 9]])
    expected = labelled_positions(labels, torch.device("cpu"))
    moved = to_device({"labels": labels}, torch.device("cuda"))["labels"]
    torch.cuda.set_sync_debug_mode("error")
    try:
        keep, targets = labelled_positions(moved, torch.device("cuda"))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(keep.cpu(), expected[0]) and torch.equal(targets.cpu(), expected[1])
