"""Triton device functions of the quantize kernels (:mod:`oscarkv.kernels.quantize_triton`): float conversions
and metadata rounding, exact per-row code thresholds, per-row reductions over a row's four column quarters, the
clip order statistic (unique-key extraction, tie-counting extraction, bisection, bitonic sort), and the
per-group scale/offset and codes. Everything is float32 and bit-exact with :func:`oscarkv.quant.quantize`
(docs/kernels.md, "Quantize / pack / write")."""

from __future__ import annotations

import triton
import triton.language as tl

# RN(u + 0.5) >= 1 exactly from u >= pred(0.5); >= k (k >= 2) from u >= k - 1/2 (tests check both boundaries)
_U1 = tl.constexpr(0.4999999701976776)  # float32 0x3EFFFFFF


@triton.jit
def _to_f32(raw):
    """16/32-bit float tensor -> float32; bfloat16 by a shift (what the hardware does; the interpreter's
    conversion mangles subnormals)."""
    if raw.dtype == tl.bfloat16:
        r = (raw.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        r = raw.to(tl.float32)
    return r


@triton.jit
def _store_meta(ptr, v, mask):
    """Store float32 ``v``, already rounded to the metadata dtype (bfloat16 by its high half, see _to_f32)."""
    if ptr.dtype.element_ty == tl.bfloat16:
        tl.store(ptr, (v.to(tl.int32, bitcast=True) >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True), mask=mask)
    else:
        tl.store(ptr, v.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _round_meta(x, META: tl.constexpr):
    """Round float32 ``x`` to the metadata dtype (nearest even), returned as float32."""
    if META == 0:
        r = x.to(tl.float16).to(tl.float32)
    elif META == 1:
        # bfloat16 by integer rounding: the interpreter truncates float32 -> bfloat16 casts
        b = x.to(tl.int32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
        r = b.to(tl.float32, bitcast=True)
    else:
        r = x
    return r


@triton.jit
def _threshold(s, k: tl.constexpr):
    """Smallest float ``a`` with ``RN(RN(a / s) + 0.5) >= k`` (``s > 0``, ``k >= 1``). Codes are then
    ``sum_k (x - lo >= T_k)``, identical to ``floor(div_rn(x - lo, s) + 0.5)`` clamped (both sides are monotone
    in ``x - lo``) but with a few divisions per row instead of one per element. Bitwise binary search within
    +-64 ulps of ``(k - 0.5) s``; exhaustively checked for every float16 and bfloat16 scale (docs/kernels.md)."""
    b0 = (s * (k - 0.5)).to(tl.int32, bitcast=True)
    lo = tl.maximum(b0 - 64, 0)
    hi = b0 + 64
    for _ in tl.static_range(7):
        mid = lo + ((hi - lo) >> 1)  # (lo + hi) would overflow int32 for floats >= 2
        ok = tl.math.div_rn(mid.to(tl.float32, bitcast=True), s) + 0.5 >= k
        hi = tl.where(ok, mid, hi)
        lo = tl.where(ok, lo, mid)
    return hi.to(tl.float32, bitcast=True)


@triton.jit
def _threshold8(s, k: tl.constexpr, META: tl.constexpr):
    """:func:`_threshold` with 2 probes (3 for float32 scales) instead of 7: the threshold lies within one ulp
    of ``p = RN(u_k s)`` (``u_k`` = the smallest ``u`` with ``RN(u + 0.5) >= k``), so the search covers
    ``(p - 2, p + 2]`` ulps (``(p - 5, p + 3]`` for float32). Checked exhaustively for every float16 and
    bfloat16 scale, and on float32 samples (tests/kernels/test_kernels_quantize.py)."""
    if k == 1:
        u = _U1
    else:
        u = k - 0.5
    c = (s * u).to(tl.int32, bitcast=True)  # a multiply alone (nothing to contract with), IEEE on the GPU
    if META == 2:
        lo = tl.maximum(c - 5, 0)  # the predicate is false at lo (a = 0 gives code 0) ...
        hi = tl.minimum(c + 3, 0x7F800000)  # ... and true at hi (+inf at most)
        for _ in tl.static_range(3):
            mid = lo + ((hi - lo) >> 1)
            ok = tl.math.div_rn(mid.to(tl.float32, bitcast=True), s) + 0.5 >= k
            hi = tl.where(ok, mid, hi)
            lo = tl.where(ok, lo, mid)
    else:
        lo = tl.maximum(c - 2, 0)
        hi = tl.minimum(c + 2, 0x7F800000)
        for _ in tl.static_range(2):
            mid = lo + ((hi - lo) >> 1)
            ok = tl.math.div_rn(mid.to(tl.float32, bitcast=True), s) + 0.5 >= k
            hi = tl.where(ok, mid, hi)
            lo = tl.where(ok, lo, mid)
    return hi.to(tl.float32, bitcast=True)


# ------------------------------------------------------------------------------ row reductions over 4 quarters
@triton.jit
def _max4(a, b, c, d):
    return tl.max(tl.maximum(tl.maximum(a, b), tl.maximum(c, d)), axis=1)


@triton.jit
def _min4(a, b, c, d):
    return tl.min(tl.minimum(tl.minimum(a, b), tl.minimum(c, d)), axis=1)


@triton.jit
def _cnt4(a, b, c, d):
    """Per-row count of true elements of four boolean tensors, as float32 (compiles to FSET + FADD)."""
    return tl.sum(tl.where(a, 1.0, 0.0) + tl.where(b, 1.0, 0.0) + tl.where(c, 1.0, 0.0) + tl.where(d, 1.0, 0.0),
                  axis=1)


@triton.jit
def _umin4(a, b, c, d):
    """Per-row minimum of four int32/float32 tensors compared as unsigned bit patterns (negatives last)."""
    u = tl.minimum(tl.minimum(a.to(tl.uint32, bitcast=True), b.to(tl.uint32, bitcast=True)),
                   tl.minimum(c.to(tl.uint32, bitcast=True), d.to(tl.uint32, bitcast=True)))
    return tl.min(u, axis=1)


# ----------------------------------------------------------------------------------- clip order statistic
@triton.jit
def _key16(raw, e):
    """Unique order-preserving key of each element of a 16-bit row: ``2^23 + (|x| bits << 8 | index)``, a float
    holding an exact integer below 2^24, so that key differences are exact float subtractions."""
    b = raw.to(tl.int16, bitcast=True).to(tl.int32)
    return (((b << 8) & 0x7FFF00) | (0x4B000000 | e)[None, :]).to(tl.float32, bitcast=True)


@triton.jit
def _from16(a16, BF16: tl.constexpr):
    """float32 value of 16-bit float bit patterns (int32 holding 0..0xFFFF)."""
    if BF16:
        v = (a16 << 16).to(tl.float32, bitcast=True)
    else:
        v = a16.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return v


@triton.jit
def _tau_key16(r0, r1, r2, r3, x0, x1, x2, x3, cols, cmask, mode, n, idx, DQ: tl.constexpr, PADC: tl.constexpr):
    """``idx``-th smallest ``|x|`` of rows that are exact 16-bit floats (``r_j``: the raw quarters, ``x_j``
    their float32 values). mode 1: the max key, then ``n = d-1-idx`` steps ``m <- max{key < m}``; mode 2: the
    min key, then ``n = idx`` steps ``m <- min{key > m}``; unique keys (index in the low bits) make ties cost
    nothing. One step is one float subtraction and one unsigned min per element. mode 3: bisection on the 15
    bits of ``|x|`` (count the elements below a candidate, 15 passes)."""
    BF16: tl.constexpr = r0.dtype == tl.bfloat16
    if mode == 3:
        nan = float("nan")  # never below a candidate
        a0 = tl.where(cmask[None, :], tl.abs(x0), nan)
        a1 = tl.where(cmask[None, :], tl.abs(x1), nan)
        a2 = tl.where(cmask[None, :], tl.abs(x2), nan)
        a3 = tl.where(cmask[None, :], tl.abs(x3), nan)
        a16 = tl.zeros([r0.shape[0]], tl.int32)
        for b in tl.static_range(14, -1, -1):
            cand = _from16(a16 | (1 << b), BF16)[:, None]  # inf/NaN patterns are never reached (finite rows)
            cnt = _cnt4(a0 < cand, a1 < cand, a2 < cand, a3 < cand)
            a16 = tl.where(cnt <= idx, a16 | (1 << b), a16)
    else:
        k0 = _key16(r0, cols)
        k1 = _key16(r1, cols + DQ)
        k2 = _key16(r2, cols + 2 * DQ)
        k3 = _key16(r3, cols + 3 * DQ)
        if mode == 1:
            if PADC:  # below every real key (2^23 + 0)
                k0 = tl.where(cmask[None, :], k0, 8388607.0)
                k1 = tl.where(cmask[None, :], k1, 8388607.0)
                k2 = tl.where(cmask[None, :], k2, 8388607.0)
                k3 = tl.where(cmask[None, :], k3, 8388607.0)
            m = _max4(k0, k1, k2, k3)
            for _ in range(n):
                c = (m - 1.0)[:, None]
                y = _umin4(c - k0, c - k1, c - k2, c - k3)  # smallest c - key >= 0
                m = m - 1.0 - y.to(tl.float32, bitcast=True)
        else:
            if PADC:  # above every real key (< 2^24)
                k0 = tl.where(cmask[None, :], k0, 16777216.0)
                k1 = tl.where(cmask[None, :], k1, 16777216.0)
                k2 = tl.where(cmask[None, :], k2, 16777216.0)
                k3 = tl.where(cmask[None, :], k3, 16777216.0)
            m = _min4(k0, k1, k2, k3)
            for _ in range(n):
                c = (m + 1.0)[:, None]
                y = _umin4(k0 - c, k1 - c, k2 - c, k3 - c)  # smallest key - c >= 0
                m = m + 1.0 + y.to(tl.float32, bitcast=True)
        a16 = (m.to(tl.int32, bitcast=True) - 0x4B000000) >> 8
    return _from16(a16, BF16)


@triton.jit
def _tau_f32(x0, x1, x2, x3, cmask, mode, n, idx, PADC: tl.constexpr):
    """``idx``-th smallest ``|x|`` of float32 rows, on the bits ``a`` of ``|x|`` (monotone for non-negative
    floats). mode 1: top-down over distinct values with tie counts, ``m <- max{a < m}``, until
    ``#{a >= m} > n`` (``n = d-1-idx``, at most ``n`` steps); mode 2: bottom-up, ``m <- min{a > m}`` until
    ``#{a <= m} > idx``; mode 3: 31-pass bisection, the largest ``t`` with ``#{a < t} <= idx``. Counts compare
    the floats themselves; padding columns are NaN there, so they are never counted."""
    a0 = x0.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    a1 = x1.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    a2 = x2.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    a3 = x3.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    if mode == 1:
        if PADC:  # below every |x| (NaN as a float)
            a0 = tl.where(cmask[None, :], a0, -1)
            a1 = tl.where(cmask[None, :], a1, -1)
            a2 = tl.where(cmask[None, :], a2, -1)
            a3 = tl.where(cmask[None, :], a3, -1)
    elif PADC:  # above every |x| and never below a candidate (NaN as a float)
        a0 = tl.where(cmask[None, :], a0, 0x7FFFFFFF)
        a1 = tl.where(cmask[None, :], a1, 0x7FFFFFFF)
        a2 = tl.where(cmask[None, :], a2, 0x7FFFFFFF)
        a3 = tl.where(cmask[None, :], a3, 0x7FFFFFFF)
    f0 = a0.to(tl.float32, bitcast=True)
    f1 = a1.to(tl.float32, bitcast=True)
    f2 = a2.to(tl.float32, bitcast=True)
    f3 = a3.to(tl.float32, bitcast=True)
    if mode == 3:
        m = tl.zeros([x0.shape[0]], tl.int32)
        for b in tl.static_range(30, -1, -1):
            cand = (m | (1 << b)).to(tl.float32, bitcast=True)[:, None]  # NaN patterns are never reached
            cnt = _cnt4(f0 < cand, f1 < cand, f2 < cand, f3 < cand)
            m = tl.where(cnt <= idx, m | (1 << b), m)
    elif mode == 1:
        m = _max4(a0, a1, a2, a3)
        mf = m.to(tl.float32, bitcast=True)[:, None]
        cnt = _cnt4(f0 == mf, f1 == mf, f2 == mf, f3 == mf)
        for _ in range(n):
            c = m - 1
            cc = c[:, None]
            m2 = c - _umin4(cc - a0, cc - a1, cc - a2, cc - a3).to(tl.int32, bitcast=True)
            mf = m2.to(tl.float32, bitcast=True)[:, None]
            c2 = _cnt4(f0 == mf, f1 == mf, f2 == mf, f3 == mf)
            done = cnt > n
            m = tl.where(done, m, m2)
            cnt = tl.where(done, cnt, cnt + c2)
    else:
        m = _min4(a0, a1, a2, a3)
        mf = m.to(tl.float32, bitcast=True)[:, None]
        cnt = _cnt4(f0 == mf, f1 == mf, f2 == mf, f3 == mf)
        for _ in range(n):
            c = m + 1
            cc = c[:, None]
            m2 = c + _umin4(a0 - cc, a1 - cc, a2 - cc, a3 - cc).to(tl.int32, bitcast=True)
            mf = m2.to(tl.float32, bitcast=True)[:, None]
            c2 = _cnt4(f0 == mf, f1 == mf, f2 == mf, f3 == mf)
            done = cnt > n
            m = tl.where(done, m, m2)
            cnt = tl.where(done, cnt, cnt + c2)
    return m.to(tl.float32, bitcast=True)


@triton.jit
def _tau_sort(x0, x1, x2, x3, cmask, idx, CP: tl.constexpr):
    """``idx``-th smallest ``|x|`` by a bitonic sort of the whole row (slow; an independent cross-check)."""
    inf = float("inf")
    a0 = tl.where(cmask[None, :], tl.abs(x0), inf)
    a1 = tl.where(cmask[None, :], tl.abs(x1), inf)
    a2 = tl.where(cmask[None, :], tl.abs(x2), inf)
    a3 = tl.where(cmask[None, :], tl.abs(x3), inf)
    row = tl.reshape(tl.join(tl.join(a0, a1), tl.join(a2, a3)), (x0.shape[0], 4 * CP))
    srt = tl.sort(row, dim=1)
    col = tl.arange(0, 4 * CP)
    return tl.max(tl.where(col[None, :] == idx, srt, -1.0), axis=1)


# ------------------------------------------------------------------------------------ metadata and codes
@triton.jit
def _eff(t, vl, vh, pos):
    """Threshold ``t`` on ``v(clamp(x))`` turned into one on ``v(x)`` (``v`` monotone, ``vl = v(-tau)``,
    ``vh = v(tau)``): never (NaN) when ``vh < t`` or the scale is 0, always (-inf) when ``vl >= t``."""
    return tl.where(pos & (vh >= t), tl.where(vl >= t, float("-inf"), t), float("nan"))


@triton.jit
def _group_params(lo, hi, tau, META: tl.constexpr, LEVELS: tl.constexpr, CODES: tl.constexpr):
    """Stored scale and offset of one group from its unclipped range (clamping commutes with min/max), and the
    per-row code thresholds ``p1..p3`` (CODES 0/2/3/4) or code bounds ``[p1, p2]`` (CODES 1) that also apply the
    clip and the zero-scale rule, so that the per-element work needs no clamp and no select."""
    lo_c = tl.minimum(tl.maximum(lo, -tau), tau)
    hi_c = tl.minimum(tl.maximum(hi, -tau), tau)
    sc = _round_meta(tl.math.div_rn(hi_c - lo_c, tl.full(lo.shape, LEVELS, tl.float32)), META)
    lo_s = _round_meta(lo_c, META)
    pos = sc > 0.0
    ssafe = tl.where(pos, sc, 1.0)
    vl = -tau - lo_s
    vh = tau - lo_s
    if CODES < 2:
        vl = tl.math.div_rn(vl, ssafe)
        vh = tl.math.div_rn(vh, ssafe)
    if CODES == 1:
        top = LEVELS * 1.0
        p1 = tl.where(pos, tl.minimum(tl.maximum(tl.floor(vl + 0.5), 0.0), top), 0.0)
        p2 = tl.where(pos, tl.minimum(tl.maximum(tl.floor(vh + 0.5), 0.0), top), 0.0)
        p3 = p2
    elif CODES == 0:
        p1 = _eff(_U1, vl, vh, pos)
        p2 = _eff(1.5, vl, vh, pos)
        p3 = _eff(2.5, vl, vh, pos)
    elif CODES == 2:
        p1 = _eff(_threshold(ssafe, 1), vl, vh, pos)
        p2 = _eff(_threshold(ssafe, 2), vl, vh, pos)
        p3 = _eff(_threshold(ssafe, 3), vl, vh, pos)
    elif CODES == 3:
        p1 = _eff(_threshold8(ssafe, 1, META), vl, vh, pos)
        p2 = _eff(_threshold8(ssafe, 2, META), vl, vh, pos)
        p3 = _eff(_threshold8(ssafe, 3, META), vl, vh, pos)
    else:
        p1 = _eff(_threshold64(ssafe, 1), vl, vh, pos)
        p2 = _eff(_threshold64(ssafe, 2), vl, vh, pos)
        p3 = _eff(_threshold64(ssafe, 3), vl, vh, pos)
    return sc, lo_s, ssafe, p1, p2, p3


@triton.jit
def _codes(x, lo_s, ssafe, p1, p2, p3, CODES: tl.constexpr):
    """Codes (as float) of unclipped float32 elements ``x``: ``v = div_rn(x - lo_s, s)`` (CODES 0/1) or
    ``v = x - lo_s`` (CODES 2/3/4) against the group's thresholds or bounds."""
    v = x - lo_s[:, None]
    if CODES < 2:
        v = tl.math.div_rn(v, ssafe[:, None])
    if CODES == 1:
        q = tl.minimum(tl.maximum(tl.floor(v + 0.5), p1[:, None]), p2[:, None])
    else:
        # float selects compile to FSET.BF + FADD (bool casts became integer select chains, ~2x the code)
        q = tl.where(v >= p1[:, None], 1.0, 0.0) + tl.where(v >= p2[:, None], 1.0, 0.0) \
            + tl.where(v >= p3[:, None], 1.0, 0.0)
    return q


@triton.jit
def _part_range(x, lo, hi, cols, cmask, J: tl.constexpr, GI: tl.constexpr, DQ: tl.constexpr, G: tl.constexpr):
    """Fold quarter ``J``'s elements of group ``GI`` into the running group min/max (groups < d only)."""
    if (J * DQ) // G <= GI:  # nested constexpr ifs: the quarter overlaps the group
        if GI <= (J * DQ + DQ - 1) // G:
            m = (((J * DQ + cols) // G) == GI) & cmask
            lo = tl.minimum(lo, tl.min(tl.where(m[None, :], x, float("inf")), axis=1))
            hi = tl.maximum(hi, tl.max(tl.where(m[None, :], x, float("-inf")), axis=1))
    return lo, hi


@triton.jit
def _part_codes(q, x, cols, lo_s, ssafe, p1, p2, p3, J: tl.constexpr, GI: tl.constexpr, DQ: tl.constexpr,
                G: tl.constexpr, CODES: tl.constexpr):
    """Add group ``GI``'s codes of quarter ``J`` to ``q`` (groups < d only)."""
    if (J * DQ) // G <= GI:
        if GI <= (J * DQ + DQ - 1) // G:
            c = _codes(x, lo_s, ssafe, p1, p2, p3, CODES)
            if (J * DQ) // G == (J * DQ + DQ - 1) // G:  # the whole quarter is in this group
                q = q + c
            else:
                q = q + tl.where((((J * DQ + cols) // G) == GI)[None, :], c, 0.0)
    return q



# ------------------------------------------------------------------- 16-bit fast path (kernel "fast16")
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
def _group_params_x(lo, hi, tau, META: tl.constexpr, CODES: tl.constexpr, BF16: tl.constexpr):
    """:func:`_group_params` (2-bit, one group per row) for 16-bit rows, with the code thresholds in the input
    domain (:func:`_xeff`, packed words) instead of on ``v = x - lo_s``."""
    lo_c = tl.minimum(tl.maximum(lo, -tau), tau)
    hi_c = tl.minimum(tl.maximum(hi, -tau), tau)
    sc = _round_meta(tl.math.div_rn(hi_c - lo_c, tl.full(lo.shape, 3.0, tl.float32)), META)
    lo_s = _round_meta(lo_c, META)
    pos = sc > 0.0
    ss = tl.where(pos, sc, 1.0)
    if CODES == 4:
        t1 = _threshold64(ss, 1)
        t2 = _threshold64(ss, 2)
        t3 = _threshold64(ss, 3)
    elif CODES == 3:
        t1 = _threshold8(ss, 1, META)
        t2 = _threshold8(ss, 2, META)
        t3 = _threshold8(ss, 3, META)
    else:
        t1 = _threshold(ss, 1)
        t2 = _threshold(ss, 2)
        t3 = _threshold(ss, 3)
    return sc, lo_s, _xeff(t1, lo_s, tau, pos, BF16), _xeff(t2, lo_s, tau, pos, BF16), _xeff(t3, lo_s, tau, pos, BF16)
