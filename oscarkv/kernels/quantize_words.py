"""Triton device functions of the 16-bit-row quantize kernel (:mod:`oscarkv.kernels.quantize_fast16`): 16-bit
rows held as 32-bit words (two elements each, the even one in the low half), packed min/max, the unique
order-preserving clip keys and their extraction steps, exact code thresholds in the input domain and the packed
codes. Each inline-assembly helper has a plain-Triton twin with the same result, used in the CPU interpreter
(``INTERP``), so the interpreter tests check the arithmetic of the GPU path. Bit-exact with
:func:`oscarkv.quant.quantize`."""

from __future__ import annotations

import triton
import triton.language as tl

from .quantize_math import _from16, _round_meta


@triton.jit
def _threshold64(s, k: tl.constexpr):
    """:func:`_threshold` without a search: ``RN(RN(a / s) + 0.5) >= k`` iff ``RN(a / s) >= u_k`` iff the real
    quotient ``a / s`` reaches the rounding boundary ``b_k`` below ``u_k`` (half an ulp below it; ``u_1 =
    pred(0.5)`` has an odd significand, so its tie rounds down and ``a / s`` must exceed ``b_1``). ``s * b_k`` is
    exact in float64 (24 + 25 significant bits), and the threshold is the smallest float32 at or above it (above
    it for ``k = 1``): one float64 product, one rounding and one compare instead of 2 to 7 divisions."""
    s64 = s.to(tl.float64)
    if k == 1:
        p = s64 * 0.4999999701976776 - s64 * 1.4901161193847656e-08  # u_1 = 0x3EFFFFFF, b_1 = u_1 - 2^-26
    elif k == 2:
        p = s64 * 1.5 - s64 * 5.9604644775390625e-08  # b_2 = 1.5 - 2^-24
    else:
        p = s64 * 2.5 - s64 * 1.1920928955078125e-07  # b_3 = 2.5 - 2^-23
    f = p.to(tl.float32)  # nearest; +inf beyond the float32 range (then never reached, as it should)
    if k == 1:
        up = f.to(tl.float64) <= p
    else:
        up = f.to(tl.float64) < p
    return tl.where(up, (f.to(tl.int32, bitcast=True) + 1).to(tl.float32, bitcast=True), f)


# 16-bit rows as 32-bit words (two elements each: the even one in the low half): conversions, keys and the
# inline-assembly chains of the "fast16" kernel. Every asm helper has a plain-Triton twin with the same
# result, used in the CPU interpreter (INTERP), so the interpreter tests check the arithmetic of the GPU path.
@triton.jit
def _w_lo(w, BF16: tl.constexpr):
    """float32 value of the low (even) 16-bit element of each word (:func:`_from16` reads only the low half)."""
    return _from16(w, BF16)


@triton.jit
def _w_hi(w, BF16: tl.constexpr):
    """float32 value of the high (odd) 16-bit element of each word."""
    if BF16:
        v = (w & -65536).to(tl.float32, bitcast=True)
    else:
        v = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return v


@triton.jit
def _h2max(a, b, BF16: tl.constexpr, MAX: tl.constexpr, INTERP: tl.constexpr):
    """Elementwise max (MAX) or min of the two 16-bit floats of words ``a`` and ``b``, as words: one packed
    instruction on the GPU (exact: the result is one of the inputs; finite rows)."""
    if INTERP:
        if MAX:
            lo = tl.maximum(_w_lo(a, BF16), _w_lo(b, BF16))
            hi = tl.maximum(_w_hi(a, BF16), _w_hi(b, BF16))
        else:
            lo = tl.minimum(_w_lo(a, BF16), _w_lo(b, BF16))
            hi = tl.minimum(_w_hi(a, BF16), _w_hi(b, BF16))
        r = (_f32_to16(hi, BF16) << 16) | _f32_to16(lo, BF16)
    else:
        if BF16:
            if MAX:
                r = tl.inline_asm_elementwise("max.bf16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.int32,
                                              is_pure=True, pack=1)
            else:
                r = tl.inline_asm_elementwise("min.bf16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.int32,
                                              is_pure=True, pack=1)
        else:
            if MAX:
                r = tl.inline_asm_elementwise("max.f16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.int32,
                                              is_pure=True, pack=1)
            else:
                r = tl.inline_asm_elementwise("min.f16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.int32,
                                              is_pure=True, pack=1)
    return r


@triton.jit
def _f32_to16(v, BF16: tl.constexpr):
    """16-bit pattern (int32 holding 0..0xFFFF) of a float32 that is an exact 16-bit float."""
    if BF16:
        r = (v.to(tl.int32, bitcast=True) >> 16) & 0xFFFF
    else:
        r = v.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return r


@triton.jit
def _subumin(acc, a, b, INTERP: tl.constexpr):
    """``umin(acc, a - b)`` (int32 in, unsigned compare): an asm chain so that the compiler keeps the linear
    order, which sm_90 executes as one fused add-min (VIADDMNMX) per element; LLVM turns plain min chains
    into trees (an add and half a 3-way min per element)."""
    if INTERP:
        r = tl.minimum(acc.to(tl.uint32, bitcast=True), (a - b).to(tl.uint32, bitcast=True)).to(tl.int32,
                                                                                                 bitcast=True)
    else:
        r = tl.inline_asm_elementwise("{ .reg .u32 t; sub.u32 t, $2, $3; min.u32 $0, $1, t; }", "=r,r,r,r",
                                      [acc, a, b], dtype=tl.int32, is_pure=True, pack=1)
    return r


# Two 16-bit lanes per 32-bit word (the windowed clip keys of "fast16" with win): sm_90 executes an add and a
# min on 16-bit lanes as one VIADDMNMX.U16x2, half the instructions per element of the int32 keys.
@triton.jit
def _pk_nkeys(w, nb2, top2, ne, C: tl.constexpr, TB: tl.constexpr, CLAMP: tl.constexpr,
              INTERP: tl.constexpr):
    """Complemented window keys ``~(v << TB | tag)`` of the two elements of words ``w``, one per 16-bit lane:
    ``v = max(p + nb, 0)``, ``p`` the bits of ``|x|``, ``nb2`` holding ``nb`` (int16) in both lanes; CLAMP:
    ``v = max(min(p, top) + nb, 0)``, ``top2`` holding ``top = VMAX - nb`` (``VMAX = 2^(16 - TB) - 1``), else
    the caller guarantees ``p + nb <= VMAX``. ``ne + C``: the complemented tags (``v << TB`` and the tags
    have disjoint bits, so one 32-bit multiply-add without borrow builds both lanes). The constant is added
    inside the asm: as a separate add, LLVM hoists the 32 tag words of a thread out of the row-block loop
    into registers."""
    if INTERP:
        nb = ((nb2 & 0xFFFF) ^ 0x8000) - 0x8000
        plo = w & 0x7FFF
        phi = (w >> 16) & 0x7FFF
        if CLAMP:
            top = ((top2 & 0xFFFF) ^ 0x8000) - 0x8000
            plo = tl.minimum(plo, top)
            phi = tl.minimum(phi, top)
        vlo = tl.maximum(plo + nb, 0)
        vhi = tl.maximum(phi + nb, 0)
        r = (ne + C) - ((vhi << (16 + TB)) | (vlo << TB))
    else:
        if CLAMP:
            r = tl.inline_asm_elementwise(
                "{ .reg .b32 p, z, t; mov.b32 z, 0; and.b32 p, $1, 0x7FFF7FFF; min.s16x2 p, p, $3; "
                f"add.s16x2 p, p, $2; max.s16x2 p, p, z; add.s32 t, $4, {C}; mad.lo.s32 $0, p, {-(1 << TB)}, t; }}",
                "=r,r,r,r,r", [w, nb2, top2, ne], dtype=tl.int32, is_pure=True, pack=1)
        else:
            r = tl.inline_asm_elementwise(
                "{ .reg .b32 p, z, t; mov.b32 z, 0; and.b32 p, $1, 0x7FFF7FFF; add.s16x2 p, p, $2; "
                f"max.s16x2 p, p, z; add.s32 t, $3, {C}; mad.lo.s32 $0, p, {-(1 << TB)}, t; }}", "=r,r,r,r",
                [w, nb2, ne], dtype=tl.int32, is_pure=True, pack=1)
    return r


@triton.jit
def _pk_add(a, b, INTERP: tl.constexpr):
    """Lane-wise ``a + b`` modulo 2^16."""
    if INTERP:
        r = (((a >> 16) + (b >> 16)) << 16) | ((a + b) & 0xFFFF)
    else:
        r = tl.inline_asm_elementwise("add.u16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.int32, is_pure=True,
                                      pack=1)
    return r


@triton.jit
def _pk_umin(a, b, INTERP: tl.constexpr):
    """Lane-wise unsigned minimum."""
    if INTERP:
        r = (tl.minimum((a >> 16) & 0xFFFF, (b >> 16) & 0xFFFF) << 16) | tl.minimum(a & 0xFFFF, b & 0xFFFF)
    else:
        r = _umin16x2(a, b)
    return r


@triton.jit
def _umin16x2(a, b):
    return tl.inline_asm_elementwise("min.u16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.int32, is_pure=True,
                                     pack=1)


@triton.jit
def _pk_addmin(acc, k, m2, INTERP: tl.constexpr):
    """Lane-wise ``umin(acc, k + m2)``: an asm chain (one VIADDMNMX.U16x2 per word), kept linear like
    :func:`_subumin`."""
    if INTERP:
        r = _pk_umin(acc, _pk_add(k, m2, True), True)
    else:
        r = tl.inline_asm_elementwise("{ .reg .b32 t; add.u16x2 t, $2, $3; min.u16x2 $0, $1, t; }", "=r,r,r,r",
                                      [acc, k, m2], dtype=tl.int32, is_pure=True, pack=1)
    return r


@triton.jit
def _pk_below(acc, w, l2, INTERP: tl.constexpr):
    """Lane-wise ``umin(acc, L - p)`` (modulo 2^16) for ``p`` the bits of ``|x|`` of the two elements of words
    ``w``, ``l2`` holding ``L + 1`` in both lanes: ``L - p`` is in ``[0, 0x7FFF]`` for ``p <= L`` and wraps to
    ``[0x8001, 0xFFFF]`` for ``p > L`` (``0 <= L, p <= 0x7FFF``), so the minimum over a row is ``L - q``,
    ``q = max{p <= L}`` (where the row has such a ``p``). ``L - p = (L + 1) + ~p`` and ``~p = ~w | 0x8000`` per
    lane: one LOP3 and one VIADDMNMX.U16x2 per word, in one asm block (``l2`` changes per window, so nothing is
    hoisted out of the redo loop)."""
    if INTERP:
        r = _pk_umin(acc, _pk_add(~w | -2147450880, l2, True), True)  # 0x80008000
    else:
        r = tl.inline_asm_elementwise(
            "{ .reg .b32 t; not.b32 t, $2; or.b32 t, t, 0x80008000; add.u16x2 t, t, $3; min.u16x2 $0, $1, t; }",
            "=r,r,r,r", [acc, w, l2], dtype=tl.int32, is_pure=True, pack=1)
    return r


@triton.jit
def _pk_rowmin2(a, INTERP: tl.constexpr):
    """Per-row minimum over both lanes of every word of ``a`` ``[rows, words]``, in both lanes of an int32:
    lane-wise across the thread's words and the row's threads, then against the swapped lanes."""
    if INTERP:
        y = tl.min(tl.minimum(a & 0xFFFF, (a >> 16) & 0xFFFF), axis=1)
        r = y * 65537
    else:
        r = tl.reduce(a, 1, _umin16x2)
        r = tl.inline_asm_elementwise("{ .reg .b32 t; prmt.b32 t, $1, 0, 0x1032; min.u16x2 $0, $1, t; }", "=r,r",
                                      [r], dtype=tl.int32, is_pure=True, pack=1)
    return r


@triton.jit
def _xthr(t, lo_s, BF16: tl.constexpr):
    """Smallest 16-bit float ``y`` with ``RN32(y - lo_s) >= t`` (the element test of the threshold code
    formulations; ``0 < t < inf``), as (float32 value, word holding its pattern in both halves).

    The set is an up-set (``RN32`` is monotone) whose real boundary is ``z = lo_s + b``, ``b`` the rounding
    boundary half a float32 ulp below ``t``. ``RN32(RN32(lo_s + t) - h)`` (``h`` that half ulp) is within a
    float32 ulp of ``z``, or exact where ``lo_s + t`` cancels (Sterbenz) - the common case ``lo = -tau``,
    ``scale = 2 tau / 3`` puts the code-2 boundary near 0, where 16-bit floats are dense. Neighbouring 16-bit
    floats are 2^13 (float16) or 2^16 (bfloat16) float32 ulps apart at any magnitude, so the answer is the
    16-bit float ``c`` nearest to that estimate, the one below ``c`` (if ``c`` passes) or the one above (if
    not): two exact float32 tests decide. Neighbours step an integer key (sign-magnitude as two's complement,
    both zeros 0) by one 16-bit ulp. Exhaustively cross-checked in tests/kernels/test_kernels_quantize.py."""
    g = t - (t.to(tl.int32, bitcast=True) - 1).to(tl.float32, bitcast=True)  # ulp of float32 below t (exact)
    z = (lo_s + t) - g * 0.5
    if BF16:  # bfloat16 values as float32 patterns (low half 0), one ulp = 0x10000
        b = z.to(tl.int32, bitcast=True)
        c = (b + 0x7FFF + ((b >> 16) & 1)) & -65536  # nearest even
        cf = c.to(tl.float32, bitcast=True)
        k = tl.where(c >= 0, c, -(c & 0x7FFFFFFF))
        ok = cf - lo_s >= t
        nk = k + tl.where(ok, -65536, 65536)
        nb = tl.where(nk >= 0, nk, (-nk) | -2147483648)
        nf = nb.to(tl.float32, bitcast=True)
        pick = ok & (nf - lo_s < t)  # c itself
        bits = tl.where(pick, c, nb)
        v = tl.where(pick, cf, nf)
        w = bits | ((bits >> 16) & 0xFFFF)
    else:  # float16 patterns, one ulp = 1
        c = z.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        cf = _from16(c, False)
        k = tl.where(c < 0x8000, c, -(c & 0x7FFF))
        ok = cf - lo_s >= t
        nk = k + tl.where(ok, -1, 1)
        nb = tl.where(nk >= 0, nk, (-nk) | 0x8000)
        nf = _from16(nb, False)
        pick = ok & (nf - lo_s < t)
        bits = tl.where(pick, c, nb)
        v = tl.where(pick, cf, nf)
        w = bits | (bits << 16)
    return v, w


@triton.jit
def _xeff(t, lo_s, tau, pos, BF16: tl.constexpr):
    """:func:`_eff` in the input domain, as a word holding a 16-bit threshold in both halves: codes count
    ``x >= B`` for ``B`` from :func:`_xthr`, with the clip folded in (``-inf`` when ``-tau`` already passes,
    ``+inf``, never reached by finite rows, when ``tau`` does not or the scale is 0)."""
    bv, bw = _xthr(t, lo_s, BF16)
    if BF16:
        ninf = -8323200  # 0xFF80FF80
        pinf = 0x7F807F80
    else:
        ninf = -67044352  # 0xFC00FC00
        pinf = 0x7C007C00
    return tl.where(pos & (bv <= tau), tl.where(bv <= -tau, ninf, bw), pinf)


@triton.jit
def _wcodes(w0, w1, w2, w3, b1, b2, b3, BF16: tl.constexpr, INTERP: tl.constexpr):
    """16-bit word ``byte(e) | byte(e + 1) << 8`` of the codes of the low and high elements of words
    ``w0..w3`` (one per quarter) against packed thresholds ``b1 <= b2 <= b3`` (monotone in the code, clip and
    zero scale folded in: :func:`_xeff`). Per quarter two packed compares (masks, two halves each): the code's
    high bit ``x >= b2``, then its low bit ``x >= (high ? b3 : b1)`` - a binary search that equals counting the
    three thresholds passed - or-ed into bits ``2j, 2j + 1`` of each half; one byte permute at the end."""
    if INTERP:  # the same binary search, one element at a time
        t1 = _w_lo(b1, BF16)
        t2 = _w_lo(b2, BF16)
        t3 = _w_lo(b3, BF16)
        lo = _xq(_w_lo(w0, BF16), t1, t2, t3) | (_xq(_w_lo(w1, BF16), t1, t2, t3) << 2) \
            | (_xq(_w_lo(w2, BF16), t1, t2, t3) << 4) | (_xq(_w_lo(w3, BF16), t1, t2, t3) << 6)
        hi = _xq(_w_hi(w0, BF16), t1, t2, t3) | (_xq(_w_hi(w1, BF16), t1, t2, t3) << 2) \
            | (_xq(_w_hi(w2, BF16), t1, t2, t3) << 4) | (_xq(_w_hi(w3, BF16), t1, t2, t3) << 6)
        r = lo | (hi << 8)
    else:
        if BF16:
            r = tl.inline_asm_elementwise(_WCODES_BF16, "=r,r,r,r,r,r,r,r", [w0, w1, w2, w3, b1, b2, b3],
                                          dtype=tl.int32, is_pure=True, pack=1)
        else:
            r = tl.inline_asm_elementwise(_WCODES_F16, "=r,r,r,r,r,r,r,r", [w0, w1, w2, w3, b1, b2, b3],
                                          dtype=tl.int32, is_pure=True, pack=1)
    return r


@triton.jit
def _xq(x, t1, t2, t3):
    """Code of float32 ``x`` by the binary search of :func:`_wcodes`."""
    up = x >= t2
    return tl.where(up, 2, 0) + (x >= tl.where(up, t3, t1)).to(tl.int32)


def _wcodes_asm(ty: str) -> str:
    """PTX of :func:`_wcodes`: $1..$4 the quarters' words, $5..$7 the thresholds; lop3 0xCA = a ? b : c."""
    body = []
    for j in range(4):
        body.append(f"set.ge.u32.{ty} h, ${j + 1}, $6; lop3.b32 t, h, $7, $5, 0xCA; set.ge.u32.{ty} l, ${j + 1}, t; "
                    f"and.b32 l, l, {0x00010001 << 2 * j:#010x}; and.b32 h, h, {0x00020002 << 2 * j:#010x}; "
                    + ("or.b32 a, l, h; " if j == 0 else "or.b32 a, a, l; or.b32 a, a, h; "))
    return "{ .reg .b32 h, l, t, a; " + "".join(body) + "prmt.b32 $0, a, 0, 0x4420; }"


_WCODES_BF16 = tl.constexpr(_wcodes_asm("bf16x2"))
_WCODES_F16 = tl.constexpr(_wcodes_asm("f16x2"))


@triton.jit
def _group_params_x(lo, hi, tau, META: tl.constexpr, BF16: tl.constexpr):
    """Stored scale and offset of a 2-bit row (one group) of 16-bit elements from its unclipped range (clamping
    commutes with min/max), and the three code thresholds in the input domain (:func:`_xeff`, packed words; the
    exact thresholds of :func:`_threshold64`), the clip and the zero-scale rule folded in."""
    lo_c = tl.minimum(tl.maximum(lo, -tau), tau)
    hi_c = tl.minimum(tl.maximum(hi, -tau), tau)
    sc = _round_meta(tl.math.div_rn(hi_c - lo_c, tl.full(lo.shape, 3.0, tl.float32)), META)
    lo_s = _round_meta(lo_c, META)
    pos = sc > 0.0
    ss = tl.where(pos, sc, 1.0)
    t1 = _threshold64(ss, 1)
    t2 = _threshold64(ss, 2)
    t3 = _threshold64(ss, 3)
    return sc, lo_s, _xeff(t1, lo_s, tau, pos, BF16), _xeff(t2, lo_s, tau, pos, BF16), _xeff(t3, lo_s, tau, pos, BF16)
