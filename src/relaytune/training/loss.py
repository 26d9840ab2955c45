"""The causal-LM loss without materialising the full logits.

A model's own forward computes logits for every position (batch x seq x vocab;
for Qwen2.5 at 4 x 2048 that is 1.2 G values, 5 GB in fp32 once the loss
upcasts them, and as much again for their gradient). Here the decoder runs,
then only the positions that carry a label go through the output head, in
chunks: the peak holds one chunk's logits. With a frozen plain head, each
chunk's gradient for the hidden states is computed right after its loss, in
forward (`HeadLoss`), so its logits exist once, in place, and are never
recomputed; fp16 does so too when it is handed the gradient scaler's scale (the
gradient is rounded to fp16 already scaled, as autograd's is). Otherwise (a head
that trains, or fp16 without the scale) each chunk is recomputed in backward.

The sum is divided by `num_items` (the target tokens of the whole global
batch), exactly as transformers' `num_items_in_batch` does, so gradient
accumulation stays exact. Architectures whose head does more than a linear
layer (logit soft-capping, scaling) use the model's own forward instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from relaytune.data.batches import host_copy
from relaytune.data.rows import IGNORE
from relaytune.training.loss_settings import CHUNK_TOKENS, PLAIN_HEAD


def supports_chunked_loss(model) -> bool:
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = lm.config
    if getattr(config, "model_type", None) not in PLAIN_HEAD:
        return False
    if any(getattr(config, k, None) for k in ("final_logit_softcapping", "logits_scaling", "logit_scale")):
        return False
    return hasattr(lm, "get_decoder") and lm.get_output_embeddings() is not None


def causal_lm_loss(model, batch: dict, num_items: int, chunked: bool = True,
                   loss_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Summed next-token cross-entropy over labelled positions, divided by `num_items`. `loss_scale`:
    the factor fp16's gradient scaler will multiply this loss by before backward (a 0-d tensor on the
    device, so reading it never waits for the GPU)."""
    if not chunked:
        return model(**batch, num_items_in_batch=num_items).loss
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    hidden = lm.get_decoder()(**inputs, use_cache=False).last_hidden_state
    keep, targets = labelled_positions(batch["labels"], hidden.device)
    hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, keep)
    head = lm.get_output_embeddings()
    dtype = compute_dtype(head, hidden)
    if torch.is_grad_enabled() and hidden.requires_grad and fused_gradient(head, dtype, loss_scale is not None):
        expected = None if loss_scale is None else loss_scale / num_items  # what backward will bring
        return HeadLoss.apply(hidden, head.weight, head.bias, targets, dtype, expected) / num_items
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, targets.numel(), CHUNK_TOKENS):
        h, t = hidden[start:start + CHUNK_TOKENS], targets[start:start + CHUNK_TOKENS]
        if torch.is_grad_enabled():
            total = total + checkpoint(_chunk_loss, head, h, t, use_reentrant=False)
        else:
            total = total + _chunk_loss(head, h, t)
    return total / num_items


def labelled_positions(labels: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The flat positions that predict a labelled token (position t predicts token t+1; the last
    predicts nothing), and those tokens, on `device`. Found on the host from the batch's pinned copy
    when it has one (data/batches.to_device): `nonzero` on the GPU would make the host wait for the
    whole decoder forward before it could queue the head and the backward."""
    host = host_copy(labels)
    source = labels if host is None else host
    targets = torch.cat([source[:, 1:], torch.full_like(source[:, :1], IGNORE)], dim=1).reshape(-1)
    keep = (targets != IGNORE).nonzero(as_tuple=True)[0]
    targets = targets.index_select(0, keep)
    if host is None or device.type != "cuda":
        return keep.to(device), targets.to(device)
    return tuple(t.pin_memory().to(device, non_blocking=True) for t in (keep, targets))


def _chunk_loss(head, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = head(hidden).float()
    return F.cross_entropy(logits, targets, reduction="sum")


def compute_dtype(head, hidden: torch.Tensor) -> torch.dtype:
    """The dtype the head's matmul runs in: autocast's when it is on, else the weight's."""
    device = hidden.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else head.weight.dtype


def fused_gradient(head, dtype: torch.dtype, scaled: bool = False) -> bool:
    """Whether `HeadLoss` computes exactly what autograd would through `head`: a plain frozen linear
    layer (not PEFT's or bitsandbytes' wrapper, not sharded by FSDP, no hooks) in bf16 or fp32, or in
    fp16 when the loss scale is known (`scaled`): rounded to fp16 unscaled, more of the logits' gradient
    (for a large vocabulary mostly far below fp16's smallest normal number) would become zero than
    autograd's scaled one does."""
    params = [head.weight] + ([head.bias] if head.bias is not None else [])
    dtypes = (torch.bfloat16, torch.float32) + ((torch.float16,) if scaled else ())
    return (type(head) is torch.nn.Linear and dtype in dtypes
            and not any(p.requires_grad or type(p.data) is not torch.Tensor for p in params)
            and not (head._forward_hooks or head._forward_pre_hooks))


class HeadLoss(torch.autograd.Function):
    """Summed cross-entropy of `hidden @ weight.T + bias` against `targets`, chunk by chunk, with the
    gradient for `hidden` computed in forward: d(loss)/d(logits) = softmax - one_hot, which the
    chunk's fp32 logits become in place. Backward only scales it by the incoming gradient.

    `expected`: the incoming gradient backward will bring (fp16: the loss scale over the target
    count), multiplied in before the logits' gradient is rounded to `dtype` and divided out again in
    backward, so fp16 rounds the same scaled values that autograd's backward would."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, dtype, expected=None):
        weight = weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad = torch.empty(hidden.shape, dtype=dtype, device=hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, targets.numel(), CHUNK_TOKENS):
                rows = slice(start, start + CHUNK_TOKENS)
                t = targets[rows]
                logits = F.linear(hidden[rows].to(dtype), weight, bias).float()
                picked = logits.gather(1, t[:, None]).squeeze(1)
                top = logits.amax(dim=1, keepdim=True)
                sums = logits.sub_(top).exp_().sum(dim=1, keepdim=True)
                total += (sums.log() + top - picked[:, None]).sum()  # log-sum-exp minus the target's logit
                probs = logits.div_(sums)
                probs.scatter_add_(1, t[:, None], torch.full_like(picked[:, None], -1.0))
                if expected is not None:
                    probs.mul_(expected)
                grad[rows] = probs.to(dtype) @ weight
        ctx.save_for_backward(grad)
        ctx.hidden_dtype, ctx.expected = hidden.dtype, expected
        return total

    @staticmethod
    def backward(ctx, grad_total):
        (grad,) = ctx.saved_tensors
        factor = grad_total if ctx.expected is None else grad_total / ctx.expected
        return (grad.float() * factor).to(ctx.hidden_dtype), None, None, None, None, None
