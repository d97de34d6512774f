"""Triton device functions of the quantize kernels (:mod:`oscarkv.kernels.quantize_triton`): float conversions
and metadata rounding, exact per-row code thresholds, per-row reductions over a row's four column quarters, the
clip order statistic (unique-key extraction, tie-counting extraction, bisection), and the
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


# ------------------------------------------------------------------------------------ metadata and codes
@triton.jit
def _eff(t, vl, vh, pos):
    """Threshold ``t`` on ``v(clamp(x))`` turned into one on ``v(x)`` (``v`` monotone, ``vl = v(-tau)``,
    ``vh = v(tau)``): never (NaN) when ``vh < t`` or the scale is 0, always (-inf) when ``vl >= t``."""
    return tl.where(pos & (vh >= t), tl.where(vl >= t, float("-inf"), t), float("nan"))


@triton.jit
def _group_params(lo, hi, tau, META: tl.constexpr, LEVELS: tl.constexpr, CODES: tl.constexpr):
    """Stored scale and offset of one group from its unclipped range (clamping commutes with min/max), and the
    per-row code thresholds ``p1..p3`` (CODES 3: 2-bit) or code bounds ``[p1, p2]`` (CODES 1: 4-bit) that also
    apply the clip and the zero-scale rule, so that the per-element work needs no clamp and no select."""
    lo_c = tl.minimum(tl.maximum(lo, -tau), tau)
    hi_c = tl.minimum(tl.maximum(hi, -tau), tau)
    sc = _round_meta(tl.math.div_rn(hi_c - lo_c, tl.full(lo.shape, LEVELS, tl.float32)), META)
    lo_s = _round_meta(lo_c, META)
    pos = sc > 0.0
    ssafe = tl.where(pos, sc, 1.0)
    vl = -tau - lo_s
    vh = tau - lo_s
    if CODES == 1:  # 4-bit: code bounds from the clip range, the codes by one division per element
        vl = tl.math.div_rn(vl, ssafe)
        vh = tl.math.div_rn(vh, ssafe)
        top = LEVELS * 1.0
        p1 = tl.where(pos, tl.minimum(tl.maximum(tl.floor(vl + 0.5), 0.0), top), 0.0)
        p2 = tl.where(pos, tl.minimum(tl.maximum(tl.floor(vh + 0.5), 0.0), top), 0.0)
        p3 = p2
    else:  # 2-bit: three exact thresholds per row (CODES 3)
        p1 = _eff(_threshold8(ssafe, 1, META), vl, vh, pos)
        p2 = _eff(_threshold8(ssafe, 2, META), vl, vh, pos)
        p3 = _eff(_threshold8(ssafe, 3, META), vl, vh, pos)
    return sc, lo_s, ssafe, p1, p2, p3


@triton.jit
def _codes(x, lo_s, ssafe, p1, p2, p3, CODES: tl.constexpr):
    """Codes (as float) of unclipped float32 elements ``x``: ``v = div_rn(x - lo_s, s)`` against the bounds
    (CODES 1) or ``v = x - lo_s`` against the thresholds (CODES 3) of the group."""
    v = x - lo_s[:, None]
    if CODES == 1:
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
    if (J * DQ) // G <= GI:  # noqa: SIM102 - nested constexpr ifs: the quarter overlaps the group
        if GI <= (J * DQ + DQ - 1) // G:
            m = (((J * DQ + cols) // G) == GI) & cmask
            lo = tl.minimum(lo, tl.min(tl.where(m[None, :], x, float("inf")), axis=1))
            hi = tl.maximum(hi, tl.max(tl.where(m[None, :], x, float("-inf")), axis=1))
    return lo, hi


@triton.jit
def _part_codes(q, x, cols, lo_s, ssafe, p1, p2, p3, J: tl.constexpr, GI: tl.constexpr, DQ: tl.constexpr,
                G: tl.constexpr, CODES: tl.constexpr):
    """Add group ``GI``'s codes of quarter ``J`` to ``q`` (groups < d only)."""
    if (J * DQ) // G <= GI:  # noqa: SIM102 - nested constexpr ifs
        if GI <= (J * DQ + DQ - 1) // G:
            c = _codes(x, lo_s, ssafe, p1, p2, p3, CODES)
            if (J * DQ) // G == (J * DQ + DQ - 1) // G:  # the whole quarter is in this group
                q = q + c
            else:
                q = q + tl.where((((J * DQ + cols) // G) == GI)[None, :], c, 0.0)
    return q
