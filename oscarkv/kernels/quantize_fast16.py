"""Triton kernel quantizing 16-bit rows (bfloat16 or float16, no mean) to 2-bit token pages, one group per row:
the production write for the 2-bit token formats (:func:`oscarkv.kernels.quantize_triton.quantize_write_triton`
picks it where :func:`fast16_ok` holds). Bit-exact with :func:`oscarkv.quant.quantize`.

Rows are read as 32-bit words; min/max by packed bf16x2/f16x2 instructions; the clip order statistic by
unique int32 keys (``|x| << 16 | tag``), one fused add-min per element and step, or, for bfloat16 rows and the
top-down order statistic, by 16-bit keys in a window of ``2^(16 - log2 d) - 1`` 16-bit steps below ``max |x|``,
two per 32-bit word (rows whose order statistic lies below the window are resolved by lower windows, each ending
one step above the row's largest ``|x|`` below the last one: at most ``n + 1`` windows); the three code
thresholds moved into the input dtype (the smallest 16-bit value of each code, exact, per row), so a code is two
packed compares on the raw words. The word arithmetic is in :mod:`oscarkv.kernels.quantize_words`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .layout import QuantPages
from .quantize_math import _from16, _store_meta
from .quantize_words import (
    _f32_to16,
    _group_params_x,
    _h2max,
    _pk_add,
    _pk_addmin,
    _pk_below,
    _pk_nkeys,
    _pk_rowmin2,
    _pk_umin,
    _subumin,
    _w_hi,
    _w_lo,
    _wcodes,
)


# A row of d 16-bit floats is read as d/2 int32 words (16-byte loads), four quarters of d/8 words, each split
# into two column blocks (a row spans d/64 threads, so the per-row scalar work and the cross-thread reductions
# are shared by few threads). Word c of block (j, s) holds elements e and e + 1, e = j d/4 + s d/8 + 2c, in its
# low and high half; its code bytes are bytes e - j d/4 and the next of the row's packed codes, stored as one
# 16-bit word.
@triton.jit
def _wkeys(w, e, E0: tl.constexpr, INTERP: tl.constexpr):
    """Unique int32 keys ``|x| bits << 16 | tag`` (below 2^31, ordered by ``|x|``) of the low and high elements
    of words ``w``; ``t = e + E0`` is unique per word and below 2^15, the low element's tag is ``t`` with bit 15
    set, the high element's ``t`` without: with ``a = w & 0x7FFF7FFF``, ``lo = (a << 16) + (t | 0x8000)`` and
    ``hi`` = bits 15..31 of ``a``, bits 0..14 of ``lo``. Four instructions a word (in asm: LLVM otherwise
    rewrites ``lo & 0x7FFF`` as ``t & 0x7FFF`` and adds three more)."""
    c = E0 | 0x8000
    if INTERP:
        a = w & 0x7FFF7FFF
        lo = (a << 16) + (e + c)
        hi = (a & -32768) | (lo & 0x7FFF)
    else:
        lo, hi = tl.inline_asm_elementwise(
            "{ .reg .b32 a, t; and.b32 a, $2, 0x7FFF7FFF; add.u32 t, $3, $4; mad.lo.u32 $0, a, 65536, t; "
            "lop3.b32 $1, a, $0, 0xFFFF8000, 0xE4; }",
            "=r,=r,r,r,r", [w, e, e * 0 + c], dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
    return lo, hi


@triton.jit
def _wrange(w0, w1, w2, w3, w4, w5, w6, w7, BF16: tl.constexpr, MAX: tl.constexpr, INTERP: tl.constexpr):
    """Per-row max (MAX) or min of the 16-bit elements, float32: packed max/min across the word blocks, then
    across the thread's words and the row's threads in float32."""
    r = _h2max(_h2max(w0, w1, BF16, MAX, INTERP), _h2max(w2, w3, BF16, MAX, INTERP), BF16, MAX, INTERP)
    r = _h2max(r, _h2max(_h2max(w4, w5, BF16, MAX, INTERP), _h2max(w6, w7, BF16, MAX, INTERP), BF16, MAX, INTERP),
               BF16, MAX, INTERP)
    if MAX:
        v = tl.max(tl.maximum(_w_lo(r, BF16), _w_hi(r, BF16)), axis=1)
    else:
        v = tl.min(tl.minimum(_w_lo(r, BF16), _w_hi(r, BF16)), axis=1)
    return v


@triton.jit
def _wfold(acc, c, k, TOP: tl.constexpr, INTERP: tl.constexpr):
    """``umin(acc, c - k)`` (TOP: the next key below ``c + 1``) or ``umin(acc, k - c)`` (the next above)."""
    if TOP:
        r = _subumin(acc, c, k, INTERP)
    else:
        r = _subumin(acc, k, c, INTERP)
    return r


@triton.jit
def _wstep(c, k0, k1, k2, k3, k4, k5, k6, k7, TOP: tl.constexpr, INTERP: tl.constexpr):
    """One linear ``umin`` chain over eight key tensors (``c`` broadcast to their shape)."""
    if TOP:
        acc = c - k0
    else:
        acc = k0 - c
    acc = _wfold(acc, c, k1, TOP, INTERP)
    acc = _wfold(acc, c, k2, TOP, INTERP)
    acc = _wfold(acc, c, k3, TOP, INTERP)
    acc = _wfold(acc, c, k4, TOP, INTERP)
    acc = _wfold(acc, c, k5, TOP, INTERP)
    acc = _wfold(acc, c, k6, TOP, INTERP)
    acc = _wfold(acc, c, k7, TOP, INTERP)
    return acc


@triton.jit
def _wcount(k0, k1, k2, k3, k4, k5, k6, k7, cand):
    """Per-row count of keys below ``cand`` (keys and ``cand`` compared as non-negative floats)."""
    f = cand[:, None]
    return tl.sum(tl.where(k0.to(tl.float32, bitcast=True) < f, 1.0, 0.0)
                  + tl.where(k1.to(tl.float32, bitcast=True) < f, 1.0, 0.0)
                  + tl.where(k2.to(tl.float32, bitcast=True) < f, 1.0, 0.0)
                  + tl.where(k3.to(tl.float32, bitcast=True) < f, 1.0, 0.0)
                  + tl.where(k4.to(tl.float32, bitcast=True) < f, 1.0, 0.0)
                  + tl.where(k5.to(tl.float32, bitcast=True) < f, 1.0, 0.0)
                  + tl.where(k6.to(tl.float32, bitcast=True) < f, 1.0, 0.0)
                  + tl.where(k7.to(tl.float32, bitcast=True) < f, 1.0, 0.0), axis=1)


@triton.jit
def _wtau(w0, w1, w2, w3, w4, w5, w6, w7, wc, mode, n, idx, DQ: tl.constexpr,
          BF16: tl.constexpr, INTERP: tl.constexpr):
    """``idx``-th smallest ``|x|`` of the rows (float32): mode 1 the max key, then ``n`` steps
    ``m <- max{key < m}``; mode 2 the min key, then ``n`` steps ``m <- min{key > m}``; mode 3 bisection on the
    15 bits of ``|x|`` (counts of keys below a candidate)."""
    SB: tl.constexpr = DQ // 2  # elements per block
    e = (w0 & 0) + 2 * wc[None, :]
    a0, b0 = _wkeys(w0, e, 0, INTERP)
    a1, b1 = _wkeys(w1, e, DQ, INTERP)
    a2, b2 = _wkeys(w2, e, 2 * DQ, INTERP)
    a3, b3 = _wkeys(w3, e, 3 * DQ, INTERP)
    a4, b4 = _wkeys(w4, e, SB, INTERP)
    a5, b5 = _wkeys(w5, e, DQ + SB, INTERP)
    a6, b6 = _wkeys(w6, e, 2 * DQ + SB, INTERP)
    a7, b7 = _wkeys(w7, e, 3 * DQ + SB, INTERP)
    if mode == 1:
        m = tl.max(tl.maximum(tl.maximum(tl.maximum(a0, b0), tl.maximum(a1, b1)),
                              tl.maximum(tl.maximum(a2, b2), tl.maximum(a3, b3))), axis=1)
        m = tl.maximum(m, tl.max(tl.maximum(tl.maximum(tl.maximum(a4, b4), tl.maximum(a5, b5)),
                                            tl.maximum(tl.maximum(a6, b6), tl.maximum(a7, b7))), axis=1))
        for _ in range(n):
            c = (m - 1)[:, None] + tl.zeros_like(a0)
            acc = _wstep(c, a0, b0, a1, b1, a2, b2, a3, b3, True, INTERP)
            acc = tl.minimum(acc.to(tl.uint32, bitcast=True), _wstep(c, a4, b4, a5, b5, a6, b6, a7, b7, True,
                                                                    INTERP).to(tl.uint32, bitcast=True))
            m = m - 1 - tl.min(acc.to(tl.uint32, bitcast=True), axis=1).to(tl.int32, bitcast=True)
        a16 = m >> 16
    elif mode == 2:
        m = tl.min(tl.minimum(tl.minimum(tl.minimum(a0, b0), tl.minimum(a1, b1)),
                              tl.minimum(tl.minimum(a2, b2), tl.minimum(a3, b3))), axis=1)
        m = tl.minimum(m, tl.min(tl.minimum(tl.minimum(tl.minimum(a4, b4), tl.minimum(a5, b5)),
                                            tl.minimum(tl.minimum(a6, b6), tl.minimum(a7, b7))), axis=1))
        for _ in range(n):
            c = (m + 1)[:, None] + tl.zeros_like(a0)
            acc = _wstep(c, a0, b0, a1, b1, a2, b2, a3, b3, False, INTERP)
            acc = tl.minimum(acc.to(tl.uint32, bitcast=True), _wstep(c, a4, b4, a5, b5, a6, b6, a7, b7, False,
                                                                    INTERP).to(tl.uint32, bitcast=True))
            m = m + 1 + tl.min(acc.to(tl.uint32, bitcast=True), axis=1).to(tl.int32, bitcast=True)
        a16 = m >> 16
    else:
        a16 = tl.zeros([w0.shape[0]], tl.int32)
        for b in tl.static_range(14, -1, -1):
            cand = ((a16 | (1 << b)) << 16).to(tl.float32, bitcast=True)  # never beyond +inf (finite rows)
            cnt = _wcount(a0, b0, a1, b1, a2, b2, a3, b3, cand)
            cnt += _wcount(a4, b4, a5, b5, a6, b6, a7, b7, cand)
            a16 = tl.where(cnt <= idx, a16 | (1 << b), a16)
    return _from16(a16, BF16)


@triton.jit
def _wwin(w0, w1, w2, w3, w4, w5, w6, w7, wc, nb, n, DQ: tl.constexpr, TB: tl.constexpr,
          CLAMP: tl.constexpr, INTERP: tl.constexpr):
    """Window value ``v`` of the key :func:`_wtau` mode 1 ends on (the max key, then ``n`` steps
    ``m <- max{key < m}``), on 16-bit keys, two per word: ``key = v << TB | tag``, ``v = clamp(p + nb, 0,
    VMAX)`` (``p`` the bits of ``|x|``, ``VMAX = 2^(16 - TB) - 1``; CLAMP: the upper clamp, which the first
    window does not need), the tag the element index (``TB = log2 d`` bits): unique keys, ordered by ``p``
    wherever ``p + nb`` is not clamped. A step is one add-min per word: keys ``>= m`` wrap to the top of the lanes."""
    SB: tl.constexpr = DQ // 2
    z = w0 & 0
    nb2 = ((nb & 0xFFFF) * 65537)[:, None] + z
    top2 = ((((1 << (16 - TB)) - 1 - nb) & 0xFFFF) * 65537)[:, None] + z
    ne = z + (-131074) * wc[None, :]  # -(e * 0x10001), e = 2 wc; the tags are e + E0 (low), e + E0 + 1 (high)
    k0 = _pk_nkeys(w0, nb2, top2, ne, -1 - 65536, TB, CLAMP, INTERP)
    k1 = _pk_nkeys(w1, nb2, top2, ne, -1 - DQ * 65537 - 65536, TB, CLAMP, INTERP)
    k2 = _pk_nkeys(w2, nb2, top2, ne, -1 - 2 * DQ * 65537 - 65536, TB, CLAMP, INTERP)
    k3 = _pk_nkeys(w3, nb2, top2, ne, -1 - 3 * DQ * 65537 - 65536, TB, CLAMP, INTERP)
    mn = _pk_umin(_pk_umin(k0, k1, INTERP), _pk_umin(k2, k3, INTERP), INTERP)
    k4 = _pk_nkeys(w4, nb2, top2, ne, -1 - SB * 65537 - 65536, TB, CLAMP, INTERP)
    k5 = _pk_nkeys(w5, nb2, top2, ne, -1 - (DQ + SB) * 65537 - 65536, TB, CLAMP, INTERP)
    k6 = _pk_nkeys(w6, nb2, top2, ne, -1 - (2 * DQ + SB) * 65537 - 65536, TB, CLAMP, INTERP)
    k7 = _pk_nkeys(w7, nb2, top2, ne, -1 - (3 * DQ + SB) * 65537 - 65536, TB, CLAMP, INTERP)
    mn = _pk_umin(mn, _pk_umin(_pk_umin(k4, k5, INTERP), _pk_umin(k6, k7, INTERP), INTERP), INTERP)
    m2 = -1 - _pk_rowmin2(mn, INTERP)  # the max key in both lanes (complemented keys: their min)
    for _ in range(n):  # lanes k + m = m - 1 - key (mod 2^16): the next key below m gives the smallest
        mb = m2[:, None] + z
        acc = _pk_addmin(_pk_addmin(_pk_addmin(_pk_add(k0, mb, INTERP), k1, mb, INTERP), k2, mb, INTERP), k3, mb,
                         INTERP)
        acc = _pk_addmin(_pk_addmin(_pk_addmin(_pk_addmin(acc, k4, mb, INTERP), k5, mb, INTERP), k6, mb, INTERP),
                         k7, mb, INTERP)
        m2 = m2 - 65537 - _pk_rowmin2(acc, INTERP)  # lane-wise m - 1 - y >= 0: no borrow
    return (m2 & 0xFFFF) >> TB


@triton.jit
def _wbelow(w0, w1, w2, w3, w4, w5, w6, w7, nb, INTERP: tl.constexpr):
    """Per row, ``y = -nb - q``: how far below ``-nb`` (the bottom of the window ``nb``, whose keys are 0 for
    ``p <= -nb``) the row's largest bits ``q`` of ``|x|`` at or below ``-nb`` lie (rows with such an element;
    garbage for the others). One linear :func:`_pk_below` chain over the words, then a packed row minimum."""
    l2 = (((1 - nb) & 0xFFFF) * 65537)[:, None] + (w0 & 0)
    acc = _pk_below(_pk_below(_pk_below(_pk_below(w0 | -1, w0, l2, INTERP), w1, l2, INTERP), w2, l2, INTERP), w3,
                    l2, INTERP)
    acc = _pk_below(_pk_below(_pk_below(_pk_below(acc, w4, l2, INTERP), w5, l2, INTERP), w6, l2, INTERP), w7,
                    l2, INTERP)
    return _pk_rowmin2(acc, INTERP) & 0xFFFF


@triton.jit
def _wtau_win(w0, w1, w2, w3, w4, w5, w6, w7, wc, lo, hi, n, valid, DQ: tl.constexpr,
              BF16: tl.constexpr, TB: tl.constexpr, INTERP: tl.constexpr):
    """:func:`_wtau` mode 1 by :func:`_wwin`: the first window ends at ``p(max |x|)`` (``nb = VMAX - p_max``),
    exact where the order statistic has ``v >= 1``, i.e. lies less than ``VMAX`` 16-bit steps below ``max |x|``
    (4 binades of bfloat16 at d = 128). Blocks with a row below it (a block-uniform branch) repeat with lower
    windows, each ending one step above ``q``, the row's largest ``p`` below the last window (:func:`_wbelow`,
    one pass over the words: empty stretches of the row cost nothing): ``nb <- VMAX - 1 - q``, at least
    ``VMAX - 1`` steps lower. The keys above a lower window (``p > q``, all inside the windows above, so fewer
    than ``n + 1`` of them) are clamped to ``VMAX``, ``q`` itself has ``v = VMAX - 1``, so the order statistic
    is exact where ``v >= 1``; each window holds at least one more key than the last (``q``), so a row needs at
    most ``n + 1`` windows. Returns ``tau`` and the number of windows the block ran (for the tests)."""
    VMAX: tl.constexpr = (1 << (16 - TB)) - 1
    amax = tl.maximum(hi, -lo)
    if BF16:
        pmax = amax.to(tl.int32, bitcast=True) >> 16
    else:
        pmax = _f32_to16(amax, False)
    nb = VMAX - pmax
    v = _wwin(w0, w1, w2, w3, w4, w5, w6, w7, wc, nb, n, DQ, TB, False, INTERP)
    a16 = v - nb
    bad = valid & (v == 0)
    nwin = 1
    while tl.max(bad.to(tl.int32), axis=0) > 0:
        nb = nb + (VMAX - 1) + _wbelow(w0, w1, w2, w3, w4, w5, w6, w7, nb, INTERP)
        v = _wwin(w0, w1, w2, w3, w4, w5, w6, w7, wc, nb, n, DQ, TB, True, INTERP)
        a16 = tl.where(bad, v - nb, a16)
        bad = bad & (v == 0)
        nwin += 1
    return _from16(a16, BF16), nwin


@triton.jit
def _wload(xw_ptr, sx0, sx1, sxh, idx0_ptr, idx1_ptr, slots_ptr, N, blk, h, wc, DQ: tl.constexpr,
           BLOCK_R: tl.constexpr, GATHER: tl.constexpr):
    """Slots and the word blocks of row block ``blk`` (strides in 16-bit elements, all even)."""
    HW: tl.constexpr = DQ // 2
    SW: tl.constexpr = HW // 2
    rows = blk * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < N
    slot = tl.load(slots_ptr + rows, mask=rmask, other=-1)
    if GATHER:
        lmask = rmask & (slot >= 0)
        i0 = tl.load(idx0_ptr + rows, mask=lmask, other=0).to(tl.int64)
        i1 = tl.load(idx1_ptr + rows, mask=lmask, other=0).to(tl.int64)
        xbase = i0 * sx0 + i1 * sx1 + h * sxh
    else:
        lmask = rmask
        xbase = rows.to(tl.int64) * sx0 + h * sxh
    p = xw_ptr + (xbase >> 1)[:, None] + wc[None, :]
    lm = lmask[:, None]
    w0 = tl.load(p, mask=lm)  # rows not loaded hold garbage: they are never written, and rows never mix
    w1 = tl.load(p + HW, mask=lm)
    w2 = tl.load(p + 2 * HW, mask=lm)
    w3 = tl.load(p + 3 * HW, mask=lm)
    w4 = tl.load(p + SW, mask=lm)
    w5 = tl.load(p + HW + SW, mask=lm)
    w6 = tl.load(p + 2 * HW + SW, mask=lm)
    w7 = tl.load(p + 3 * HW + SW, mask=lm)
    return slot, w0, w1, w2, w3, w4, w5, w6, w7


@triton.jit
def _wprocess(slot, w0, w1, w2, w3, w4, w5, w6, w7, blk, h, wc, mode, n, idx, cw_ptr, scale_ptr, offset_ptr,
              sc_p, sc_h, sc_r, sm_p, sm_h, sm_r, N, DQ: tl.constexpr, PAGE: tl.constexpr,
              BLOCK_R: tl.constexpr, META: tl.constexpr, BF16: tl.constexpr,
              WIN: tl.constexpr, TB: tl.constexpr, INTERP: tl.constexpr):
    """Quantize one row block of 16-bit words; write codes and metadata into the slots. WIN: the clip by
    :func:`_wtau_win` (the launcher saw mode 1), without compiling the int32 keys of :func:`_wtau` (a kernel
    holds registers for its largest path: 128 with them, 96 without, sm_90 AOT build)."""
    SW: tl.constexpr = DQ // 4
    rows = blk * BLOCK_R + tl.arange(0, BLOCK_R)
    valid = (rows < N) & (slot >= 0)  # negative slot = padding row: never written
    lo = _wrange(w0, w1, w2, w3, w4, w5, w6, w7, BF16, False, INTERP)
    hi = _wrange(w0, w1, w2, w3, w4, w5, w6, w7, BF16, True, INTERP)
    tau = tl.full([BLOCK_R], float("inf"), tl.float32)
    if WIN:  # the launcher saw mode 1 (top-down)
        tau, _ = _wtau_win(w0, w1, w2, w3, w4, w5, w6, w7, wc, lo, hi, n, valid, DQ, BF16, TB, INTERP)
    elif mode > 0:
        tau = _wtau(w0, w1, w2, w3, w4, w5, w6, w7, wc, mode, n, idx, DQ, BF16, INTERP)
    sc, lo_s, b1, b2, b3 = _group_params_x(lo, hi, tau, META, BF16)
    s32 = slot.to(tl.int32)  # slots < 2^31; int64 only for the page offsets (pools may exceed 2 GB)
    page = (s32 // PAGE).to(tl.int64)
    prow = s32 % PAGE
    mrow = page * sm_p + (h * sm_h + prow * sm_r)
    _store_meta(scale_ptr + mrow, sc, valid)
    _store_meta(offset_ptr + mrow, lo_s, valid)
    cbase = ((page * sc_p + (h * sc_h + prow * sc_r)) >> 1)[:, None]  # in 16-bit words
    ccol = tl.max_contiguous(tl.multiple_of(wc, SW), SW)  # stores in the layout of the words
    sm = valid[:, None]
    z = tl.zeros_like(w0)
    b1 = b1[:, None] + z
    b2 = b2[:, None] + z
    b3 = b3[:, None] + z
    tl.store(cw_ptr + cbase + ccol[None, :], _wcodes(w0, w1, w2, w3, b1, b2, b3, BF16, INTERP).to(tl.int16),
             mask=sm)
    tl.store(cw_ptr + cbase + SW + ccol[None, :],
             _wcodes(w4, w5, w6, w7, b1, b2, b3, BF16, INTERP).to(tl.int16), mask=sm)


@triton.jit
def _wside(x_ptr, sx0, sx1, sxh, mode, n, idx, codes_ptr, scale_ptr, offset_ptr, idx0_ptr, idx1_ptr,
           sc_p, sc_h, sc_r, sm_p, sm_h, sm_r, slots_ptr, N, h, DQ: tl.constexpr, PAGE: tl.constexpr,
           BLOCK_R: tl.constexpr, GATHER: tl.constexpr, META: tl.constexpr, WIN: tl.constexpr, TB: tl.constexpr,
           INTERP: tl.constexpr):
    """Row blocks ``pid, pid + programs, ...`` of one KV head of one side."""
    BF16: tl.constexpr = x_ptr.dtype.element_ty == tl.bfloat16
    SW: tl.constexpr = DQ // 4
    xw = x_ptr.to(tl.pointer_type(tl.int32))
    cw = codes_ptr.to(tl.pointer_type(tl.int16))
    wc = tl.arange(0, SW)
    for blk in range(tl.program_id(0), tl.cdiv(N, BLOCK_R), tl.num_programs(0)):
        slot, w0, w1, w2, w3, w4, w5, w6, w7 = _wload(xw, sx0, sx1, sxh, idx0_ptr, idx1_ptr, slots_ptr, N, blk, h,
                                                      wc, DQ, BLOCK_R, GATHER)
        _wprocess(slot, w0, w1, w2, w3, w4, w5, w6, w7, blk, h, wc, mode, n, idx, cw, scale_ptr, offset_ptr,
                  sc_p, sc_h, sc_r, sm_p, sm_h, sm_r, N, DQ, PAGE, BLOCK_R, META, BF16, WIN, TB, INTERP)


# clip method, step count and idx are run-time values: one compiled kernel serves every ratio
@triton.jit(do_not_specialize=["kmode", "kn", "kidx", "vmode", "vn", "vidx", "N"])
def _quant16_kernel(
    kx, ksx0, ksx1, ksxh, kmode, kn, kidx, kcodes, kscale, koffset,
    vx, vsx0, vsx1, vsxh, vmode, vn, vidx, vcodes, vscale, voffset,
    idx0_ptr, idx1_ptr, sc_p, sc_h, sc_r, sm_p, sm_h, sm_r, slots_ptr, N,
    DQ: tl.constexpr, PAGE: tl.constexpr, BLOCK_R: tl.constexpr, GATHER: tl.constexpr, META: tl.constexpr,
    SIDES: tl.constexpr, K_WIN: tl.constexpr, V_WIN: tl.constexpr, TB: tl.constexpr, INTERP: tl.constexpr,
):
    """Grid ``(programs, Hkv, 2 if SIDES == 0 else 1)``: ``SIDES`` 0 both sides (V programs first in the grid,
    ``program_id(2) == 0``: at the default clips they run longer than K's, so the last wave is made of the
    shorter ones), 1 K only, 2 V only."""
    h = tl.program_id(1)
    if SIDES == 1 or (SIDES == 0 and tl.program_id(2) == 1):
        _wside(kx, ksx0, ksx1, ksxh, kmode, kn, kidx, kcodes, kscale, koffset, idx0_ptr, idx1_ptr, sc_p, sc_h,
               sc_r, sm_p, sm_h, sm_r, slots_ptr, N, h, DQ, PAGE, BLOCK_R, GATHER, META, K_WIN, TB, INTERP)
    else:
        _wside(vx, vsx0, vsx1, vsxh, vmode, vn, vidx, vcodes, vscale, voffset, idx0_ptr, idx1_ptr, sc_p, sc_h,
               sc_r, sm_p, sm_h, sm_r, slots_ptr, N, h, DQ, PAGE, BLOCK_R, GATHER, META, V_WIN, TB, INTERP)


def fast16_ok(pages: QuantPages, x: Tensor, strides: tuple, mean: Tensor | None) -> bool:
    """Whether :func:`_quant16_kernel` serves one side: 16-bit rows (bfloat16 or float16) without mean, read as
    32-bit words (unit last stride, even strides, 4-byte aligned); 2-bit codes, one group per row, ``d/8`` a
    power of two and ``d/8 >= 8`` (two 16-byte word blocks per quarter), ``d <= 256`` (8 index bits in the keys),
    codes written as 16-bit words (even strides)."""
    fmt = pages.fmt
    d = fmt.head_dim
    wq = d // 8
    return (mean is None and fmt.bits == 2 and fmt.groups == 1 and d <= 256 and wq & (wq - 1) == 0 and wq >= 8
            and x.dtype in (torch.float16, torch.bfloat16) and strides[3] == 1 and not any(s % 2 for s in strides[:3])
            and x.data_ptr() % 4 == 0 and pages.codes.data_ptr() % 2 == 0
            and not any(s % 2 for s in pages.codes.stride()[:3]))


def warps_for(k_mode: int, v_mode: int, k_win: bool, v_win: bool) -> int:
    """Warps per program: one where a side takes the windowed clip or neither side clips, else four (measured
    fastest on the H200, docs/kernels.md)."""
    return 1 if k_win or v_win or (k_mode == 0 and v_mode == 0) else 4


__all__ = ["fast16_ok", "warps_for"]
