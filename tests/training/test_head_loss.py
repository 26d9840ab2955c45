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
    assert not fused_gradient(head, torch.float16)  # the loss scale is only known in backward
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
