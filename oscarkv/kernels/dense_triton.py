"""Triton kernels of the decoder's dense ops (RMSNorm with residual, SiLU gate, fused QK preparation with the
K/V write, a paged 16-bit decode attention, embedding + RoPE tables), dispatched by
:mod:`oscarkv.kernels.dispatch`. Shapes and semantics are those of the PyTorch references
(:mod:`oscarkv.kernels.reference`, ``*_ref``); these fuse the elementwise work so that a CUDA-graph decode step
is not dominated by launch gaps. Every launch goes through :func:`_launch`, which adds programmatic dependent
launch (``pdl=True``) where :func:`pdl_available`. The decode GEMV is in :mod:`oscarkv.kernels.gemv_triton`.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._triton_util import interpreting

try:  # grid dependency control (Triton >= 3.4): griddepcontrol.wait / .launch_dependents on sm_90+
    from triton.language.extra.cuda import gdc_launch_dependents as _gdc_launch
    from triton.language.extra.cuda import gdc_wait as _gdc_wait

    HAS_GDC = True
except ImportError:  # older Triton: no programmatic dependent launch (``pdl_available`` is False)
    HAS_GDC = False

    @triton.jit
    def _gdc_wait():
        pass

    @triton.jit
    def _gdc_launch():
        pass

try:
    from triton.language.extra import libdevice as _libdevice
except ImportError:  # pragma: no cover
    _libdevice = None


def _p2(n: int) -> int:
    return 1 << (n - 1).bit_length()


@functools.lru_cache(maxsize=16)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def pdl_available(t: Tensor) -> bool:
    """Whether kernels on ``t``'s device can be programmatic dependent launches: a CUDA tensor on sm_90+, a
    Triton with grid dependency control, not the CPU interpreter. Everywhere else ``pdl=True`` is a no-op."""
    if not (HAS_GDC and t.is_cuda) or interpreting():
        return False
    return _capability(t.device.index if t.device.index is not None else torch.cuda.current_device())[0] >= 9


def _launch(kernel, grid, *args, pdl: bool = False, **meta) -> None:
    """Every kernel of this module is launched here. ``pdl``: compile the kernel's grid dependency control
    (constexpr ``PDL``: it waits for the previous kernel on the stream before touching memory that kernel
    writes or reads, and lets the next one launch early) and launch it as a programmatic dependent
    (``launch_pdl``: it may start while the previous kernel drains; in a CUDA graph, a programmatic edge)."""
    if pdl:
        meta["launch_pdl"] = True
    kernel[grid](*args, PDL=pdl, **meta)


@triton.jit
def _pdl_enter(PDL: tl.constexpr):
    """Start of a kernel with nothing to do before its inputs are ready: wait for the previous kernel, then let
    the next one be scheduled (it waits in turn, so launching it early is safe)."""
    if PDL:
        _gdc_wait()
        _gdc_launch()


@triton.jit
def _rmsnorm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, h_ptr, D, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr,
                    PDL: tl.constexpr):
    _pdl_enter(PDL)
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


def rmsnorm(x: Tensor, w: Tensor, eps: float, residual: Tensor | None = None,
            pdl: bool = False) -> tuple[Tensor, Tensor]:
    x = x.contiguous()
    D = x.shape[-1]
    y = torch.empty_like(x)
    h = torch.empty_like(x) if residual is not None else x
    _launch(_rmsnorm_kernel, (x.numel() // D,), x, residual if residual is not None else x, w, y, h, D, eps,
            HAS_RES=residual is not None, BLOCK=_p2(D), num_warps=4, pdl=pdl and pdl_available(x))
    return y, h


@triton.jit
def _silu_mul_kernel(gu_ptr, o_ptr, I, BLOCK: tl.constexpr, PDL: tl.constexpr):
    _pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < I
    g = tl.load(gu_ptr + row * 2 * I + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * 2 * I + I + cols, mask=m, other=0.0)
    s = (g / (1.0 + tl.exp(-g))).to(u.dtype)
    tl.store(o_ptr + row * I + cols, s * u, mask=m)


def silu_mul(gu: Tensor, pdl: bool = False) -> Tensor:
    gu = gu.contiguous()
    N, I2 = gu.shape
    out = torch.empty(N, I2 // 2, dtype=gu.dtype, device=gu.device)
    BLOCK = 1024
    _launch(_silu_mul_kernel, (N, triton.cdiv(I2 // 2, BLOCK)), gu, out, I2 // 2, BLOCK=BLOCK, num_warps=4,
            pdl=pdl and pdl_available(gu))
    return out


@triton.jit
def _qk_prep_kernel(qkv_ptr, cos_ptr, sin_ptr, qn_ptr, kn_ptr, r_ptr, mu_ptr, q_ptr, kv_ptr, dst_ptr, off_ptr,
                    s_which, s_head, N, eps, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                    NORM: tl.constexpr, ROT: tl.constexpr, POOL: tl.constexpr, PDL: tl.constexpr):
    """One program per (token, head) of q, k and v: norm, RoPE, center + rotate (keys), rotate (queries).
    With ``POOL`` the token's k/v rows go straight into the KV pool at ``dst + which * s_which + off[t] +
    head * s_head`` (cast to the pool dtype) instead of into ``kv``."""
    _pdl_enter(PDL)
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


def qk_prep(qkv, hq, hkv, d, cos, sin, qn, kn, eps, r_k=None, mu_k=None, out=None,
            pdl: bool = False) -> tuple[Tensor, Tensor | None]:
    """As :func:`oscarkv.kernels.reference.qk_prep_ref`; with ``out`` (a :class:`~oscarkv.kernels.layout.KVDest`)
    the k/v rows are stored into the pool and the second result is ``None``."""
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
    _launch(_qk_prep_kernel, (N, hq + 2 * hkv),
            qkv, cos.contiguous(), sin.contiguous(), qn if qn is not None else dummy, kn if kn is not None else dummy,
            r_k.contiguous() if r_k is not None else dummy, mu_k.contiguous() if mu_k is not None else dummy, q, kv,
            dst, off, s_which, s_head, N, eps, HQ=hq, HKV=hkv, D=d, NORM=qn is not None, ROT=r_k is not None,
            POOL=out is not None, num_warps=4, pdl=pdl and pdl_available(qkv))
    return q, (None if out is not None else kv)


@triton.jit
def _paged_decode_kernel(q_ptr, kv_ptr, bt_ptr, len_ptr, o_ptr, lse_ptr, sm_scale, s_bt, s_kv2, s_kvp, s_kvh,
                         PPS, HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                         P: tl.constexpr, NSPLIT: tl.constexpr, PDL: tl.constexpr):
    """Split-K over pages: program (split, b * HKV + h) covers pages [split * pps, (split + 1) * pps) of sequence
    b, with pps its own pages over the NSPLIT splits (at most PPS, the grid's bound): a sequence shorter than the
    bound the grid was made for (a captured graph's max_len) still spreads over every split."""
    _pdl_enter(PDL)
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
    pps = tl.minimum(tl.cdiv(tl.cdiv(n, P), NSPLIT), PPS)
    for i in range(pps):
        pg = sp * pps + i
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
def _merge_kernel(o_ptr, lse_ptr, out_ptr, NSPLIT: tl.constexpr, SP: tl.constexpr, D: tl.constexpr,
                  PDL: tl.constexpr):
    _pdl_enter(PDL)
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
                 max_len: int | None = None, pdl: bool = False) -> Tensor:
    """Graph-safe: the grid depends on ``max_len`` (tokens a sequence may hold), not on ``lens``. ``pdl``: both
    kernels as programmatic dependents (the merge kernel of the split kernel)."""
    B, Hq, d = q.shape
    _, _, Hkv, P, _ = kv.shape
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
    pdl = pdl and pdl_available(q)
    _launch(_paged_decode_kernel, (nsplit, B * Hkv),
            q, kv, block_table, lens, o, lse, sm_scale, block_table.stride(0), kv.stride(0), kv.stride(1),
            kv.stride(2), pps, HKV=Hkv, G=g, GP=max(16, _p2(g)), D=d, P=P, NSPLIT=nsplit, num_warps=4, num_stages=2,
            pdl=pdl)
    _launch(_merge_kernel, (B * Hq,), o, lse, out, NSPLIT=nsplit, SP=_p2(nsplit), D=d, num_warps=4, pdl=pdl)
    return out


# ------------------------------------------------------------------------------------ decode step prologue
@triton.jit
def _embed_rope_kernel(tok_ptr, pos_ptr, emb_ptr, f_ptr, x_ptr, cos_ptr, sin_ptr, D, scaling, HD: tl.constexpr,
                       BLOCK: tl.constexpr, HB: tl.constexpr, SCALE: tl.constexpr, PRECISE: tl.constexpr,
                       PDL: tl.constexpr):
    """One program per token: its embedding row, and ``cos/sin(pos * inv_freq2)`` (``* scaling``) ``[HD]``,
    computed in float32 and rounded to the embedding dtype, as ``Transformer.forward``'s torch ops do them
    (``PRECISE``: libdevice's cosf / sinf, those of torch's CUDA kernels; the interpreter has only tl.cos)."""
    _pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    tok = tl.load(tok_ptr + t).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < D
    tl.store(x_ptr + t * D + cols, tl.load(emb_ptr + tok * D + cols, mask=m), mask=m)
    j = tl.arange(0, HB)
    mj = j < HD
    e = tl.load(pos_ptr + t).to(tl.float32) * tl.load(f_ptr + j, mask=mj, other=0.0)
    if PRECISE:
        c = _libdevice.cos(e)
        sn = _libdevice.sin(e)
    else:
        c = tl.cos(e)
        sn = tl.sin(e)
    if SCALE:
        c = c * scaling
        sn = sn * scaling
    dt = x_ptr.dtype.element_ty
    tl.store(cos_ptr + t * HD + j, c.to(dt), mask=mj)
    tl.store(sin_ptr + t * HD + j, sn.to(dt), mask=mj)


def embed_rope(tokens: Tensor, positions: Tensor, emb: Tensor, inv_freq2: Tensor, scaling: float = 1.0,
               pdl: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """``(embed(tokens), cos, sin)`` of a step in one launch instead of six torch ops: ``emb`` ``[V, D]``,
    ``inv_freq2`` float32 ``[d]`` (both halves); cos/sin ``[N, d]`` in the embedding dtype."""
    N, D, hd = tokens.shape[0], emb.shape[1], inv_freq2.shape[0]
    x = torch.empty(N, D, dtype=emb.dtype, device=emb.device)
    cos = torch.empty(N, hd, dtype=emb.dtype, device=emb.device)
    sin = torch.empty_like(cos)
    _launch(_embed_rope_kernel, (N,), tokens.contiguous(), positions.contiguous(), emb.contiguous(),
            inv_freq2.float().contiguous(), x, cos, sin, D, float(scaling), HD=hd, BLOCK=_p2(D), HB=_p2(hd),
            SCALE=float(scaling) != 1.0, PRECISE=_libdevice is not None and not interpreting(), num_warps=4,
            pdl=pdl and pdl_available(emb))
    return x, cos, sin


__all__ = ["HAS_GDC", "embed_rope", "paged_decode", "pdl_available", "qk_prep", "rmsnorm", "silu_mul"]
