"""Triton decode attention over the paged 2-bit cache and the 16-bit tiers: split-K partial softmaxes, then one
log-sum-exp merge. One program = one (sequence, KV head, split); the query heads of the KV head share every
unpacked tile (GQA).

Scale and offset are factored out of both products (method section 5):
``q . k^_t = s_t (q . c_t) + o_t sum(q)`` and ``sum_t p_t v^_t = sum_t (p_t s_t) c_t + sum_t p_t o_t``,
so the codes themselves are the matrix operands. Codes become exact float16 integers through the float16
magic number (OR a 2-bit field into the mantissa of 1024.0, subtract 1024) instead of integer-to-float
conversions; on CUDA four fields of four bytes are unpacked by one inline-PTX block.
Two compute paths: tensor cores (``tl.dot``, query heads stacked and padded to 16 rows) and CUDA cores
(broadcast-multiply-reduce in float32, for small GQA groups). Layout: :mod:`oscarkv.kernels.layout`.
"""

from __future__ import annotations

import torch
from torch import Tensor

import triton
import triton.language as tl

from ._triton_util import check_device, check_kv_formats, check_pool_strides, interpreting, next_pow2, pool_strides
from .layout import QuantPages
from .plan import DecodePlan

# Four fields of four packed bytes -> four pairs of f16x2 (field j of bytes 0..3): prmt spreads bytes 0/1
# (2/3) into the two halves, a shift + lop3 moves field j into the mantissa of 1024.0, sub.f16x2 removes it.
_UNPACK_ASM = tl.constexpr("""
{
.reg .b32 a, b, t, m, k;
prmt.b32 a, $8, 0, 0x4140;
prmt.b32 b, $8, 0, 0x4342;
mov.b32 m, 0x00030003;
mov.b32 k, 0x64006400;
lop3.b32 $0, a, m, k, 0xea;
lop3.b32 $1, b, m, k, 0xea;
sub.f16x2 $0, $0, k;
sub.f16x2 $1, $1, k;
shr.b32 t, a, 2;
lop3.b32 $2, t, m, k, 0xea;
shr.b32 t, b, 2;
lop3.b32 $3, t, m, k, 0xea;
sub.f16x2 $2, $2, k;
sub.f16x2 $3, $3, k;
shr.b32 t, a, 4;
lop3.b32 $4, t, m, k, 0xea;
shr.b32 t, b, 4;
lop3.b32 $5, t, m, k, 0xea;
sub.f16x2 $4, $4, k;
sub.f16x2 $5, $5, k;
shr.b32 t, a, 6;
lop3.b32 $6, t, m, k, 0xea;
shr.b32 t, b, 6;
lop3.b32 $7, t, m, k, 0xea;
sub.f16x2 $6, $6, k;
sub.f16x2 $7, $7, k;
}
""")


@triton.jit
def _field(codes, J: tl.constexpr, BITS: tl.constexpr):
    """Field ``J`` of packed uint8 ``codes`` as exact float16 integers (magic-number unpacking)."""
    MASK: tl.constexpr = (1 << BITS) - 1
    x = ((codes.to(tl.int16) >> (BITS * J)) & MASK) | 0x6400
    return x.to(tl.float16, bitcast=True) - 1024.0


@triton.jit
def _fields4(codes, ASM: tl.constexpr):
    """The four 2-bit fields of ``codes`` (uint8) as float16 tensors."""
    if ASM:
        f0, f1, f2, f3 = tl.inline_asm_elementwise(
            _UNPACK_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r", [codes],
            dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=4)
    else:
        f0 = _field(codes, 0, 2)
        f1 = _field(codes, 1, 2)
        f2 = _field(codes, 2, 2)
        f3 = _field(codes, 3, 2)
    return f0, f1, f2, f3


@triton.jit
def _scores(q0, q1, q2, q3, c0, c1, c2, c3, MMA: tl.constexpr):
    """Sum over fields of ``q_j . c_j``: q_j ``[GP, DQ]``, c_j ``[BLOCK_N, DQ]`` -> ``[GP, BLOCK_N]`` float32."""
    if MMA:
        acc = tl.dot(q0, tl.trans(c0))
        acc = tl.dot(q1, tl.trans(c1), acc)
        acc = tl.dot(q2, tl.trans(c2), acc)
        acc = tl.dot(q3, tl.trans(c3), acc)
    else:
        acc = tl.sum(q0.to(tl.float32)[:, None, :] * c0.to(tl.float32)[None, :, :], axis=2)
        acc += tl.sum(q1.to(tl.float32)[:, None, :] * c1.to(tl.float32)[None, :, :], axis=2)
        acc += tl.sum(q2.to(tl.float32)[:, None, :] * c2.to(tl.float32)[None, :, :], axis=2)
        acc += tl.sum(q3.to(tl.float32)[:, None, :] * c3.to(tl.float32)[None, :, :], axis=2)
    return acc


@triton.jit
def _pv(p, c, MMA: tl.constexpr):
    """``p [GP, BLOCK_N] @ c [BLOCK_N, DQ]`` in float32 (p float16 for MMA, else float32)."""
    if MMA:
        r = tl.dot(p, c)
    else:
        r = tl.sum(p[:, :, None] * c.to(tl.float32)[None, :, :], axis=1)
    return r


@triton.jit
def _channel_scores(x0, x1, x2, x3, q0, q1, q2, q3, r0, r1, r2, r3, ks_ptr, ko_ptr, kmeta, c, k0, k1, k2, k3,
                    DQ: tl.constexpr, MMA: tl.constexpr, QSPLIT: tl.constexpr, FOLD: tl.constexpr):
    """Logits over one channel page, ``q . k^_t = sum_c (q_c s_c) code_tc + sum_c q_c o_c``, by ``FOLD``:

    1 ("query"): the page's scale is folded into the float32 log2-domain query fields ``x_j`` ``[GP, DQ]`` (one
    d-vector multiply per page), the offset enters as one dot ``x . o`` per head;
    2 ("dequant", tensor cores only): the code tiles ``k_j`` ``[PS, DQ]`` become the dequantized keys
    ``o + code * s`` in float16 (relative rounding 2^-11, like the float16 query's), against the loop-invariant
    float16 query ``q_j`` (+ ``r_j``); no offset term, no per-page query work.
    """
    ks0 = tl.load(ks_ptr + kmeta + c)
    ks1 = tl.load(ks_ptr + kmeta + DQ + c)
    ks2 = tl.load(ks_ptr + kmeta + 2 * DQ + c)
    ks3 = tl.load(ks_ptr + kmeta + 3 * DQ + c)
    ko0 = tl.load(ko_ptr + kmeta + c)
    ko1 = tl.load(ko_ptr + kmeta + DQ + c)
    ko2 = tl.load(ko_ptr + kmeta + 2 * DQ + c)
    ko3 = tl.load(ko_ptr + kmeta + 3 * DQ + c)
    if MMA and FOLD == 2:
        c0 = k0 * ks0.to(tl.float16)[None, :] + ko0.to(tl.float16)[None, :]
        c1 = k1 * ks1.to(tl.float16)[None, :] + ko1.to(tl.float16)[None, :]
        c2 = k2 * ks2.to(tl.float16)[None, :] + ko2.to(tl.float16)[None, :]
        c3 = k3 * ks3.to(tl.float16)[None, :] + ko3.to(tl.float16)[None, :]
        s = _scores(q0, q1, q2, q3, c0, c1, c2, c3, MMA)
        if QSPLIT:
            s += _scores(r0, r1, r2, r3, c0, c1, c2, c3, MMA)
    else:
        ks0, ks1, ks2, ks3 = ks0.to(tl.float32), ks1.to(tl.float32), ks2.to(tl.float32), ks3.to(tl.float32)
        ko0, ko1, ko2, ko3 = ko0.to(tl.float32), ko1.to(tl.float32), ko2.to(tl.float32), ko3.to(tl.float32)
        off = tl.sum(x0 * ko0[None, :] + x1 * ko1[None, :] + x2 * ko2[None, :] + x3 * ko3[None, :], axis=1)
        y0, y1, y2, y3 = x0 * ks0[None, :], x1 * ks1[None, :], x2 * ks2[None, :], x3 * ks3[None, :]
        if MMA:  # float16 operands, like the token path's query (rounding 2^-11 relative)
            h0, h1, h2, h3 = y0.to(tl.float16), y1.to(tl.float16), y2.to(tl.float16), y3.to(tl.float16)
            s = _scores(h0, h1, h2, h3, k0, k1, k2, k3, MMA)
            if QSPLIT:
                s += _scores((y0 - h0.to(tl.float32)).to(tl.float16), (y1 - h1.to(tl.float32)).to(tl.float16),
                             (y2 - h2.to(tl.float32)).to(tl.float16), (y3 - h3.to(tl.float32)).to(tl.float16),
                             k0, k1, k2, k3, MMA)
        else:
            s = _scores(y0, y1, y2, y3, k0, k1, k2, k3, MMA)
        s += off[:, None]
    return s


@triton.jit
def _decode_2bit(
    q_ptr, sqb, sqh, kc_ptr, ks_ptr, ko_ptr, vc_ptr, vs_ptr, vo_ptr, s_cp, s_ch, s_kmp, s_kmh, s_mp, s_mh,
    bt_ptr, s_bt, b, h, tok_lo, tok_hi, sm_scale,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, PS: tl.constexpr,
    MMA: tl.constexpr, ASM: tl.constexpr, QSPLIT: tl.constexpr, KCH: tl.constexpr,
):
    """Partial softmax of the G query heads of KV head ``h`` over 2-bit tokens ``[tok_lo, tok_hi)``.
    ``KCH``: 0 = token-page keys; 1 (scale folded into the query) or 2 (tiles dequantized) = keys in channel pages
    (meta strides ``s_kmp``/``s_kmh``, one ``[d]`` scale/offset per page). Values: token pages (``s_mp``/``s_mh``)."""
    DQ: tl.constexpr = D // 4
    RB: tl.constexpr = D // 4
    gi = tl.arange(0, GP)
    gmask = gi < G
    c = tl.arange(0, DQ)
    qbase = q_ptr + b.to(tl.int64) * sqb + (h * G + gi)[:, None] * sqh + c[None, :]
    qscale = sm_scale * 1.4426950408889634
    # q_j: the elements of field j (j * D/4 + c), prescaled into the log2 domain, split into float16 high and
    # low parts (q = hi + lo to ~2^-22): the codes are exact, so the logits keep float32-like accuracy
    x0 = tl.load(qbase, mask=gmask[:, None], other=0.0).to(tl.float32) * qscale
    x1 = tl.load(qbase + DQ, mask=gmask[:, None], other=0.0).to(tl.float32) * qscale
    x2 = tl.load(qbase + 2 * DQ, mask=gmask[:, None], other=0.0).to(tl.float32) * qscale
    x3 = tl.load(qbase + 3 * DQ, mask=gmask[:, None], other=0.0).to(tl.float32) * qscale
    q0, q1, q2, q3 = x0.to(tl.float16), x1.to(tl.float16), x2.to(tl.float16), x3.to(tl.float16)
    r0 = (x0 - q0.to(tl.float32)).to(tl.float16)
    r1 = (x1 - q1.to(tl.float32)).to(tl.float16)
    r2 = (x2 - q2.to(tl.float32)).to(tl.float16)
    r3 = (x3 - q3.to(tl.float32)).to(tl.float16)
    qsum = tl.sum(x0 + x1 + x2 + x3, axis=1)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    osum = tl.zeros([GP], tl.float32)
    a0 = tl.zeros([GP, DQ], tl.float32)
    a1 = tl.zeros([GP, DQ], tl.float32)
    a2 = tl.zeros([GP, DQ], tl.float32)
    a3 = tl.zeros([GP, DQ], tl.float32)
    n = tl.arange(0, PS)
    bt_row = bt_ptr + b.to(tl.int64) * s_bt
    for p in range(tok_lo // PS, tl.cdiv(tok_hi, PS)):
        # one page per iteration: a scalar page id, so every load below is contiguous and vectorised
        page = tl.load(bt_row + p).to(tl.int64)
        crow = page * s_cp + h * s_ch + n * RB  # a (page, head) block: PS rows of RB bytes, contiguous
        mrow = page * s_mp + h * s_mh + n
        tmask = p * PS + n < tok_hi
        kc = tl.load(kc_ptr + crow[:, None] + c[None, :])
        vc = tl.load(vc_ptr + crow[:, None] + c[None, :])
        # rows past the sequence end hold stale bytes (maybe NaN metadata): masked loads give zeros
        vs = tl.load(vs_ptr + mrow, mask=tmask, other=0.0).to(tl.float32)
        vo = tl.load(vo_ptr + mrow, mask=tmask, other=0.0).to(tl.float32)
        k0, k1, k2, k3 = _fields4(kc, ASM)
        if KCH > 0:  # a channel page holding a live token is written whole: its metadata is valid
            s = _channel_scores(x0, x1, x2, x3, q0, q1, q2, q3, r0, r1, r2, r3, ks_ptr, ko_ptr,
                                page * s_kmp + h * s_kmh, c, k0, k1, k2, k3, DQ, MMA, QSPLIT, KCH)
        else:
            ks = tl.load(ks_ptr + mrow, mask=tmask, other=0.0).to(tl.float32)
            ko = tl.load(ko_ptr + mrow, mask=tmask, other=0.0).to(tl.float32)
            s = _scores(q0, q1, q2, q3, k0, k1, k2, k3, MMA)
            if QSPLIT:
                s += _scores(r0, r1, r2, r3, k0, k1, k2, k3, MMA)
            s = s * ks[None, :] + qsum[:, None] * ko[None, :]
        s = tl.where(tmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        osum = osum * alpha + tl.sum(p * vo[None, :], axis=1)
        # p * s_v, normalised by the tile's largest scale so that float16 keeps its precision
        vmax = tl.maximum(tl.max(vs, axis=0), 1e-30)
        pv = p * (vs / vmax)[None, :]
        if MMA:
            pv = pv.to(tl.float16)
        v0, v1, v2, v3 = _fields4(vc, ASM)
        a0 = a0 * alpha[:, None] + _pv(pv, v0, MMA) * vmax
        a1 = a1 * alpha[:, None] + _pv(pv, v1, MMA) * vmax
        a2 = a2 * alpha[:, None] + _pv(pv, v2, MMA) * vmax
        a3 = a3 * alpha[:, None] + _pv(pv, v3, MMA) * vmax
        m_i = m_new
    return m_i, l_i, osum, a0, a1, a2, a3


@triton.jit
def _decode_16bit(
    q_ptr, sqb, sqh, k16_ptr, v16_ptr, s16b, s16h, s16t, b, h, tok_lo, tok_hi, sm_scale,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Partial softmax over 16-bit-tier tokens ``[tok_lo, tok_hi)`` (float32 dots: tf32 on tensor cores)."""
    gi = tl.arange(0, GP)
    gmask = gi < G
    dd = tl.arange(0, DP)
    dmask = dd < D
    q = tl.load(q_ptr + b.to(tl.int64) * sqb + (h * G + gi)[:, None] * sqh + dd[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0).to(tl.float32) * (sm_scale * 1.4426950408889634)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, DP], tl.float32)
    n = tl.arange(0, BLOCK_N)
    base = b.to(tl.int64) * s16b + h * s16h
    for t0 in range(tok_lo, tok_hi, BLOCK_N):
        t = t0 + n
        tmask = t < tok_hi
        off = base + t[:, None].to(tl.int64) * s16t + dd[None, :]
        msk = tmask[:, None] & dmask[None, :]
        k = tl.load(k16_ptr + off, mask=msk, other=0.0).to(tl.float32)
        v = tl.load(v16_ptr + off, mask=msk, other=0.0).to(tl.float32)
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
    q_ptr, sqb, sqh, kc_ptr, ks_ptr, ko_ptr, vc_ptr, vs_ptr, vo_ptr, s_cp, s_ch, s_kmp, s_kmh, s_mp, s_mh,
    bt_ptr, s_bt,
    qlen_ptr, k16_ptr, v16_ptr, s16b, s16h, s16t, len16_ptr, o_ptr, lse_ptr, s_ob, s_oh, s_os, s_lb, s_lh,
    HKV, sm_scale, max_pps, num_qsplits, tok16_per_split, gran_pages, least_pages,
    G: tl.constexpr, GP: tl.constexpr, GP16: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
    PS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_16: tl.constexpr, MMA: tl.constexpr, ASM: tl.constexpr,
    QSPLIT: tl.constexpr, KCH: tl.constexpr,
):
    split = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // HKV
    h = bh % HKV
    if split < num_qsplits:
        gi = tl.arange(0, GP)
        ntok = tl.load(qlen_ptr + b)
        # this sequence's own split length (DecodePlan.split_tokens): its pages over all num_qsplits splits
        want = tl.cdiv(tl.cdiv(ntok, PS), num_qsplits)
        tok_per_split = tl.minimum(tl.maximum(tl.cdiv(want, gran_pages) * gran_pages, least_pages), max_pps) * PS
        lo = split * tok_per_split
        hi = tl.minimum(lo + tok_per_split, ntok)
        m_i, l_i, osum, a0, a1, a2, a3 = _decode_2bit(
            q_ptr, sqb, sqh, kc_ptr, ks_ptr, ko_ptr, vc_ptr, vs_ptr, vo_ptr, s_cp, s_ch, s_kmp, s_kmh, s_mp, s_mh,
            bt_ptr, s_bt, b, h, lo, hi, sm_scale, G, GP, D, PS, MMA, ASM, QSPLIT, KCH)
        DQ: tl.constexpr = D // 4
        c = tl.arange(0, DQ)
        inv = 1.0 / tl.where(l_i > 0, l_i, 1.0)
        obase = o_ptr + b.to(tl.int64) * s_ob + (h * G + gi)[:, None] * s_oh + split * s_os + c[None, :]
        om = (gi < G)[:, None]
        ob = osum[:, None] * inv[:, None]
        tl.store(obase, a0 * inv[:, None] + ob, mask=om)
        tl.store(obase + DQ, a1 * inv[:, None] + ob, mask=om)
        tl.store(obase + 2 * DQ, a2 * inv[:, None] + ob, mask=om)
        tl.store(obase + 3 * DQ, a3 * inv[:, None] + ob, mask=om)
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + b.to(tl.int64) * s_lb + (h * G + gi) * s_lh + split, lse, mask=gi < G)
    else:
        ntok = tl.load(len16_ptr + b)
        lo = (split - num_qsplits) * tok16_per_split
        hi = tl.minimum(lo + tok16_per_split, ntok)
        m16, l16, acc = _decode_16bit(q_ptr, sqb, sqh, k16_ptr, v16_ptr, s16b, s16h, s16t, b, h, lo, hi,
                                      sm_scale, G, GP16, D, DP, BLOCK_16)
        g16 = tl.arange(0, GP16)
        dd = tl.arange(0, DP)
        inv16 = 1.0 / tl.where(l16 > 0, l16, 1.0)
        optr = o_ptr + b.to(tl.int64) * s_ob + (h * G + g16)[:, None] * s_oh + split * s_os + dd[None, :]
        tl.store(optr, acc * inv16[:, None], mask=(g16 < G)[:, None] & (dd < D)[None, :])
        lse16 = tl.where(l16 > 0, m16 + tl.log2(tl.where(l16 > 0, l16, 1.0)), float("-inf"))
        tl.store(lse_ptr + b.to(tl.int64) * s_lb + (h * G + g16) * s_lh + split, lse16, mask=g16 < G)


@triton.jit
def _merge_kernel(o_ptr, lse_ptr, out_ptr, s_ob, s_oh, s_os, s_lb, s_lh, s_outb, s_outh, HQ, num_splits,
                  D: tl.constexpr, DP: tl.constexpr, SB: tl.constexpr):
    """out[b, hq] = sum_s 2^(lse_s - lse) o_s over the splits (empty splits have lse = -inf)."""
    bh = tl.program_id(0)
    b = bh // HQ
    hq = bh % HQ
    dd = tl.arange(0, DP)
    sb = tl.arange(0, SB)
    m = tl.full([1], float("-inf"), tl.float32)
    den = tl.zeros([1], tl.float32)
    acc = tl.zeros([DP], tl.float32)
    lbase = lse_ptr + b.to(tl.int64) * s_lb + hq * s_lh
    obase = o_ptr + b.to(tl.int64) * s_ob + hq * s_oh
    for s0 in range(0, num_splits, SB):
        s = s0 + sb
        lse = tl.load(lbase + s, mask=s < num_splits, other=float("-inf"))
        live = lse > float("-inf")
        o = tl.load(obase + s[:, None] * s_os + dd[None, :], mask=live[:, None] & (dd < D)[None, :], other=0.0)
        m_new = tl.maximum(m, tl.max(lse, axis=0))
        m_use = tl.where(m_new > float("-inf"), m_new, 0.0)
        w = tl.where(live, tl.exp2(lse - m_use), 0.0)
        alpha = tl.exp2(m - m_use)
        den = den * alpha + tl.sum(w, axis=0)
        acc = acc * alpha + tl.sum(w[:, None] * o, axis=0)
        m = m_new
    res = acc / tl.where(den > 0, den, 1.0)
    tl.store(out_ptr + b.to(tl.int64) * s_outb + hq * s_outh + dd, res.to(out_ptr.dtype.element_ty), mask=dd < D)


def _check_decode(q, k_pages, v_pages, block_table, qlen, k16, v16, len16, plan):
    fmt = k_pages.fmt
    B, hq, d = q.shape
    dev = q.device
    if fmt.bits != 2 or fmt.groups != 1:
        raise ValueError(f"the Triton decode kernel supports bits=2 with one group per row (G = d); got bits="
                         f"{fmt.bits}, group_size={fmt.group_size}: use the reference (backend='reference')")
    check_kv_formats(k_pages, v_pages)
    if d != fmt.head_dim or hq % fmt.num_kv_heads:
        raise ValueError(f"q [B, Hq, d] = {tuple(q.shape)} does not fit the pages (d={fmt.head_dim}, "
                         f"Hkv={fmt.num_kv_heads})")
    if d < 64 or d & (d - 1):
        raise ValueError(f"the Triton decode kernel needs head_dim a power of two >= 64, got {d}: use the "
                         "reference (backend='reference')")
    for name, t in (("block_table", block_table), ("qlen", qlen), ("len16", len16)):
        check_device(name, t, dev)
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {t.dtype}")
    if qlen.shape != (B,) or len16.shape != (B,) or block_table.shape[0] < B:
        raise ValueError("qlen and len16 must be [B]; block_table [>= B, max_pages]")
    if k16.shape != v16.shape or k16.ndim != 4 or k16.shape[0] < B or k16.shape[1] != fmt.num_kv_heads \
            or k16.shape[3] != d or k16.stride(3) != 1 or v16.stride() != k16.stride():
        raise ValueError(f"k16/v16 must be [B, Hkv, C16, d] with unit last stride, got {tuple(k16.shape)}")
    check_pool_strides(k_pages, v_pages, dev)
    if plan.batch != B or plan.num_q_heads != hq or plan.head_dim != d or plan.page_size != fmt.page_size:
        raise ValueError(f"plan (batch {plan.batch}, Hq {plan.num_q_heads}, d {plan.head_dim}, page "
                         f"{plan.page_size}) does not match this call (B {B}, Hq {hq}, d {d}, page "
                         f"{fmt.page_size}): call plan.update(batch)")
    if plan.max_pages < block_table.shape[1] or plan.max_len16 < k16.shape[2]:
        raise ValueError("the plan was built for fewer pages or a smaller 16-bit tier than this call")


def decode_attention_triton(
    q: Tensor, k_pages: QuantPages, v_pages: QuantPages, block_table: Tensor, qlen: Tensor,
    k16: Tensor, v16: Tensor, len16: Tensor, sm_scale: float | None = None, *,
    plan: DecodePlan | None = None, out: Tensor | None = None, mma: bool | None = None,
    num_warps: int | None = None, num_stages: int = 2, qsplit: bool = False, kfold: str = "query",
    maxnreg: int | None = None,
) -> Tensor:
    """Decode attention; see :func:`oscarkv.kernels.reference.decode_attention_ref` for the semantics.

    ``plan``: a :class:`DecodePlan` (``plan.update(B)`` done); built on the fly when None (not graph-safe).
    ``out``: optional ``[B, Hq, d]`` output (dtype of q by default). ``mma``: tensor cores (default when
    the GQA group has at least 4 heads) or float32 CUDA cores. No host synchronisation.

    Keys may be in channel pages (``k_pages.fmt.layout == "channel"``): per page the scale is folded into the
    query (one ``d``-vector multiply) and the offset enters as one dot ``q . o``; every page holding a live
    2-bit token must have been written whole (as the write path enforces). ``kfold="dequant"`` turns the code
    tiles into float16 dequantized keys instead (tensor-core path only; keys must fit float16, a speed variant).
    ``maxnreg``: register cap per thread (0 = none); by default 168 for channel pages on the tensor-core path at
    d = 128 with 4 warps, where ptxas would take 174-221 (2 CTAs per SM instead of the token path's 3 at 168)
    and 168 fits without spills (sm_90, cuobjdump).
    """
    if kfold not in ("query", "dequant"):
        raise ValueError(f"kfold must be 'query' or 'dequant', got {kfold!r}")
    B, hq, d = q.shape
    fmt = k_pages.fmt
    if plan is None:
        plan = DecodePlan(B, hq, fmt.num_kv_heads, d, fmt.page_size, block_table.shape[1], k16.shape[2],
                          device=q.device)
    _check_decode(q, k_pages, v_pages, block_table, qlen, k16, v16, len16, plan)
    if q.stride(2) != 1:
        q = q.contiguous()
    g = hq // fmt.num_kv_heads
    mma = g >= 4 if mma is None else mma
    gp = max(16, next_pow2(g)) if mma else next_pow2(g)
    if out is None:
        out = torch.empty(B, hq, d, dtype=q.dtype, device=q.device)
    o, lse = plan.o_part, plan.lse_part
    asm = not interpreting()
    kch = (2 if kfold == "dequant" else 1) if fmt.channel else 0
    nw = num_warps or (4 if mma else 8)
    if maxnreg is None:
        maxnreg = 168 if kch and mma and nw == 4 and d == 128 else 0
    cap = {"maxnreg": maxnreg} if maxnreg else {}
    grid = (plan.num_splits, B * fmt.num_kv_heads)
    _decode_split_kernel[grid](
        q, q.stride(0), q.stride(1), k_pages.codes, k_pages.scale, k_pages.offset, v_pages.codes,
        v_pages.scale, v_pages.offset, *pool_strides(k_pages), v_pages.scale.stride(0), v_pages.scale.stride(1),
        block_table, block_table.stride(0), qlen, k16, v16, k16.stride(0),
        k16.stride(1), k16.stride(2), len16, o, lse, o.stride(0), o.stride(1), o.stride(2), lse.stride(0),
        lse.stride(1), fmt.num_kv_heads, float(d**-0.5 if sm_scale is None else sm_scale),
        plan.pages_per_split, plan.num_qsplits, plan.tokens16_per_split, *plan.split_granule,
        G=g, GP=gp, GP16=max(16, next_pow2(g)), D=d, DP=next_pow2(d), PS=fmt.page_size, BLOCK_N=plan.block_n,
        BLOCK_16=32, MMA=mma, ASM=asm, QSPLIT=qsplit, KCH=kch, num_warps=nw, num_stages=num_stages, **cap,
    )
    _merge_kernel[(B * hq,)](
        o, lse, out, o.stride(0), o.stride(1), o.stride(2), lse.stride(0), lse.stride(1), out.stride(0),
        out.stride(1), hq, plan.num_splits, D=d, DP=next_pow2(d), SB=16, num_warps=4,
    )
    return out


__all__ = ["decode_attention_triton"]
