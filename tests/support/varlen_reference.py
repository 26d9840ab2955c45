"""A CPU stand-in for torch's FlashAttention varlen kernel, for the tests of `attention: varlen`.

torch.nn.attention.varlen runs on CUDA only. This reference takes the same call (the batch laid end
to end as (T, H, D), the documents' starts as cu_seqlens) and runs SDPA, causal, on each document in
turn. Like torch's, it is a custom op with a fake and an autograd formula, so Dynamo keeps it whole
inside a compiled layer and a symbolic count of documents reaches it as it would reach the real one.
Each call checks what relaytune hands the kernel: one causal switch, the same starts for queries and
keys, a maximum length no document exceeds, and GQA asked for exactly when the key heads are fewer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CALLS: list[dict] = []  # what each eager call was handed, newest last
DTYPES: list = []  # the dtype of each eager call's tensors


@torch.library.custom_op("relaytune_tests::varlen_attention", mutates_args=())
def _attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, starts: torch.Tensor,
            scale: float) -> torch.Tensor:
    out = query.new_empty(query.shape[:-1] + (value.shape[-1],))
    bounds = starts.tolist()
    for a, b in zip(bounds, bounds[1:]):
        out[a:b] = _document(query[a:b], key[a:b], value[a:b], scale)
    return out


@_attend.register_fake
def _(query, key, value, starts, scale):
    return query.new_empty(query.shape[:-1] + (value.shape[-1],))


def _document(q, k, v, scale):
    """SDPA, causal, over one document: (n, H, D) in, (n, Hq, Dv) out."""
    heads = (t.transpose(0, 1)[None] for t in (q, k, v))
    out = F.scaled_dot_product_attention(*heads, is_causal=True, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


@torch.library.custom_op("relaytune_tests::varlen_attention_backward", mutates_args=())
def _attend_backward(grad: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     starts: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    grads = [torch.zeros_like(t) for t in (query, key, value)]
    bounds = starts.tolist()
    for a, b in zip(bounds, bounds[1:]):
        for whole, part in zip(grads, _document_backward(grad[a:b], query[a:b], key[a:b], value[a:b], scale)):
            whole[a:b] = part
    return tuple(grads)


def _document_backward(grad, q, k, v, scale):
    """Causal softmax attention's gradients for one document, written out (autograd does not run
    inside a custom op): dV = P^T dO, dS = P * (dO V^T - rowsum(dO * O)), dQ = dS K s, dK = dS^T Q s;
    a key head's gradients are summed over the query heads that share it."""
    group = q.shape[1] // k.shape[1]
    q, k, v, grad = (t.transpose(0, 1).float() for t in (q, k, v, grad))  # (H, n, D)
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    n = q.shape[1]
    scores = (q @ k.transpose(1, 2)) * scale
    scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    probs = scores.softmax(-1)
    out = probs @ v
    dv = probs.transpose(1, 2) @ grad
    ds = probs * (grad @ v.transpose(1, 2) - (grad * out).sum(-1, keepdim=True))
    dq, dk = ds @ k * scale, ds.transpose(1, 2) @ q * scale
    dk, dv = (t.unflatten(0, (-1, group)).sum(1) for t in (dk, dv))
    return tuple(t.transpose(0, 1) for t in (dq, dk, dv))


@_attend_backward.register_fake
def _(grad, query, key, value, starts, scale):
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


def _setup_context(ctx, inputs, output):
    query, key, value, starts, scale = inputs
    ctx.save_for_backward(query, key, value, starts)
    ctx.scale = scale


def _backward(ctx, grad):
    query, key, value, starts = ctx.saved_tensors
    dq, dk, dv = _attend_backward(grad.contiguous(), query, key, value, starts, ctx.scale)
    return dq, dk, dv, None, None


_attend.register_autograd(_backward, setup_context=_setup_context)


def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                is_causal=False, enable_gqa=False):
    """torch.nn.attention.varlen.varlen_attn's call (either causal switch), run by the reference."""
    assert (window_size == (-1, 0)) != bool(is_causal), "exactly one causal switch"
    assert cu_seq_q is cu_seq_k and max_q == max_k
    assert enable_gqa == (key.shape[1] != query.shape[1])
    if not torch.compiler.is_compiling():
        lengths = torch.diff(cu_seq_q)
        assert int(cu_seq_q[-1]) == query.shape[0] and int(lengths.max()) <= max_q
        CALLS.append({"starts": cu_seq_q.tolist(), "max": max_q, "gqa": enable_gqa, "heads": key.shape[1]})
        DTYPES.append(query.dtype)
    return _attend(query, key, value, cu_seq_q, query.shape[-1] ** -0.5 if scale is None else scale)


def install(monkeypatch, gqa: bool = True, causal: dict | None = None, scale: bool = True) -> None:
    """Make relaytune's varlen attention call the reference, as a torch of that API would be called."""
    from relaytune.training import attention

    attention._register()
    monkeypatch.setattr(attention, "_varlen_attn", varlen_attn)
    options = {"causal": causal or {"window_size": (-1, 0)}, "gqa": gqa, "scale": scale}
    monkeypatch.setattr(attention, "_VARLEN_OPTIONS", options)
    CALLS.clear()
    DTYPES.clear()
