"""Triton kernels: center, rotate, clip, quantize and pack K and V rows straight into their page slots (one
launch for both), and the demotion of 16-bit rows to 2-bit pages.

Bit-exact with :func:`oscarkv.quant.quantize` (method section 3). A row is held as four column quarters
``x_j[c] = x[j * d/4 + c]``, so packing byte ``c`` is elementwise (no reshape) and the stores are vectors.
The clip threshold is the exact order statistic, ties included: top-down or bottom-up extraction (unique
keys for 16-bit rows, counts for float32 rows) or a bitwise bisection, whichever needs fewest passes over the
row for this ratio (a run-time choice). Divisions are correctly rounded (``div_rn``), metadata is rounded to
nearest even, codes are computed from the stored metadata. With a fused rotation the float32 rows come from a
``tf32x3`` dot (float32-level accuracy, but not torch's summation order): the codes are then bit-exact with
``quantize()`` of the rows the kernel computed, which ``debug_rows`` exposes (docs/kernels.md).
"""

from __future__ import annotations

import torch
from torch import Tensor

import triton
import triton.language as tl

from ..quant import clip_index
from ._triton_util import check_device, check_kv_formats, check_pool_strides, next_pow2
from .layout import QuantPages
from .reference import channel_page_ids

_META_CODE = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}
# code formulations: 0 = one div_rn per element, compared with the rounding boundaries (2-bit default);
# 1 = one div_rn per element, floor + clamp (4-bit default); 2, 3 = per-row exact thresholds (no division per
# element), found by a 7-probe search within +-64 ulps (2) or a 2-probe search within a few ulps (3)
_CODE_FORMS = {"code_div": 0, "code_floor": 1, "code_thr": 2, "code_thr8": 3}
# clip order statistic, forced (default: the cheapest for the ratio): 1 top-down extraction, 2 bottom-up,
# 3 bitwise bisection, 4 bitonic sort (a slow independent cross-check)
_CLIP_FORMS = {"clip_top": 1, "clip_bottom": 2, "clip_bisect": 3, "clip_sort": 4}
_TUNING = ("block_r", "warps", "bpp", "prefetch")
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
    per-row code thresholds ``p1..p3`` (CODES 0/2/3) or code bounds ``[p1, p2]`` (CODES 1) that also apply the
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
    else:
        p1 = _eff(_threshold8(ssafe, 1, META), vl, vh, pos)
        p2 = _eff(_threshold8(ssafe, 2, META), vl, vh, pos)
        p3 = _eff(_threshold8(ssafe, 3, META), vl, vh, pos)
    return sc, lo_s, ssafe, p1, p2, p3


@triton.jit
def _codes(x, lo_s, ssafe, p1, p2, p3, CODES: tl.constexpr):
    """Codes (as float) of unclipped float32 elements ``x``: ``v = div_rn(x - lo_s, s)`` (CODES 0/1) or
    ``v = x - lo_s`` (CODES 2/3) against the group's thresholds or bounds."""
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


# ------------------------------------------------------------------------------------------- token pages
@triton.jit
def _load_rows(x_ptr, sx0, sx1, sxh, sxd, idx0_ptr, idx1_ptr, slots_ptr, N, blk, h, cols, cmask,
               D: tl.constexpr, DQ: tl.constexpr, DP: tl.constexpr, BLOCK_R: tl.constexpr, GATHER: tl.constexpr,
               HAS_ROT: tl.constexpr, PADC: tl.constexpr):
    """Slots and raw input of row block ``blk``: four quarters ``[BLOCK_R, CP]``, or the whole row
    ``[BLOCK_R, DP]`` (four times) for the fused rotation. Rows past ``N`` load nothing."""
    rows = blk * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < N
    slot = tl.load(slots_ptr + rows, mask=rmask, other=-1)
    if GATHER:  # the indices of padding rows may be garbage
        lmask = rmask & (slot >= 0)
        i0 = tl.load(idx0_ptr + rows, mask=lmask, other=0).to(tl.int64)
        i1 = tl.load(idx1_ptr + rows, mask=lmask, other=0).to(tl.int64)
        xbase = i0 * sx0 + i1 * sx1 + h * sxh
    else:  # padding rows are read (they exist) so that the loads do not wait for the slots
        lmask = rmask
        xbase = rows.to(tl.int64) * sx0 + h * sxh
    if HAS_ROT:
        k = tl.arange(0, DP)
        r0 = tl.load(x_ptr + xbase[:, None] + k[None, :] * sxd, mask=lmask[:, None] & (k < D)[None, :], other=0.0)
        r1 = r0
        r2 = r0
        r3 = r0
    else:
        if PADC:
            lm = lmask[:, None] & cmask[None, :]
        else:
            lm = lmask[:, None]
        p = x_ptr + xbase[:, None] + cols[None, :] * sxd
        r0 = tl.load(p, mask=lm, other=0.0)
        r1 = tl.load(p + DQ * sxd, mask=lm, other=0.0)
        r2 = tl.load(p + 2 * DQ * sxd, mask=lm, other=0.0)
        r3 = tl.load(p + 3 * DQ * sxd, mask=lm, other=0.0)
    return slot, r0, r1, r2, r3


@triton.jit
def _process_rows(slot, r0, r1, r2, r3, blk, h, cols, cmask, mu0, mu1, mu2, mu3, mu_k, rot_ptr, s_rot_h,
                  mode, n, idx, codes_ptr, scale_ptr, offset_ptr, sc_p, sc_h, sc_r, sm_p, sm_h, sm_r, dbg_ptr,
                  N, num_heads,
                  D: tl.constexpr, DQ: tl.constexpr, CP: tl.constexpr, DP: tl.constexpr, BITS: tl.constexpr,
                  G: tl.constexpr, NG: tl.constexpr, PAGE: tl.constexpr, BLOCK_R: tl.constexpr, HAS_MEAN: tl.constexpr,
                  HAS_ROT: tl.constexpr, KEY16: tl.constexpr, PADC: tl.constexpr, META: tl.constexpr,
                  DEBUG: tl.constexpr, CODES: tl.constexpr, CLIP_SORT: tl.constexpr):
    """Quantize one row block (quarters ``x_j``), write codes and metadata into the slots."""
    LEVELS: tl.constexpr = (1 << BITS) - 1
    rows = blk * BLOCK_R + tl.arange(0, BLOCK_R)
    valid = (rows < N) & (slot >= 0)  # negative slot = padding row (vLLM convention): never written
    if HAS_ROT:
        xin = _to_f32(r0)
        if HAS_MEAN:
            xin = xin - mu_k[None, :]
        # one dot over R's columns in quarter order (read per block, L2-resident), then split into the quarters
        # (four dots, or R held across the loop, spilled registers)
        k = tl.arange(0, DP)
        c4 = tl.arange(0, 4 * CP)
        e4 = (c4 // CP) * DQ + c4 % CP
        rm = (k < D)[:, None] & ((c4 % CP) < DQ)[None, :]
        rt = tl.load(rot_ptr + h * s_rot_h + k[:, None] * D + e4[None, :], mask=rm, other=0.0)
        xr = tl.dot(xin, rt, input_precision="tf32x3")  # ~float32 accuracy on tensor cores
        xr = tl.permute(tl.reshape(xr, (BLOCK_R, 2, 2, CP)), (0, 3, 1, 2))  # [r, c, j // 2, j % 2]
        xe, xo = tl.split(xr)
        x0, x2 = tl.split(xe)
        x1, x3 = tl.split(xo)
    else:
        x0 = _to_f32(r0)
        x1 = _to_f32(r1)
        x2 = _to_f32(r2)
        x3 = _to_f32(r3)
        if HAS_MEAN:
            x0 = x0 - mu0[None, :]
            x1 = x1 - mu1[None, :]
            x2 = x2 - mu2[None, :]
            x3 = x3 - mu3[None, :]
    if DEBUG:
        dptr = dbg_ptr + ((rows.to(tl.int64) * num_heads + h) * D)[:, None] + cols[None, :]
        dm = valid[:, None] & cmask[None, :]
        tl.store(dptr, x0, mask=dm)
        tl.store(dptr + DQ, x1, mask=dm)
        tl.store(dptr + 2 * DQ, x2, mask=dm)
        tl.store(dptr + 3 * DQ, x3, mask=dm)
    tau = tl.full([BLOCK_R], float("inf"), tl.float32)  # no clip: clamping to +-inf changes nothing
    if mode > 0:
        if CLIP_SORT:
            tau = _tau_sort(x0, x1, x2, x3, cmask, idx, CP)
        elif KEY16:
            tau = _tau_key16(r0, r1, r2, r3, x0, x1, x2, x3, cols, cmask, mode, n, idx, DQ, PADC)
        else:
            tau = _tau_f32(x0, x1, x2, x3, cmask, mode, n, idx, PADC)
    page = slot // PAGE
    prow = slot % PAGE
    mrow = page * sm_p + h * sm_h + prow * sm_r
    if NG == 1:
        if PADC:
            cm = cmask[None, :]
            inf = float("inf")
            lo = _min4(tl.where(cm, x0, inf), tl.where(cm, x1, inf), tl.where(cm, x2, inf), tl.where(cm, x3, inf))
            hi = _max4(tl.where(cm, x0, -inf), tl.where(cm, x1, -inf), tl.where(cm, x2, -inf),
                       tl.where(cm, x3, -inf))
        else:
            lo = _min4(x0, x1, x2, x3)
            hi = _max4(x0, x1, x2, x3)
        sc, lo_s, ss, p1, p2, p3 = _group_params(lo, hi, tau, META, LEVELS, CODES)
        _store_meta(scale_ptr + mrow, sc, valid)
        _store_meta(offset_ptr + mrow, lo_s, valid)
        q0 = _codes(x0, lo_s, ss, p1, p2, p3, CODES)
        q1 = _codes(x1, lo_s, ss, p1, p2, p3, CODES)
        q2 = _codes(x2, lo_s, ss, p1, p2, p3, CODES)
        q3 = _codes(x3, lo_s, ss, p1, p2, p3, CODES)
    else:
        q0 = tl.zeros([BLOCK_R, CP], tl.float32)
        q1 = tl.zeros([BLOCK_R, CP], tl.float32)
        q2 = tl.zeros([BLOCK_R, CP], tl.float32)
        q3 = tl.zeros([BLOCK_R, CP], tl.float32)
        for gi in tl.static_range(NG):
            lo = tl.full([BLOCK_R], float("inf"), tl.float32)
            hi = tl.full([BLOCK_R], float("-inf"), tl.float32)
            lo, hi = _part_range(x0, lo, hi, cols, cmask, 0, gi, DQ, G)
            lo, hi = _part_range(x1, lo, hi, cols, cmask, 1, gi, DQ, G)
            lo, hi = _part_range(x2, lo, hi, cols, cmask, 2, gi, DQ, G)
            lo, hi = _part_range(x3, lo, hi, cols, cmask, 3, gi, DQ, G)
            sc, lo_s, ss, p1, p2, p3 = _group_params(lo, hi, tau, META, LEVELS, CODES)
            _store_meta(scale_ptr + mrow + gi, sc, valid)
            _store_meta(offset_ptr + mrow + gi, lo_s, valid)
            q0 = _part_codes(q0, x0, cols, lo_s, ss, p1, p2, p3, 0, gi, DQ, G, CODES)
            q1 = _part_codes(q1, x1, cols, lo_s, ss, p1, p2, p3, 1, gi, DQ, G, CODES)
            q2 = _part_codes(q2, x2, cols, lo_s, ss, p1, p2, p3, 2, gi, DQ, G, CODES)
            q3 = _part_codes(q3, x3, cols, lo_s, ss, p1, p2, p3, 3, gi, DQ, G, CODES)
    cptr = codes_ptr + (page * sc_p + h * sc_h + prow * sc_r)[:, None] + cols[None, :]
    if PADC:
        sm = valid[:, None] & cmask[None, :]
    else:
        sm = valid[:, None]
    if BITS == 2:  # byte c: elements c, c + d/4, c + d/2, c + 3d/4 (exact small integers in float32)
        tl.store(cptr, (q0 + q1 * 4.0 + q2 * 16.0 + q3 * 64.0).to(tl.uint8), mask=sm)
    else:  # byte c: elements c, c + d/2
        tl.store(cptr, (q0 + q2 * 16.0).to(tl.uint8), mask=sm)
        tl.store(cptr + DQ, (q1 + q3 * 16.0).to(tl.uint8), mask=sm)


@triton.jit
def _quant_side(
    x_ptr, sx0, sx1, sxh, sxd, mean_ptr, rot_ptr, s_rot_h, mode, n, idx, codes_ptr, scale_ptr, offset_ptr,
    dbg_ptr, idx0_ptr, idx1_ptr, sc_p, sc_h, sc_r, sm_p, sm_h, sm_r, slots_ptr, N, num_heads, h,
    D: tl.constexpr, DQ: tl.constexpr, CP: tl.constexpr, DP: tl.constexpr, BITS: tl.constexpr,
    G: tl.constexpr, NG: tl.constexpr, PAGE: tl.constexpr, BLOCK_R: tl.constexpr, GATHER: tl.constexpr,
    HAS_MEAN: tl.constexpr, HAS_ROT: tl.constexpr, KEY16: tl.constexpr, META: tl.constexpr,
    DEBUG: tl.constexpr, CODES: tl.constexpr, CLIP_SORT: tl.constexpr, PREFETCH: tl.constexpr,
):
    """Row blocks ``pid, pid + programs, ...`` of one KV head of one side; with PREFETCH the next block's
    loads are issued before this block's math, so every program keeps a block of loads in flight."""
    PADC: tl.constexpr = CP != DQ
    cols = tl.arange(0, CP)
    cmask = cols < DQ
    mu0 = tl.zeros([CP], tl.float32)  # per-program constants (unused ones are dropped by the compiler)
    mu1 = mu0
    mu2 = mu0
    mu3 = mu0
    mu_k = mu0
    if HAS_ROT:
        if HAS_MEAN:
            k = tl.arange(0, DP)
            mu_k = tl.load(mean_ptr + h * D + k, mask=k < D, other=0.0)
    elif HAS_MEAN:
        mbase = mean_ptr + h * D + cols
        mu0 = tl.load(mbase, mask=cmask, other=0.0)
        mu1 = tl.load(mbase + DQ, mask=cmask, other=0.0)
        mu2 = tl.load(mbase + 2 * DQ, mask=cmask, other=0.0)
        mu3 = tl.load(mbase + 3 * DQ, mask=cmask, other=0.0)
    pid = tl.program_id(0)
    npr = tl.num_programs(0)
    nblk = tl.cdiv(N, BLOCK_R)
    if PREFETCH:
        slot, r0, r1, r2, r3 = _load_rows(x_ptr, sx0, sx1, sxh, sxd, idx0_ptr, idx1_ptr, slots_ptr, N, pid, h,
                                          cols, cmask, D, DQ, DP, BLOCK_R, GATHER, HAS_ROT, PADC)
        for blk in range(pid, nblk, npr):
            nslot, n0, n1, n2, n3 = _load_rows(x_ptr, sx0, sx1, sxh, sxd, idx0_ptr, idx1_ptr, slots_ptr, N,
                                               blk + npr, h, cols, cmask, D, DQ, DP, BLOCK_R, GATHER, HAS_ROT,
                                               PADC)
            _process_rows(slot, r0, r1, r2, r3, blk, h, cols, cmask, mu0, mu1, mu2, mu3, mu_k, rot_ptr,
                          s_rot_h, mode, n, idx, codes_ptr, scale_ptr, offset_ptr, sc_p, sc_h, sc_r, sm_p, sm_h, sm_r,
                          dbg_ptr, N, num_heads, D, DQ, CP, DP, BITS, G, NG, PAGE, BLOCK_R, HAS_MEAN, HAS_ROT, KEY16,
                          PADC, META, DEBUG, CODES, CLIP_SORT)
            slot, r0, r1, r2, r3 = nslot, n0, n1, n2, n3
    else:
        for blk in range(pid, nblk, npr):
            slot, r0, r1, r2, r3 = _load_rows(x_ptr, sx0, sx1, sxh, sxd, idx0_ptr, idx1_ptr, slots_ptr, N, blk,
                                              h, cols, cmask, D, DQ, DP, BLOCK_R, GATHER, HAS_ROT, PADC)
            _process_rows(slot, r0, r1, r2, r3, blk, h, cols, cmask, mu0, mu1, mu2, mu3, mu_k, rot_ptr,
                          s_rot_h, mode, n, idx, codes_ptr, scale_ptr, offset_ptr, sc_p, sc_h, sc_r, sm_p, sm_h, sm_r,
                          dbg_ptr, N, num_heads, D, DQ, CP, DP, BITS, G, NG, PAGE, BLOCK_R, HAS_MEAN, HAS_ROT, KEY16,
                          PADC, META, DEBUG, CODES, CLIP_SORT)


# clip method, step count and idx are run-time values: one compiled kernel serves every ratio
@triton.jit(do_not_specialize=["kmode", "kn", "kidx", "vmode", "vn", "vidx", "N"])
def _quantize_kv_kernel(
    kx, ksx0, ksx1, ksxh, ksxd, kmean, krot, ks_rot_h, kmode, kn, kidx, kcodes, kscale, koffset, kdbg,
    vx, vsx0, vsx1, vsxh, vsxd, vmean, vrot, vs_rot_h, vmode, vn, vidx, vcodes, vscale, voffset, vdbg,
    idx0_ptr, idx1_ptr, sc_p, sc_h, sc_r, sm_p, sm_h, sm_r, slots_ptr, N, num_heads,
    D: tl.constexpr, DQ: tl.constexpr, CP: tl.constexpr, DP: tl.constexpr, BITS: tl.constexpr,
    G: tl.constexpr, NG: tl.constexpr, PAGE: tl.constexpr, BLOCK_R: tl.constexpr, GATHER: tl.constexpr,
    K_MEAN: tl.constexpr, K_ROT: tl.constexpr, K_KEY16: tl.constexpr, V_MEAN: tl.constexpr,
    V_ROT: tl.constexpr, V_KEY16: tl.constexpr, META: tl.constexpr, DEBUG: tl.constexpr, CODES: tl.constexpr,
    CLIP_SORT: tl.constexpr, PREFETCH: tl.constexpr, SIDE0: tl.constexpr,
):
    h = tl.program_id(1)
    if tl.program_id(2) + SIDE0 == 0:  # SIDE0 = 1: V only (K went to channel pages)
        _quant_side(kx, ksx0, ksx1, ksxh, ksxd, kmean, krot, ks_rot_h, kmode, kn, kidx, kcodes, kscale, koffset,
                    kdbg, idx0_ptr, idx1_ptr, sc_p, sc_h, sc_r, sm_p, sm_h, sm_r, slots_ptr, N, num_heads, h,
                    D, DQ, CP, DP, BITS, G, NG, PAGE, BLOCK_R, GATHER, K_MEAN, K_ROT, K_KEY16, META, DEBUG, CODES,
                    CLIP_SORT, PREFETCH)
    else:
        _quant_side(vx, vsx0, vsx1, vsxh, vsxd, vmean, vrot, vs_rot_h, vmode, vn, vidx, vcodes, vscale, voffset,
                    vdbg, idx0_ptr, idx1_ptr, sc_p, sc_h, sc_r, sm_p, sm_h, sm_r, slots_ptr, N, num_heads, h,
                    D, DQ, CP, DP, BITS, G, NG, PAGE, BLOCK_R, GATHER, V_MEAN, V_ROT, V_KEY16, META, DEBUG, CODES,
                    CLIP_SORT, PREFETCH)


# ----------------------------------------------------------------------------------------- channel pages
@triton.jit
def _quant_channel_kernel(
    x_ptr, sx0, sx1, sxh, sxd, idx0_ptr, idx1_ptr, mean_ptr, rot_ptr, s_rot_h,
    codes_ptr, scale_ptr, offset_ptr, sc_p, sc_h, sc_r, sm_p, sm_h, slots_ptr, dbg_ptr, num_heads,
    D: tl.constexpr, DP: tl.constexpr, BITS: tl.constexpr, PS: tl.constexpr, GATHER: tl.constexpr,
    HAS_MEAN: tl.constexpr, HAS_ROT: tl.constexpr, META: tl.constexpr, DEBUG: tl.constexpr,
    CODE_DIV: tl.constexpr,
):
    """One program = one whole channel page of one KV head: rows ``[i * PS, (i + 1) * PS)`` of the input go to
    page ``slots[i * PS] // PS`` (the launcher checked that each run of PS slots is one whole page); a scale and
    offset per channel over the page's tokens, codes packed token-major like token pages."""
    PER: tl.constexpr = 8 // BITS
    DQ: tl.constexpr = D // PER
    CP: tl.constexpr = DP // PER
    LEVELS: tl.constexpr = (1 << BITS) - 1
    i = tl.program_id(0)
    h = tl.program_id(1)
    n = tl.arange(0, PS)
    rows = i * PS + n
    slot0 = tl.load(slots_ptr + i * PS).to(tl.int64)
    valid = (slot0 + n * 0) >= 0  # a run of negative slots is a padding page: nothing is written
    if GATHER:
        i0 = tl.load(idx0_ptr + rows, mask=valid, other=0).to(tl.int64)
        i1 = tl.load(idx1_ptr + rows, mask=valid, other=0).to(tl.int64)
        xbase = i0 * sx0 + i1 * sx1 + h * sxh
    else:
        xbase = rows.to(tl.int64) * sx0 + h * sxh
    cols = tl.arange(0, PER * CP)  # quartered order, as in _quant_rows
    jj = cols // CP
    cc = cols % CP
    cmask = cc < DQ
    e = jj * DQ + cc
    if HAS_ROT:
        k = tl.arange(0, DP)
        kmask = k < D
        xin = tl.load(x_ptr + xbase[:, None] + k[None, :] * sxd, mask=valid[:, None] & kmask[None, :], other=0.0)
        xin = xin.to(tl.float32)
        if HAS_MEAN:
            xin = xin - tl.load(mean_ptr + h * D + k, mask=kmask, other=0.0)[None, :]
        r = tl.load(rot_ptr + h * s_rot_h + k[:, None] * D + e[None, :], mask=kmask[:, None] & cmask[None, :],
                    other=0.0)
        x = tl.dot(xin, r, input_precision="tf32x3")
    else:
        x = tl.load(x_ptr + xbase[:, None] + e[None, :] * sxd, mask=valid[:, None] & cmask[None, :], other=0.0)
        x = x.to(tl.float32)
        if HAS_MEAN:
            x = x - tl.load(mean_ptr + h * D + e, mask=cmask, other=0.0)[None, :]
    if DEBUG:
        dptr = dbg_ptr + (rows.to(tl.int64) * num_heads + h)[:, None] * D + e[None, :]
        tl.store(dptr, x, mask=valid[:, None] & cmask[None, :])
    page = slot0 // PS
    lo = tl.min(x, axis=0)  # per channel, over the page's tokens
    hi = tl.max(x, axis=0)
    lv = tl.full([PER * CP], LEVELS, tl.float32)
    sc = _round_meta(tl.math.div_rn(hi - lo, lv), META)
    lo = _round_meta(lo, META)
    mptr = page * sm_p + h * sm_h + e
    smask = cmask & ((slot0 + e * 0) >= 0)
    tl.store(scale_ptr + mptr, sc.to(scale_ptr.dtype.element_ty), mask=smask)
    tl.store(offset_ptr + mptr, lo.to(offset_ptr.dtype.element_ty), mask=smask)
    a = x - lo[None, :]
    live = (cmask & (sc > 0.0))[None, :]
    ssafe = tl.where(sc > 0.0, sc, 1.0)
    if CODE_DIV:
        t = tl.math.div_rn(a, ssafe[None, :]) + 0.5
        q = tl.where(live, tl.minimum(tl.maximum(tl.floor(t), 0.0), LEVELS * 1.0).to(tl.int32), 0)
    else:
        q = tl.zeros([PS, PER * CP], tl.int32)
        for kk in tl.static_range(1, LEVELS + 1):
            q += (live & (a >= _threshold(ssafe, kk)[None, :])).to(tl.int32)
    q = q << (BITS * jj)[None, :]
    packed = tl.sum(tl.reshape(q, (PS, PER, CP)), axis=1)
    c = tl.arange(0, CP)
    cptr = codes_ptr + (page * sc_p + h * sc_h + n * sc_r)[:, None] + c[None, :]
    tl.store(cptr, packed.to(tl.uint8), mask=valid[:, None] & (c < DQ)[None, :])



def clip_plan(clip: float, d: int, key16: bool, force: int = 0) -> tuple[int, int, int]:
    """(mode, loop count, idx) of the clip order statistic for ratio ``clip`` on rows of length ``d``: mode 0 =
    no clip; else the formulation with the fewest passes over the row (``force`` overrides). 16-bit rows
    (unique keys): top-down ``1 + r`` passes (``r = d-1-idx``), bottom-up ``1 + idx``, bisection 15; float32
    rows (two reductions per step, for tie counts): top-down ``2 (r + 1)``, bottom-up ``2 (idx + 1)``,
    bisection 31."""
    idx = clip_index(clip, d)
    if idx is None:
        return 0, 0, 0
    r = d - 1 - idx
    if force:
        mode = force
    else:
        cost = {1: 1 + r, 2: 1 + idx, 3: 15} if key16 else {1: 2 * (r + 1), 2: 2 * (idx + 1), 3: 31}
        mode = min(cost, key=cost.get)
    return mode, (r if mode == 1 else idx), idx


def _parse_variant(variant: tuple[str, ...], bits: int, has_rot: bool) -> dict:
    """Formulation and launch knobs: code/clip names (``_CODE_FORMS``, ``_CLIP_FORMS``) and ``name=int`` for
    ``block_r`` (rows per block), ``warps``, ``bpp`` (row blocks per program), ``prefetch`` (0/1)."""
    # prefetch off: the kernel is issue-bound (SASS: ~8% more instructions and 96 -> 127 registers with it)
    # 2-bit codes by per-row thresholds (code_thr8): measured 0.113 ms vs 0.158 ms with one division per element
    # (H200, 32768 rows x 8 heads, K+V, clip; docs/results/kernels_h200.md), bit-identical
    opt = {"codes": 3 if bits == 2 else 1, "clip": 0, "block_r": 16 if has_rot else 32, "warps": 4, "bpp": 4,
           "prefetch": 0}
    if isinstance(variant, str):
        raise ValueError(f"variant must be a tuple of names, got the string {variant!r}")
    for v in variant:
        name, _, val = v.partition("=")
        if not val and name in _CODE_FORMS:
            form = _CODE_FORMS[name]
            if bits == 4 and form == 0:
                form = 1  # the 4-bit division formulation is floor + clamp
            if bits == 4 and form >= 2:
                raise ValueError(f"variant {name!r} supports 2-bit pools only")
            opt["codes"] = form
        elif not val and name in _CLIP_FORMS:
            opt["clip"] = _CLIP_FORMS[name]
        elif val and name in _TUNING:
            try:
                opt[name] = int(val)
            except ValueError:
                raise ValueError(f"variant {v!r}: {name} needs an integer value") from None
        else:
            raise ValueError(f"unknown variant {v!r}: use {sorted(_CODE_FORMS)}, {sorted(_CLIP_FORMS)} or "
                             f"name=int for {list(_TUNING)}")
    b = opt["block_r"]
    if b < 16 or b & (b - 1) or b > 256:
        raise ValueError(f"block_r must be a power of two in [16, 256], got {b}")
    if opt["warps"] not in (1, 2, 4, 8, 16):
        raise ValueError(f"warps must be 1, 2, 4, 8 or 16, got {opt['warps']}")
    if opt["bpp"] < 1 or opt["prefetch"] not in (0, 1):
        raise ValueError(f"bpp must be >= 1 and prefetch 0 or 1, got {opt['bpp']} and {opt['prefetch']}")
    return opt


def _prep_side(pages: QuantPages, x: Tensor, rotation: Tensor | None, mean: Tensor | None, clip: float,
               name: str, force_clip: int):
    fmt = pages.fmt
    d, hkv = fmt.head_dim, fmt.num_kv_heads
    check_device(f"{name} rows", x, pages.codes.device)
    if not x.is_floating_point():
        raise ValueError(f"{name} rows must be floating point, got {x.dtype}")
    rot, s_rot_h = x, 0
    if rotation is not None:
        if rotation.shape not in ((d, d), (hkv, d, d)):
            raise ValueError(f"{name} rotation must be [{d}, {d}] or [{hkv}, {d}, {d}], got {tuple(rotation.shape)}")
        rot = rotation.to(device=x.device, dtype=torch.float32).contiguous()
        s_rot_h = d * d if rot.ndim == 3 else 0
    mu = x
    if mean is not None:
        if mean.shape != (hkv, d):
            raise ValueError(f"{name} mean must be [{hkv}, {d}], got {tuple(mean.shape)}")
        mu = mean.to(device=x.device, dtype=torch.float32).contiguous()
    # rows that are exact 16-bit floats get unique 23-bit keys (15 bits of |x|, 8 of index)
    key16 = x.dtype in (torch.float16, torch.bfloat16) and rotation is None and mean is None and d <= 256
    mode, count, idx = clip_plan(clip, d, key16, force_clip)
    return rot, s_rot_h, mu, key16, mode, count, idx


def _launch(k_pages, v_pages, k, v, k_strides, v_strides, slots, n, idx0, idx1, *, k_rotation, v_rotation,
            k_mean, v_mean, k_clip, v_clip, debug_rows, gather, variant=(), check_pages=True):
    fmt = k_pages.fmt
    check_kv_formats(k_pages, v_pages)
    if k_pages.codes.shape[0] != v_pages.codes.shape[0]:
        raise ValueError("K and V pools must have the same number of pages (slots address both)")
    check_pool_strides(k_pages, v_pages, k_pages.codes.device)
    d, hkv = fmt.head_dim, fmt.num_kv_heads
    if d % 4:
        raise ValueError(f"the Triton quantize kernel needs head_dim % 4 == 0 (row quarters), got {d}; "
                         "use the reference")
    has_rot = k_rotation is not None or v_rotation is not None
    opt = _parse_variant(variant, fmt.bits, has_rot)
    chan = fmt.channel
    if chan:
        if clip_index(k_clip, fmt.head_dim) is not None:
            raise ValueError(f"channel pages are not clipped (KIVI per-channel keys); got k_clip {k_clip}: pass 0")
        if n % fmt.page_size:
            raise ValueError(f"channel pages are written whole: got {n} rows, not a multiple of page_size "
                             f"{fmt.page_size}; keep partial pages in the 16-bit tier until they are full")
        if check_pages:
            channel_page_ids(slots, fmt.page_size)  # raises on a partial page (host synchronisation)
    if n == 0:
        return
    krot, ksr, kmu, kkey, kmode, kcount, kidx = _prep_side(k_pages, k, k_rotation, k_mean, 0.0 if chan else k_clip,
                                                           "K", opt["clip"])
    vrot, vsr, vmu, vkey, vmode, vcount, vidx = _prep_side(v_pages, v, v_rotation, v_mean, v_clip, "V", opt["clip"])
    kdbg = vdbg = k
    if debug_rows is not None:
        kdbg, vdbg = debug_rows
        for t in (kdbg, vdbg):
            if t.shape != (n, hkv, d) or t.dtype != torch.float32 or not t.is_contiguous():
                raise ValueError(f"debug_rows must be two contiguous float32 [{n}, {hkv}, {d}] tensors")
    cs, ms = k_pages.codes.stride(), v_pages.scale.stride()
    meta = _META_CODE[fmt.meta_dtype]
    if chan:
        kms = k_pages.scale.stride()
        _quant_channel_kernel[(n // fmt.page_size, hkv)](
            k, *k_strides, idx0, idx1, kmu, krot, ksr, k_pages.codes, k_pages.scale, k_pages.offset,
            cs[0], cs[1], cs[2], kms[0], kms[1], slots, kdbg, hkv, D=d, DP=next_pow2(d), BITS=fmt.bits,
            PS=fmt.page_size, GATHER=gather, HAS_MEAN=k_mean is not None, HAS_ROT=k_rotation is not None,
            META=meta, DEBUG=debug_rows is not None, CODE_DIV="code_div" in variant, num_warps=4,
        )
    dq = d // 4
    cp = next_pow2(dq)
    dp = next_pow2(d)
    if has_rot:  # tl.dot needs every dimension >= 16 (padding columns are masked)
        cp, dp = max(cp, 16), max(dp, 16)
    block_r = opt["block_r"]
    nblk = triton.cdiv(n, block_r)
    grid = (max(1, triton.cdiv(nblk, opt["bpp"])), hkv, 1 if chan else 2)
    _quantize_kv_kernel[grid](
        k, *k_strides, kmu, krot, ksr, kmode, kcount, kidx, k_pages.codes, k_pages.scale, k_pages.offset, kdbg,
        v, *v_strides, vmu, vrot, vsr, vmode, vcount, vidx, v_pages.codes, v_pages.scale, v_pages.offset, vdbg,
        idx0, idx1, cs[0], cs[1], cs[2], ms[0], ms[1], ms[2], slots, n, hkv,
        D=d, DQ=dq, CP=cp, DP=dp, BITS=fmt.bits, G=fmt.group, NG=fmt.groups, PAGE=fmt.page_size, BLOCK_R=block_r,
        GATHER=gather, K_MEAN=k_mean is not None, K_ROT=k_rotation is not None, K_KEY16=kkey,
        V_MEAN=v_mean is not None, V_ROT=v_rotation is not None, V_KEY16=vkey, META=meta,
        DEBUG=debug_rows is not None, CODES=opt["codes"], CLIP_SORT=opt["clip"] == 4, PREFETCH=bool(opt["prefetch"]),
        SIDE0=1 if chan else 0, num_warps=opt["warps"],
    )


def _as_slots(slots: Tensor, n: int, device: torch.device) -> Tensor:
    if slots.shape != (n,):
        raise ValueError(f"slots must have shape [{n}], got {tuple(slots.shape)}")
    check_device("slots", slots, device)
    return slots.to(torch.int64).contiguous()


def _rotated_rows(x: Tensor, rotation: Tensor, mean: Tensor | None) -> Tensor:
    """``(x - mean) @ R`` in float32, ``R`` ``[d, d]`` or per KV head ``[Hkv, d, d]``; x ``[N, Hkv, d]``."""
    _, hkv, d = x.shape
    if tuple(rotation.shape) not in ((d, d), (hkv, d, d)):
        raise ValueError(f"rotation must be [{d}, {d}] or [{hkv}, {d}, {d}], got {tuple(rotation.shape)}")
    if mean is not None and tuple(mean.shape) != (hkv, d):
        raise ValueError(f"mean must be [{hkv}, {d}], got {tuple(mean.shape)}")
    xf = x.float()
    if mean is not None:
        xf = xf - mean.float()
    r = rotation.float()
    eq = "nhd,de->nhe" if r.ndim == 2 else "nhd,hde->nhe"
    return torch.einsum(eq, xf, r).contiguous()


def quantize_write_triton(
    k_pages: QuantPages, v_pages: QuantPages, k: Tensor, v: Tensor, slots: Tensor, *,
    k_rotation: Tensor | None = None, v_rotation: Tensor | None = None,
    k_mean: Tensor | None = None, v_mean: Tensor | None = None,
    k_clip: float = 0.0, v_clip: float = 0.0, debug_rows: tuple[Tensor, Tensor] | None = None,
    variant: tuple[str, ...] = (), check_pages: bool = True,
) -> None:
    """Quantize K and V rows ``[N, Hkv, d]`` into ``slots`` (``[N]``, ``page * page_size + row``; negative =
    skip) of both pools, in place, in one launch. See :func:`oscarkv.kernels.reference.quantize_write_ref`.

    ``debug_rows``: optional pair of float32 ``[N, Hkv, d]`` tensors receiving the centered, rotated rows
    before clipping (the exact float32 values the codes were computed from). ``variant``: equivalent
    formulations and launch knobs, for tests and benchmarks: "code_thr8" (the 2-bit default: per-row
    thresholds, two probes), "code_div" (one division per element), "code_floor", "code_thr" (7 probes); "clip_top",
    "clip_bottom", "clip_bisect", "clip_sort" (force one order-statistic method); "block_r=", "warps=",
    "bpp=" (row blocks per program), "prefetch=" (0/1: load the next block before this one's math);
    "rot_fused" (the rotation as a tf32x3 dot inside the row kernel: CPU-interpreter tested, but it does not fit
    sm_90's shared memory at d = 128; by default the rows are rotated in torch float32 first).

    Keys in channel pages (``k_pages.fmt.layout == "channel"``): K goes through a second launch, one program
    per whole page and head; ``N`` must be a multiple of ``page_size`` and every run of ``page_size`` slots one
    whole page (or all negative): checked on the host unless ``check_pages=False`` (for graph capture; the
    caller then guarantees it, and a violation writes garbage). ``k_clip`` must be 0.
    """
    fmt = k_pages.fmt
    shape = (k.shape[0], fmt.num_kv_heads, fmt.head_dim)
    if k.shape != shape or v.shape != shape:
        raise ValueError(f"k and v must both be [N, {fmt.num_kv_heads}, {fmt.head_dim}], got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    n = shape[0]
    slots = _as_slots(slots, n, k_pages.codes.device)
    # The row kernel's fused rotation needs more shared memory than sm_90 has at d = 128 (278-328 KB measured
    # on the H200 at 16-64 rows per block): unless "rot_fused" is asked for, rows of the row kernel are
    # centered and rotated in torch float32 first (the codes are exact for the rows used, as with the fused dot).
    fused = "rot_fused" in variant
    variant = tuple(x for x in variant if x != "rot_fused")
    if not fused and v_rotation is not None:
        v, v_rotation, v_mean = _rotated_rows(v, v_rotation, v_mean), None, None
    if not fused and k_rotation is not None and not fmt.channel:
        k, k_rotation, k_mean = _rotated_rows(k, k_rotation, k_mean), None, None
    ks = (k.stride(0), 0, k.stride(1), k.stride(2))
    vs = (v.stride(0), 0, v.stride(1), v.stride(2))
    _launch(k_pages, v_pages, k, v, ks, vs, slots, n, slots, slots, k_rotation=k_rotation, v_rotation=v_rotation,
            k_mean=k_mean, v_mean=v_mean, k_clip=k_clip, v_clip=v_clip, debug_rows=debug_rows, gather=False,
            variant=variant, check_pages=check_pages)


def demote_triton(
    k_pages: QuantPages, v_pages: QuantPages, k16: Tensor, v16: Tensor, seq_ids: Tensor, src_index: Tensor,
    slots: Tensor, *, k_clip: float = 0.0, v_clip: float = 0.0, check_pages: bool = True,
    variant: tuple[str, ...] = (),
) -> None:
    """Quantize 16-bit-tier rows ``k16/v16[seq_ids[i], :, src_index[i]]`` (``[B, Hkv, C16, d]``, already
    centered and rotated) into ``slots[i]`` of the 2-bit pools, in place, in one launch (two with channel-page
    keys: whole pages only, see :func:`quantize_write_triton`, also for ``variant``)."""
    fmt = k_pages.fmt
    if k16.ndim != 4 or k16.shape[1] != fmt.num_kv_heads or k16.shape[3] != fmt.head_dim or v16.shape != k16.shape:
        raise ValueError(f"k16/v16 must be [B, {fmt.num_kv_heads}, C16, {fmt.head_dim}], got "
                         f"{tuple(k16.shape)} and {tuple(v16.shape)}")
    n = slots.shape[0]
    if seq_ids.shape != (n,) or src_index.shape != (n,):
        raise ValueError(f"seq_ids and src_index must have shape [{n}] like slots")
    dev = k_pages.codes.device
    slots = _as_slots(slots, n, dev)
    check_device("seq_ids", seq_ids, dev)
    check_device("src_index", src_index, dev)
    ks = (k16.stride(0), k16.stride(2), k16.stride(1), k16.stride(3))
    vs = (v16.stride(0), v16.stride(2), v16.stride(1), v16.stride(3))
    _launch(k_pages, v_pages, k16, v16, ks, vs, slots, n, seq_ids.contiguous(), src_index.contiguous(),
            k_rotation=None, v_rotation=None, k_mean=None, v_mean=None, k_clip=k_clip, v_clip=v_clip,
            debug_rows=None, gather=True, variant=variant, check_pages=check_pages)


__all__ = ["quantize_write_triton", "demote_triton", "clip_plan"]
