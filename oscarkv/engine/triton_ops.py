"""Triton kernels of :mod:`oscarkv.engine.ops` (CUDA; the interpreter runs them on CPU for tests).

Shapes and semantics are those of the PyTorch functions in ``ops.py``; these only fuse the elementwise work so
that a CUDA-graph decode step is not dominated by launch gaps.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor


def _p2(n: int) -> int:
    return 1 << (n - 1).bit_length()


@triton.jit
def _rmsnorm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, h_ptr, D, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < D
    x = tl.load(x_ptr + row * D + cols, mask=m, other=0.0)
    if HAS_RES:
        x = x + tl.load(r_ptr + row * D + cols, mask=m, other=0.0)
        tl.store(h_ptr + row * D + cols, x, mask=m)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / D + eps)
    w = tl.load(w_ptr + cols, mask=m, other=0.0)
    tl.store(y_ptr + row * D + cols, w * (xf * inv).to(x.dtype), mask=m)


def rmsnorm(x: Tensor, w: Tensor, eps: float, residual: Tensor | None = None) -> tuple[Tensor, Tensor]:
    x = x.contiguous()
    D = x.shape[-1]
    y = torch.empty_like(x)
    h = torch.empty_like(x) if residual is not None else x
    _rmsnorm_kernel[(x.numel() // D,)](x, residual if residual is not None else x, w, y, h, D, eps,
                                       HAS_RES=residual is not None, BLOCK=_p2(D), num_warps=4)
    return y, h


@triton.jit
def _silu_mul_kernel(gu_ptr, o_ptr, I, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < I
    g = tl.load(gu_ptr + row * 2 * I + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * 2 * I + I + cols, mask=m, other=0.0)
    s = (g / (1.0 + tl.exp(-g))).to(u.dtype)
    tl.store(o_ptr + row * I + cols, s * u, mask=m)


def silu_mul(gu: Tensor) -> Tensor:
    gu = gu.contiguous()
    N, I2 = gu.shape
    out = torch.empty(N, I2 // 2, dtype=gu.dtype, device=gu.device)
    BLOCK = 1024
    _silu_mul_kernel[(N, triton.cdiv(I2 // 2, BLOCK))](gu, out, I2 // 2, BLOCK=BLOCK, num_warps=4)
    return out


@triton.jit
def _qk_prep_kernel(qkv_ptr, cos_ptr, sin_ptr, qn_ptr, kn_ptr, r_ptr, mu_ptr, q_ptr, kv_ptr, dst_ptr, off_ptr,
                    s_which, s_head, N, eps, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                    NORM: tl.constexpr, ROT: tl.constexpr, POOL: tl.constexpr):
    """One program per (token, head) of q, k and v: norm, RoPE, center + rotate (keys), rotate (queries).
    With ``POOL`` the token's k/v rows go straight into the KV pool at ``dst + which * s_which + off[t] +
    head * s_head`` (cast to the pool dtype) instead of into ``kv``."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    W: tl.constexpr = (HQ + 2 * HKV) * D
    cols = tl.arange(0, D)
    x = tl.load(qkv_ptr + t * W + h * D + cols)
    if h >= HQ + HKV:  # value head: copy
        if POOL:
            off = tl.load(off_ptr + t)
            tl.store(dst_ptr + s_which + off + (h - HQ - HKV) * s_head + cols, x.to(dst_ptr.dtype.element_ty))
        else:
            tl.store(kv_ptr + (N + t) * HKV * D + (h - HQ - HKV) * D + cols, x)
    else:
        is_q = h < HQ
        dt = x.dtype
        half: tl.constexpr = D // 2
        rot_cols = tl.where(cols < half, cols + half, cols - half)
        xr = tl.load(qkv_ptr + t * W + h * D + rot_cols)
        if NORM:
            xf = x.to(tl.float32)
            inv = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / D + eps)
            w = tl.where(is_q, tl.load(qn_ptr + cols), tl.load(kn_ptr + cols))
            wr = tl.where(is_q, tl.load(qn_ptr + rot_cols), tl.load(kn_ptr + rot_cols))
            x = w * (xf * inv).to(dt)
            xr = wr * (xr.to(tl.float32) * inv).to(dt)
        xr = tl.where(cols < half, -xr, xr)
        c = tl.load(cos_ptr + t * D + cols)
        s = tl.load(sin_ptr + t * D + cols)
        x = (x * c + xr * s).to(dt)
        kvh = tl.where(is_q, h // (HQ // HKV), h - HQ)
        if ROT:
            xf = x.to(tl.float32) - tl.where(is_q, 0.0, tl.load(mu_ptr + kvh * D + cols))
            r = tl.load(r_ptr + kvh * D * D + cols[:, None] * D + cols[None, :])  # [D, D] float32
            x = tl.sum(xf[:, None] * r, 0).to(dt)
        if is_q:
            tl.store(q_ptr + t * HQ * D + h * D + cols, x)
        elif POOL:
            off = tl.load(off_ptr + t)
            tl.store(dst_ptr + off + (h - HQ) * s_head + cols, x.to(dst_ptr.dtype.element_ty))
        else:
            tl.store(kv_ptr + t * HKV * D + (h - HQ) * D + cols, x)


def qk_prep(qkv, hq, hkv, d, cos, sin, qn, kn, eps, r_k=None, mu_k=None, out=None) -> tuple[Tensor, Tensor | None]:
    """As :func:`ops.qk_prep`; with ``out`` (an :class:`ops.KVDest`) the k/v rows are stored into the pool
    and the second result is ``None``."""
    qkv = qkv.contiguous()
    N = qkv.shape[0]
    q = torch.empty(N, hq, d, dtype=qkv.dtype, device=qkv.device)
    dummy = qkv
    if out is not None:
        if out.dst.stride(-1) != 1 or out.off.dtype != torch.int64 or out.off.numel() < N:
            raise ValueError("KVDest needs a destination with unit stride on head_dim and int64 offsets per token")
        kv, dst, off, s_which, s_head = dummy, out.dst, out.off, out.s_which, out.s_head
    else:
        kv = torch.empty(2, N, hkv, d, dtype=qkv.dtype, device=qkv.device)
        dst, off, s_which, s_head = dummy, dummy, 0, 0
    _qk_prep_kernel[(N, hq + 2 * hkv)](
        qkv, cos.contiguous(), sin.contiguous(), qn if qn is not None else dummy, kn if kn is not None else dummy,
        r_k.contiguous() if r_k is not None else dummy, mu_k.contiguous() if mu_k is not None else dummy, q, kv,
        dst, off, s_which, s_head, N, eps, HQ=hq, HKV=hkv, D=d, NORM=qn is not None, ROT=r_k is not None,
        POOL=out is not None, num_warps=4)
    return q, (None if out is not None else kv)


@triton.jit
def _paged_decode_kernel(q_ptr, kv_ptr, bt_ptr, len_ptr, o_ptr, lse_ptr, sm_scale, s_bt, s_kv2, s_kvp, s_kvh,
                         PPS, HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                         P: tl.constexpr, NSPLIT: tl.constexpr):
    """Split-K over pages: program (split, b * HKV + h) covers pages [split * PPS, (split + 1) * PPS)."""
    sp = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // HKV
    h = bh % HKV
    n = tl.load(len_ptr + b)
    rows = tl.arange(0, GP)
    cols = tl.arange(0, D)
    qm = rows < G
    q = tl.load(q_ptr + (b * HKV * G + h * G + rows[:, None]) * D + cols[None, :], mask=qm[:, None], other=0.0)
    m_i = tl.full([GP], -1e30, tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    toks = tl.arange(0, P)
    for i in range(PPS):
        pg = sp * PPS + i
        if pg * P < n:
            page = tl.load(bt_ptr + b * s_bt + pg).to(tl.int64)
            base = kv_ptr + page * s_kvp + h * s_kvh + toks[:, None] * D + cols[None, :]
            k = tl.load(base)
            v = tl.load(base + s_kv2)
            s = tl.dot(q, tl.trans(k)).to(tl.float32) * sm_scale
            s = tl.where((pg * P + toks)[None, :] < n, s, -1e30)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
            m_i = m_new
    out = acc / tl.maximum(l_i, 1e-30)[:, None]
    lse = tl.where(l_i > 0, m_i + tl.log(tl.maximum(l_i, 1e-30)), -1e30)
    o_off = ((b * HKV * G + h * G + rows) * NSPLIT + sp).to(tl.int64)
    tl.store(o_ptr + o_off[:, None] * D + cols[None, :], out, mask=qm[:, None])
    tl.store(lse_ptr + o_off, lse, mask=qm)


@triton.jit
def _merge_kernel(o_ptr, lse_ptr, out_ptr, NSPLIT: tl.constexpr, SP: tl.constexpr, D: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)  # b * Hq + j
    s = tl.arange(0, SP)
    cols = tl.arange(0, D)
    sm = s < NSPLIT
    lse = tl.load(lse_ptr + r * NSPLIT + s, mask=sm, other=-1e30)
    mx = tl.max(lse, 0)
    w = tl.where(sm & (lse > -1e29), tl.exp(lse - mx), 0.0)
    o = tl.load(o_ptr + (r * NSPLIT + s)[:, None] * D + cols[None, :], mask=sm[:, None], other=0.0)
    tot = tl.maximum(tl.sum(w, 0), 1e-30)
    tl.store(out_ptr + r * D + cols, (tl.sum(o * w[:, None], 0) / tot).to(out_ptr.dtype.element_ty))


_WORK: dict = {}


def paged_decode(q: Tensor, kv: Tensor, block_table: Tensor, lens: Tensor, sm_scale: float,
                 max_len: int | None = None) -> Tensor:
    """Graph-safe: the grid depends on ``max_len`` (tokens a sequence may hold), not on ``lens``."""
    B, Hq, d = q.shape
    _, npages, Hkv, P, _ = kv.shape
    g = Hq // Hkv
    max_pages = math.ceil((max_len or block_table.shape[1] * P) / P)
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 4
    want = max(1, math.ceil(4 * sms / (B * Hkv)))
    pps = max(1, math.ceil(max_pages / min(want, max_pages)))
    nsplit = math.ceil(max_pages / pps)
    key = (B, Hq, d, nsplit, q.device)
    if key not in _WORK:  # persistent workspace: a captured graph keeps pointing at it
        _WORK[key] = (torch.empty(B * Hq * nsplit, d, dtype=torch.float32, device=q.device),
                      torch.empty(B * Hq * nsplit, dtype=torch.float32, device=q.device))
    o, lse = _WORK[key]
    out = torch.empty_like(q)
    q = q.contiguous()
    _paged_decode_kernel[(nsplit, B * Hkv)](
        q, kv, block_table, lens, o, lse, sm_scale, block_table.stride(0), kv.stride(0), kv.stride(1),
        kv.stride(2), pps, HKV=Hkv, G=g, GP=max(16, _p2(g)), D=d, P=P, NSPLIT=nsplit, num_warps=4, num_stages=2)
    _merge_kernel[(B * Hq,)](o, lse, out, NSPLIT=nsplit, SP=_p2(nsplit), D=d, num_warps=4)
    return out



__all__ = ["rmsnorm", "silu_mul", "qk_prep", "paged_decode"]
