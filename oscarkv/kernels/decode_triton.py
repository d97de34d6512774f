"""Triton decode attention over the paged quantized cache and the 16-bit tiers: split-K partial softmaxes, then
one log-sum-exp merge. One program = one (sequence, KV head, split); the query heads of the KV head share every
unpacked tile (GQA). Every format: keys in token or channel pages of 2 or 4 bits, values in token pages of 2 or
4 bits. The portable twin of the CUDA C++ kernel (:mod:`oscarkv.kernels.decode_cuda`), and the one the CPU
interpreter tests; on CUDA the dispatcher takes it where that kernel cannot run (more than 8 query heads per KV
head, float32 16-bit tiers, other head sizes).

Scale and offset are factored out of both products (method section 5): token-page keys
``q . k^_t = s_t (q . c_t) + o_t sum(q)``; channel-page keys (a scale ``s_c`` and offset ``o_c`` per channel of a
page) ``q . k^_t = (q * s) . c_t + q . o``; values ``sum_t p_t v^_t = sum_t (p_t s_t) c_t + sum_t p_t o_t``; so
the codes themselves, exact small integers, are the matrix operands. Field ``j`` of packed byte ``c`` is element
``j d / (8 / bits) + c`` of the row, so the unpacked fields side by side are the row in natural order.
Layout: :mod:`oscarkv.kernels.layout`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._triton_util import check_decode, next_pow2, pool_strides
from .layout import QuantPages
from .plan import DecodePlan


@triton.jit
def _codes(codes_ptr, crow, BITS: tl.constexpr, D: tl.constexpr):
    """The codes of rows ``crow`` (byte offsets ``[n]``) in natural element order, ``[n, D]`` int32: element
    ``e`` is field ``e // RB`` of byte ``e % RB`` (``RB`` bytes per row; each byte is read ``8 / BITS`` times,
    from L1)."""
    RB: tl.constexpr = D * BITS // 8
    e = tl.arange(0, D)
    x = tl.load(codes_ptr + crow[:, None] + (e % RB)[None, :]).to(tl.int32)
    return (x >> (BITS * (e // RB))[None, :]) & ((1 << BITS) - 1)


@triton.jit
def _dot(a, b, MMA: tl.constexpr):
    """``a [M, K] @ b [K, N]`` in float32: tensor cores on float16 operands (``MMA``), else float32 products."""
    if MMA:
        r = tl.dot(a.to(tl.float16), b.to(tl.float16))
    else:
        r = tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    return r


@triton.jit
def _decode_quant(
    q_ptr, sqb, sqh, kc_ptr, ks_ptr, ko_ptr, vc_ptr, vs_ptr, vo_ptr, s_kcp, s_kch, s_vcp, s_vch, s_kmp, s_kmh,
    s_vmp, s_vmh, bt_ptr, s_bt, b, h, tok_lo, tok_hi, sm_scale,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, PS: tl.constexpr, KB: tl.constexpr, VB: tl.constexpr,
    KCH: tl.constexpr, MMA: tl.constexpr,
):
    """Partial softmax (log2 domain) of the G query heads of KV head ``h`` over quantized tokens
    ``[tok_lo, tok_hi)``; returns the running max, sum, ``sum p o_v`` and the ``[GP, D]`` accumulator."""
    gi = tl.arange(0, GP)
    gmask = gi < G
    dd = tl.arange(0, D)
    # the query in the log2 domain; float16 (rounding 2^-11 relative) on the tensor-core path
    x = tl.load(q_ptr + b.to(tl.int64) * sqb + (h * G + gi)[:, None] * sqh + dd[None, :], mask=gmask[:, None],
                other=0.0).to(tl.float32) * (sm_scale * 1.4426950408889634)
    qsum = tl.sum(x, axis=1)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    osum = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    n = tl.arange(0, PS)
    bt_row = bt_ptr + b.to(tl.int64) * s_bt
    RBK: tl.constexpr = D * KB // 8
    RBV: tl.constexpr = D * VB // 8
    for p in range(tok_lo // PS, tl.cdiv(tok_hi, PS)):
        page = tl.load(bt_row + p).to(tl.int64)
        tmask = p * PS + n < tok_hi
        kc = _codes(kc_ptr, page * s_kcp + h * s_kch + n * RBK, KB, D)
        if KCH:  # a channel page holding a live token is written whole: its metadata is valid
            kmeta = page * s_kmp + h * s_kmh + dd
            ks = tl.load(ks_ptr + kmeta).to(tl.float32)
            ko = tl.load(ko_ptr + kmeta).to(tl.float32)
            s = _dot(x * ks[None, :], tl.trans(kc), MMA) + tl.sum(x * ko[None, :], axis=1)[:, None]
        else:  # rows past the sequence end hold stale bytes (maybe NaN metadata): masked loads give zeros
            ks = tl.load(ks_ptr + page * s_kmp + h * s_kmh + n, mask=tmask, other=0.0).to(tl.float32)
            ko = tl.load(ko_ptr + page * s_kmp + h * s_kmh + n, mask=tmask, other=0.0).to(tl.float32)
            s = _dot(x, tl.trans(kc), MMA) * ks[None, :] + qsum[:, None] * ko[None, :]
        vrow = page * s_vmp + h * s_vmh + n
        vs = tl.load(vs_ptr + vrow, mask=tmask, other=0.0).to(tl.float32)
        vo = tl.load(vo_ptr + vrow, mask=tmask, other=0.0).to(tl.float32)
        s = tl.where(tmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        pr = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(pr, axis=1)
        osum = osum * alpha + tl.sum(pr * vo[None, :], axis=1)
        # p * s_v, normalised by the tile's largest scale so that float16 keeps its precision
        vmax = tl.maximum(tl.max(vs, axis=0), 1e-30)
        vcodes = _codes(vc_ptr, page * s_vcp + h * s_vch + n * RBV, VB, D)
        acc = acc * alpha[:, None] + _dot(pr * (vs / vmax)[None, :], vcodes, MMA) * vmax
        m_i = m_new
    return m_i, l_i, osum, acc


@triton.jit
def _decode_16bit(
    q_ptr, sqb, sqh, k16_ptr, v16_ptr, s16b, s16h, s16t, b, h, tok_lo, tok_hi, sm_scale,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Partial softmax over 16-bit-tier tokens ``[tok_lo, tok_hi)`` (float32 dots: tf32 on tensor cores)."""
    gi = tl.arange(0, GP)
    gmask = gi < G
    dd = tl.arange(0, D)
    q = tl.load(q_ptr + b.to(tl.int64) * sqb + (h * G + gi)[:, None] * sqh + dd[None, :],
                mask=gmask[:, None], other=0.0).to(tl.float32) * (sm_scale * 1.4426950408889634)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    n = tl.arange(0, BLOCK_N)
    base = b.to(tl.int64) * s16b + h * s16h
    for t0 in range(tok_lo, tok_hi, BLOCK_N):
        t = t0 + n
        tmask = t < tok_hi
        off = base + t[:, None].to(tl.int64) * s16t + dd[None, :]
        k = tl.load(k16_ptr + off, mask=tmask[:, None], other=0.0).to(tl.float32)
        v = tl.load(v16_ptr + off, mask=tmask[:, None], other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k))
        s = tl.where(tmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = tl.dot(p, v, acc * alpha[:, None])
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _decode_split_kernel(
    q_ptr, sqb, sqh, kc_ptr, ks_ptr, ko_ptr, vc_ptr, vs_ptr, vo_ptr, s_kcp, s_kch, s_kmp, s_kmh, s_vcp, s_vch,
    s_vmp, s_vmh, bt_ptr, s_bt,
    qlen_ptr, k16_ptr, v16_ptr, s16b, s16h, s16t, len16_ptr, o_ptr, lse_ptr, s_ob, s_oh, s_os, s_lb, s_lh,
    HKV, sm_scale, max_pps, num_qsplits, tok16_per_split, gran_pages, least_pages,
    G: tl.constexpr, GP: tl.constexpr, GP16: tl.constexpr, D: tl.constexpr, PS: tl.constexpr,
    KB: tl.constexpr, VB: tl.constexpr, KCH: tl.constexpr, BLOCK_16: tl.constexpr, MMA: tl.constexpr,
):
    split = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // HKV
    h = bh % HKV
    dd = tl.arange(0, D)
    if split < num_qsplits:
        gi = tl.arange(0, GP)
        ntok = tl.load(qlen_ptr + b)
        # this sequence's own split length (DecodePlan.split_tokens): its pages over all num_qsplits splits
        want = tl.cdiv(tl.cdiv(ntok, PS), num_qsplits)
        tok_per_split = tl.minimum(tl.maximum(tl.cdiv(want, gran_pages) * gran_pages, least_pages), max_pps) * PS
        lo = split * tok_per_split
        hi = tl.minimum(lo + tok_per_split, ntok)
        m_i, l_i, osum, acc = _decode_quant(
            q_ptr, sqb, sqh, kc_ptr, ks_ptr, ko_ptr, vc_ptr, vs_ptr, vo_ptr, s_kcp, s_kch, s_vcp, s_vch, s_kmp,
            s_kmh, s_vmp, s_vmh, bt_ptr, s_bt, b, h, lo, hi, sm_scale, G, GP, D, PS, KB, VB, KCH, MMA)
        inv = 1.0 / tl.where(l_i > 0, l_i, 1.0)
        obase = o_ptr + b.to(tl.int64) * s_ob + (h * G + gi)[:, None] * s_oh + split * s_os + dd[None, :]
        tl.store(obase, acc * inv[:, None] + (osum * inv)[:, None], mask=(gi < G)[:, None])
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + b.to(tl.int64) * s_lb + (h * G + gi) * s_lh + split, lse, mask=gi < G)
    else:
        ntok = tl.load(len16_ptr + b)
        lo = (split - num_qsplits) * tok16_per_split
        hi = tl.minimum(lo + tok16_per_split, ntok)
        m16, l16, acc16 = _decode_16bit(q_ptr, sqb, sqh, k16_ptr, v16_ptr, s16b, s16h, s16t, b, h, lo, hi,
                                        sm_scale, G, GP16, D, BLOCK_16)
        g16 = tl.arange(0, GP16)
        inv16 = 1.0 / tl.where(l16 > 0, l16, 1.0)
        optr = o_ptr + b.to(tl.int64) * s_ob + (h * G + g16)[:, None] * s_oh + split * s_os + dd[None, :]
        tl.store(optr, acc16 * inv16[:, None], mask=(g16 < G)[:, None])
        lse16 = tl.where(l16 > 0, m16 + tl.log2(tl.where(l16 > 0, l16, 1.0)), float("-inf"))
        tl.store(lse_ptr + b.to(tl.int64) * s_lb + (h * G + g16) * s_lh + split, lse16, mask=g16 < G)


@triton.jit
def _merge_kernel(o_ptr, lse_ptr, out_ptr, s_ob, s_oh, s_os, s_lb, s_lh, s_outb, s_outh, HQ, num_splits,
                  D: tl.constexpr, SB: tl.constexpr):
    """out[b, hq] = sum_s 2^(lse_s - lse) o_s over the splits (empty splits have lse = -inf)."""
    bh = tl.program_id(0)
    b = bh // HQ
    hq = bh % HQ
    dd = tl.arange(0, D)
    sb = tl.arange(0, SB)
    m = tl.full([1], float("-inf"), tl.float32)
    den = tl.zeros([1], tl.float32)
    acc = tl.zeros([D], tl.float32)
    lbase = lse_ptr + b.to(tl.int64) * s_lb + hq * s_lh
    obase = o_ptr + b.to(tl.int64) * s_ob + hq * s_oh
    for s0 in range(0, num_splits, SB):
        s = s0 + sb
        lse = tl.load(lbase + s, mask=s < num_splits, other=float("-inf"))
        live = lse > float("-inf")
        o = tl.load(obase + s[:, None] * s_os + dd[None, :], mask=live[:, None], other=0.0)
        m_new = tl.maximum(m, tl.max(lse, axis=0))
        m_use = tl.where(m_new > float("-inf"), m_new, 0.0)
        w = tl.where(live, tl.exp2(lse - m_use), 0.0)
        alpha = tl.exp2(m - m_use)
        den = den * alpha + tl.sum(w, axis=0)
        acc = acc * alpha + tl.sum(w[:, None] * o, axis=0)
        m = m_new
    res = acc / tl.where(den > 0, den, 1.0)
    tl.store(out_ptr + b.to(tl.int64) * s_outb + hq * s_outh + dd, res.to(out_ptr.dtype.element_ty))


def decode_attention_triton(
    q: Tensor, k_pages: QuantPages, v_pages: QuantPages, block_table: Tensor, qlen: Tensor,
    k16: Tensor, v16: Tensor, len16: Tensor, sm_scale: float | None = None, *,
    plan: DecodePlan | None = None, out: Tensor | None = None,
) -> Tensor:
    """Decode attention; see :func:`oscarkv.kernels.reference.decode_attention_ref` for the semantics.

    q ``[B, Hq, d]`` (rotated; float32/float16/bfloat16), pools of any format (K and V sharing heads, head_dim and
    page size; head_dim and page size powers of two >= 16), 16-bit tiers ``k16/v16 [B, Hkv, C16, d]``,
    ``block_table``/``qlen``/``len16`` int32. Returns ``[B, Hq, d]`` in q's dtype (or written into ``out``).
    ``plan``: a :class:`DecodePlan` (``plan.update(B)`` done); built on the fly when None (not graph-safe).
    No host synchronisation. Channel-page keys: every page holding a live token must have been written whole
    (as the write path enforces). Tensor cores (float16 operands) when the GQA group has at least 4 heads, else
    float32 products.
    """
    B, hq, d = q.shape
    fmt, vfmt = k_pages.fmt, v_pages.fmt
    if plan is None:
        plan = DecodePlan(B, hq, fmt.num_kv_heads, d, fmt.page_size, block_table.shape[1], k16.shape[2],
                          device=q.device)
    check_decode(q, k_pages, v_pages, block_table, qlen, k16, v16, len16, plan)
    if fmt.page_size & (fmt.page_size - 1):
        raise ValueError(f"the Triton decode kernel needs a power-of-two page_size, got {fmt.page_size}: use "
                         "backend='cuda' or 'reference'")
    if q.stride(2) != 1:
        q = q.contiguous()
    g = hq // fmt.num_kv_heads
    mma = g >= 4
    gp = max(16, next_pow2(g)) if mma else next_pow2(g)
    if out is None:
        out = torch.empty(B, hq, d, dtype=q.dtype, device=q.device)
    o, lse = plan.o_part, plan.lse_part
    grid = (plan.num_splits, B * fmt.num_kv_heads)
    _decode_split_kernel[grid](
        q, q.stride(0), q.stride(1), k_pages.codes, k_pages.scale, k_pages.offset, v_pages.codes,
        v_pages.scale, v_pages.offset, *pool_strides(k_pages), *pool_strides(v_pages),
        block_table, block_table.stride(0), qlen, k16, v16, k16.stride(0),
        k16.stride(1), k16.stride(2), len16, o, lse, o.stride(0), o.stride(1), o.stride(2), lse.stride(0),
        lse.stride(1), fmt.num_kv_heads, float(d**-0.5 if sm_scale is None else sm_scale),
        plan.pages_per_split, plan.num_qsplits, plan.tokens16_per_split, *plan.split_granule,
        G=g, GP=gp, GP16=max(16, next_pow2(g)), D=d, PS=fmt.page_size, KB=fmt.bits, VB=vfmt.bits,
        KCH=fmt.channel, BLOCK_16=32, MMA=mma, num_warps=4 if mma else 8,
    )
    _merge_kernel[(B * hq,)](
        o, lse, out, o.stride(0), o.stride(1), o.stride(2), lse.stride(0), lse.stride(1), out.stride(0),
        out.stride(1), hq, plan.num_splits, D=d, SB=16, num_warps=4,
    )
    return out


__all__ = ["decode_attention_triton"]
