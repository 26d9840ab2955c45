"""Would LoRA's dropout fused into its adapter matmuls be faster? A measurement, not a code path.

The twentieth session left one lever unmeasured for Llama-3-8B QLoRA: PEFT's LoRA dropout is aten's
dropout kernel (5% of the step's GPU time) followed by cuBLAS's skinny matmul with the A matrix (r=16),
and a kernel that draws the mask inside the A matmul would save the dropout's pass over the input.
Such a kernel cannot keep the mask (that is the saving), so the backward must draw it again: once
for A's gradient and once for the input's. Here the three Triton kernels of that design (forward
x*mask @ A.T, A's gradient, the input's gradient; Philox drawn per element, or once per 4 elements)
are checked against torch on the mask they draw, and timed with triton.testing.do_bench against
aten's dropout, cuBLAS's three matmuls and aten's dropout backward, on the shapes of an H200 step:
Llama-3-8B micro-batch 2 (4,096 tokens, 4,096 and 14,336 wide), Qwen2.5-3B micro-batch 4 (8,192
tokens, 2,048 and 11,008 wide) and one small shape. Prints one JSON line per shape: keep rate, the
largest error relative to the largest value, and microseconds per call.

    python bench/lora_dropout_kernel.py        # CUDA and Triton; results/lora-dropout-kernel-h200.md

The kernels also ran under Triton's interpreter on a CPU (TRITON_INTERPRET=1) in fp16, against the
same references; the interpreter does not read bf16.
"""
import json

import torch
import triton
import triton.language as tl
from triton.testing import do_bench


@triton.jit
def _uniform(seed, rows, k0, BT: tl.constexpr, BK: tl.constexpr, FOUR: tl.constexpr):
    if FOUR:
        q = (k0 // 4 + tl.arange(0, BK // 4)).to(tl.uint32)
        c0 = q[None, :] + (rows[:, None] * 0).to(tl.uint32)
        c1 = rows[:, None].to(tl.uint32) + (q[None, :] * 0)
        z = c0 * 0
        r0, r1, r2, r3 = tl.philox(seed, c0, c1, z, z)
        u = tl.join(tl.join(r0, r1), tl.join(r2, r3))
        u = tl.reshape(u, (BT, BK))
    else:
        cols = (k0 + tl.arange(0, BK)).to(tl.uint32)
        c0 = cols[None, :] + (rows[:, None] * 0).to(tl.uint32)
        c1 = rows[:, None].to(tl.uint32) + (cols[None, :] * 0)
        z = c0 * 0
        u, _, _, _ = tl.philox(seed, c0, c1, z, z)
    return (u >> 8).to(tl.float32) * (1.0 / 16777216.0)


@triton.jit
def _fwd(X, A, H, seed_ptr, T, K, p, scale, k_per_split: tl.constexpr, R: tl.constexpr, BT: tl.constexpr,
         BK: tl.constexpr, FOUR: tl.constexpr):
    pid_t = tl.program_id(0)
    pid_s = tl.program_id(1)
    seed = tl.load(seed_ptr)
    rows = pid_t * BT + tl.arange(0, BT)
    r = tl.arange(0, R)
    acc = tl.zeros((BT, R), tl.float32)
    for i in range(0, k_per_split, BK):
        k0 = pid_s * k_per_split + i
        cols = k0 + tl.arange(0, BK)
        x = tl.load(X + rows[:, None] * K + cols[None, :], mask=(rows[:, None] < T) & (cols[None, :] < K), other=0.0)
        u = _uniform(seed, rows, k0, BT, BK, FOUR)
        xd = tl.where(u >= p, x.to(tl.float32) * scale, 0.0).to(x.dtype)
        a = tl.load(A + r[None, :] * K + cols[:, None], mask=cols[:, None] < K, other=0.0)
        acc = tl.dot(xd, a, acc)
    tl.store(H + pid_s * T * R + rows[:, None] * R + r[None, :], acc, mask=rows[:, None] < T)


@triton.jit
def _dx(DH, A, DX, seed_ptr, T, K, p, scale, R: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, FOUR: tl.constexpr):
    pid_t = tl.program_id(0)
    pid_k = tl.program_id(1)
    seed = tl.load(seed_ptr)
    rows = pid_t * BT + tl.arange(0, BT)
    k0 = pid_k * BK
    cols = k0 + tl.arange(0, BK)
    r = tl.arange(0, R)
    dh = tl.load(DH + rows[:, None] * R + r[None, :], mask=rows[:, None] < T, other=0.0)
    a = tl.load(A + r[:, None] * K + cols[None, :], mask=cols[None, :] < K, other=0.0)
    g = tl.dot(dh, a)
    u = _uniform(seed, rows, k0, BT, BK, FOUR)
    g = tl.where(u >= p, g * scale, 0.0)
    tl.store(DX + rows[:, None] * K + cols[None, :], g.to(DX.dtype.element_ty),
             mask=(rows[:, None] < T) & (cols[None, :] < K))


@triton.jit
def _da(DH, X, DA, seed_ptr, T, K, p, scale, t_per_split: tl.constexpr, R: tl.constexpr, BT: tl.constexpr,
        BK: tl.constexpr, FOUR: tl.constexpr):
    pid_k = tl.program_id(0)
    pid_s = tl.program_id(1)
    seed = tl.load(seed_ptr)
    k0 = pid_k * BK
    cols = k0 + tl.arange(0, BK)
    r = tl.arange(0, R)
    acc = tl.zeros((R, BK), tl.float32)
    for i in range(0, t_per_split, BT):
        t0 = pid_s * t_per_split + i
        rows = t0 + tl.arange(0, BT)
        dh = tl.load(DH + rows[None, :] * R + r[:, None], mask=rows[None, :] < T, other=0.0)  # [R, BT]
        x = tl.load(X + rows[:, None] * K + cols[None, :], mask=(rows[:, None] < T) & (cols[None, :] < K), other=0.0)
        u = _uniform(seed, rows, k0, BT, BK, FOUR)
        xd = tl.where(u >= p, x.to(tl.float32) * scale, 0.0).to(x.dtype)
        acc = tl.dot(dh, xd, acc)
    tl.store(DA + pid_s * R * K + r[:, None] * K + cols[None, :], acc, mask=cols[None, :] < K)


@triton.jit
def _mask(M, seed_ptr, T, K, BT: tl.constexpr, BK: tl.constexpr, FOUR: tl.constexpr):
    seed = tl.load(seed_ptr)
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    k0 = tl.program_id(1) * BK
    cols = k0 + tl.arange(0, BK)
    u = _uniform(seed, rows, k0, BT, BK, FOUR)
    tl.store(M + rows[:, None] * K + cols[None, :], u, mask=(rows[:, None] < T) & (cols[None, :] < K))


SM = torch.cuda.get_device_properties(0).multi_processor_count


def _split(length, block, other_tiles):
    """How many programs share a reduction of `length` (about two per multiprocessor in all), and the
    length each one takes, a multiple of `block`."""
    split = max(1, min(length // block, (2 * SM) // other_tiles))
    per_split = triton.cdiv(triton.cdiv(length, split), block) * block
    return triton.cdiv(length, per_split), per_split


def fwd(x, A, seed, p, four, BT=64, BK=128):
    T, K = x.shape
    R = A.shape[0]
    nt = triton.cdiv(T, BT)
    split, kps = _split(K, BK, nt)
    part = torch.empty(split, T, R, device=x.device, dtype=torch.float32)
    _fwd[(nt, split)](x, A, part, seed, T, K, p, 1 / (1 - p), k_per_split=kps, R=R, BT=BT, BK=BK, FOUR=four)
    return part.sum(0).to(x.dtype) if split > 1 else part[0].to(x.dtype)


def dx(dh, A, seed, p, K, four, BT=64, BK=128):
    T, R = dh.shape
    out = torch.empty(T, K, device=dh.device, dtype=dh.dtype)
    _dx[(triton.cdiv(T, BT), triton.cdiv(K, BK))](dh, A, out, seed, T, K, p, 1 / (1 - p), R=R, BT=BT, BK=BK, FOUR=four)
    return out


def da(dh, x, seed, p, four, BT=64, BK=128):
    T, K = x.shape
    R = dh.shape[1]
    nk = triton.cdiv(K, BK)
    split, tps = _split(T, BT, nk)
    part = torch.empty(split, R, K, device=x.device, dtype=torch.float32)
    _da[(nk, split)](dh, x, part, seed, T, K, p, 1 / (1 - p), t_per_split=tps, R=R, BT=BT, BK=BK, FOUR=four)
    return part.sum(0)


def keep_mask(seed, T, K, p, four, BT=64, BK=128):
    u = torch.empty(T, K, device="cuda", dtype=torch.float32)
    _mask[(triton.cdiv(T, BT), triton.cdiv(K, BK))](u, seed, T, K, BT=BT, BK=BK, FOUR=four)
    return u >= p


def measure(T, K, p):
    """One shape: the fused kernels (Philox once per element, "one", or per 4 elements, "four") checked
    against torch on the mask they draw, then timed beside aten's dropout and cuBLAS's matmuls."""
    torch.manual_seed(0)
    x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
    A = (torch.randn(16, K, device="cuda") * 0.02).to(torch.bfloat16)
    dh = torch.randn(T, 16, device="cuda", dtype=torch.bfloat16)
    seed = torch.randint(0, 2**31 - 1, (1,), device="cuda", dtype=torch.int64)
    row = {"T": T, "K": K}
    for four in (False, True):
        keep = keep_mask(seed, T, K, p, four)
        xd = (x.float() * keep / (1 - p)).to(torch.bfloat16)
        h_ref = (xd.float() @ A.float().t())
        h = fwd(x, A, seed, p, four)
        g_ref = ((dh.float() @ A.float()) * keep / (1 - p))
        g = dx(dh, A, seed, p, K, four)
        a_ref = dh.float().t() @ xd.float()
        a = da(dh, x, seed, p, four)
        tag = "four" if four else "one"
        row[tag] = {
            "keep_mean": round(keep.float().mean().item(), 5),
            "keep_rowspread": round(keep.float().mean(1).std().item(), 5),
            "fwd_err": ((h.float() - h_ref).abs().max() / h_ref.abs().max()).item(),
            "dx_err": ((g.float() - g_ref).abs().max() / g_ref.abs().max()).item(),
            "da_err": ((a - a_ref).abs().max() / a_ref.abs().max()).item(),
            "fwd_us": do_bench(lambda: fwd(x, A, seed, p, four)) * 1e3,  # noqa: B023 (called at once)
            "dx_us": do_bench(lambda: dx(dh, A, seed, p, K, four)) * 1e3,  # noqa: B023
            "da_us": do_bench(lambda: da(dh, x, seed, p, four)) * 1e3,  # noqa: B023
        }
    mask_b = torch.rand(T, K, device="cuda") >= p
    xd_b = torch.nn.functional.dropout(x, p, True)
    row["aten"] = {
        "dropout_us": do_bench(lambda: torch.ops.aten.native_dropout(x, p, True)) * 1e3,
        "mmA_us": do_bench(lambda: xd_b @ A.t()) * 1e3,
        "dA_mm_us": do_bench(lambda: dh.t() @ xd_b) * 1e3,
        "dx_mm_us": do_bench(lambda: dh @ A) * 1e3,
        "dx_mask_us": do_bench(lambda: torch.ops.aten.native_dropout_backward(x, mask_b, 1 / (1 - p))) * 1e3,
    }
    return row


def main():
    for T, K in [(4096, 4096), (4096, 14336), (8192, 2048), (8192, 11008), (2048, 2048)]:
        print(json.dumps(measure(T, K, 0.05)), flush=True)


if __name__ == "__main__":
    main()
