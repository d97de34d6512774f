"""Triton kernels: center, clip, quantize and pack K and V rows straight into their page slots (one launch for
both; rows with a rotation are rotated in torch float32 first), keys in channel pages (whole pages, mean and
rotation fused), and the demotion of 16-bit rows to 2-bit pages; the launchers and their checks. The kernels'
row math (rounding, code thresholds, clip order statistic, group metadata and codes) is in
:mod:`oscarkv.kernels.quantize_math`.

Bit-exact with :func:`oscarkv.quant.quantize` (method section 3). A row is held as four column quarters
``x_j[c] = x[j * d/4 + c]``, so packing byte ``c`` is elementwise (no reshape) and the stores are vectors.
The clip threshold is the exact order statistic, ties included: top-down or bottom-up extraction (unique
keys for 16-bit rows, counts for float32 rows) or a bitwise bisection, whichever needs fewest passes over the
row for this ratio (a run-time choice). Divisions are correctly rounded (``div_rn``), metadata is rounded to
nearest even, codes are computed from the stored metadata. With a rotation the float32 rows come from torch's
einsum (row kernel) or a ``tf32x3`` dot (channel pages): the codes are bit-exact with ``quantize()`` of those
rows, which ``debug_rows`` exposes (docs/kernels.md).

Variant "fast16" (``_quant16_kernel``, 16-bit rows without mean, 2-bit, one group per row): rows read as 32-bit
words; min/max by packed bf16x2/f16x2 instructions; the clip by unique int32 keys (``|x| << 16 | tag``), one
fused add-min per element and step (inline-asm chains, which LLVM cannot turn into trees); the three code
thresholds moved into the input dtype (the smallest 16-bit value of each code, exact, per row), so that a code
is two packed compares on the raw words and the packed byte a few logic ops. Each asm helper has a plain-Triton
twin with the same result that the CPU interpreter runs (quantize_math.py).

"win=1" (bfloat16 rows; "win=2" also float16) replaces the top-down clip's int32 keys by 16-bit keys in a window
of ``2^(16 - log2 d) - 1`` 16-bit steps below ``max |x|`` (4 binades of bfloat16 at d = 128, half a binade of
float16), two per 32-bit word: a step is one VIADDMNMX.U16x2 per word instead of one VIADDMNMX.U32 per element.
Rows whose order statistic lies below the window are resolved by lower windows (a block-uniform loop that
the tests' Gaussian bfloat16 rows never enter), each ending one step above the row's largest ``|x|`` below the
last window (one packed subtract-min pass over the words, on this redo path only), so stretches of a row
without values cost nothing: at most ``n + 1`` windows, 2 for a row with fewer than ``n + 1`` nonzero values
or one huge outlier over tiny values (lower windows a fixed ``VMAX - 1`` steps apart walked such rows through
up to ~33 windows for bfloat16 at d = 128). Static sm_90 figures (Triton 3.6 AOT build, d = 128, split 2, 4
warps, not measured on a GPU): 42 vs 75 instructions per thread and extraction step, about 1118 vs 1433 per
thread and V row block at clip 0.92 (10 steps) and 908 vs 1058 for K at 0.96 (5 steps); 96 vs 128 registers
(5 vs 4 CTAs per SM), as the int32 keys are not compiled into a window kernel. The jump to the next value adds
73 instructions per thread to each redo window (344 vs 271 in the redo loop; one warp: 334 vs 261) and nothing
to the first window, 96 registers (one warp: 95, 96 before; a plain-Triton masked max per word instead had
taken the kernel to 158). Measured on the H200 (session 15,
``benchmarks/kernels_probe.py --only win --ref``, 32768 rows x 8 heads, K+V, bfloat16, clip 0.96 / 0.92, every
row bit-identical): win=0 0.0757 ms (43% of 4.7 TB/s), win=1 0.0672 ms (49%), win=1 with one warp per program
0.0617 ms (53%; 2 warps 0.0647, 8 warps 0.0834): the default for bfloat16 rows is win=1 with one warp where a
side takes the window; float16 rows keep the int32 keys (0.0763 ms; their windows, win=2: 0.1144 ms).
"""

from __future__ import annotations

import torch
from torch import Tensor

import triton
import triton.language as tl

from ..quant import clip_index
from ._triton_util import check_device, check_kv_formats, check_pool_strides, interpreting, next_pow2
from .layout import QuantPages
from .quantize_math import (_codes, _f32_to16, _from16, _group_params, _group_params_x, _h2max, _max4, _min4,
                            _part_codes, _part_range, _pk_add, _pk_addmin, _pk_below, _pk_nkeys, _pk_rowmin2,
                            _pk_umin, _round_meta, _store_meta, _subumin, _tau_f32, _tau_key16, _tau_sort, _threshold,
                            _to_f32, _w_hi, _w_lo, _wcodes)
from .reference import channel_page_ids

_META_CODE = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}
# code formulations: 0 = one div_rn per element, compared with the rounding boundaries (2-bit default);
# 1 = one div_rn per element, floor + clamp (4-bit default); 2, 3 = per-row exact thresholds (no division per
# element), found by a 7-probe search within +-64 ulps (2), a 2-probe search within a few ulps (3) or from the
# exact float64 product of the scale and the rounding boundary (4, no division)
_CODE_FORMS = {"code_div": 0, "code_floor": 1, "code_thr": 2, "code_thr8": 3, "code_thr64": 4}
# clip order statistic, forced (default: the cheapest for the ratio): 1 top-down extraction, 2 bottom-up,
# 3 bitwise bisection, 4 bitonic sort (a slow independent cross-check)
_CLIP_FORMS = {"clip_top": 1, "clip_bottom": 2, "clip_bisect": 3, "clip_sort": 4}
_TUNING = ("block_r", "warps", "bpp", "prefetch", "split", "hred", "win", "regs", "warps0")
# kernels: "rows" (_quantize_kv_kernel, every format) or "fast16" (_quant16_kernel: 16-bit rows without mean or
# rotation, 2-bit, one group per row, d/8 a power of two, d <= 256; other launches fall back to "rows")
_KERNELS = ("rows", "fast16")


# ------------------------------------------------------------------------------------------- token pages
@triton.jit
def _load_rows(x_ptr, sx0, sx1, sxh, sxd, idx0_ptr, idx1_ptr, slots_ptr, N, blk, h, cols, cmask,
               DQ: tl.constexpr, BLOCK_R: tl.constexpr, GATHER: tl.constexpr, PADC: tl.constexpr):
    """Slots and raw input of row block ``blk``: four quarters ``[BLOCK_R, CP]``. Rows past ``N`` load nothing."""
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
def _process_rows(slot, r0, r1, r2, r3, blk, h, cols, cmask, mu0, mu1, mu2, mu3,
                  mode, n, idx, codes_ptr, scale_ptr, offset_ptr, sc_p, sc_h, sc_r, sm_p, sm_h, sm_r, dbg_ptr,
                  N, num_heads,
                  D: tl.constexpr, DQ: tl.constexpr, CP: tl.constexpr, BITS: tl.constexpr,
                  G: tl.constexpr, NG: tl.constexpr, PAGE: tl.constexpr, BLOCK_R: tl.constexpr, HAS_MEAN: tl.constexpr,
                  KEY16: tl.constexpr, PADC: tl.constexpr, META: tl.constexpr,
                  DEBUG: tl.constexpr, CODES: tl.constexpr, CLIP_SORT: tl.constexpr):
    """Quantize one row block (quarters ``x_j``), write codes and metadata into the slots."""
    LEVELS: tl.constexpr = (1 << BITS) - 1
    rows = blk * BLOCK_R + tl.arange(0, BLOCK_R)
    valid = (rows < N) & (slot >= 0)  # negative slot = padding row (vLLM convention): never written
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
    x_ptr, sx0, sx1, sxh, sxd, mean_ptr, mode, n, idx, codes_ptr, scale_ptr, offset_ptr,
    dbg_ptr, idx0_ptr, idx1_ptr, sc_p, sc_h, sc_r, sm_p, sm_h, sm_r, slots_ptr, N, num_heads, h,
    D: tl.constexpr, DQ: tl.constexpr, CP: tl.constexpr, BITS: tl.constexpr,
    G: tl.constexpr, NG: tl.constexpr, PAGE: tl.constexpr, BLOCK_R: tl.constexpr, GATHER: tl.constexpr,
    HAS_MEAN: tl.constexpr, KEY16: tl.constexpr, META: tl.constexpr,
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
    if HAS_MEAN:
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
                                          cols, cmask, DQ, BLOCK_R, GATHER, PADC)
        for blk in range(pid, nblk, npr):
            nslot, n0, n1, n2, n3 = _load_rows(x_ptr, sx0, sx1, sxh, sxd, idx0_ptr, idx1_ptr, slots_ptr, N,
                                               blk + npr, h, cols, cmask, DQ, BLOCK_R, GATHER, PADC)
            _process_rows(slot, r0, r1, r2, r3, blk, h, cols, cmask, mu0, mu1, mu2, mu3, mode, n, idx, codes_ptr,
                          scale_ptr, offset_ptr, sc_p, sc_h, sc_r, sm_p, sm_h, sm_r, dbg_ptr, N, num_heads, D, DQ, CP,
                          BITS, G, NG, PAGE, BLOCK_R, HAS_MEAN, KEY16, PADC, META, DEBUG, CODES, CLIP_SORT)
            slot, r0, r1, r2, r3 = nslot, n0, n1, n2, n3
    else:
        for blk in range(pid, nblk, npr):
            slot, r0, r1, r2, r3 = _load_rows(x_ptr, sx0, sx1, sxh, sxd, idx0_ptr, idx1_ptr, slots_ptr, N, blk,
                                              h, cols, cmask, DQ, BLOCK_R, GATHER, PADC)
            _process_rows(slot, r0, r1, r2, r3, blk, h, cols, cmask, mu0, mu1, mu2, mu3, mode, n, idx, codes_ptr,
                          scale_ptr, offset_ptr, sc_p, sc_h, sc_r, sm_p, sm_h, sm_r, dbg_ptr, N, num_heads, D, DQ, CP,
                          BITS, G, NG, PAGE, BLOCK_R, HAS_MEAN, KEY16, PADC, META, DEBUG, CODES, CLIP_SORT)


# clip method, step count and idx are run-time values: one compiled kernel serves every ratio
@triton.jit(do_not_specialize=["kmode", "kn", "kidx", "vmode", "vn", "vidx", "N"])
def _quantize_kv_kernel(
    kx, ksx0, ksx1, ksxh, ksxd, kmean, kmode, kn, kidx, kcodes, kscale, koffset, kdbg,
    vx, vsx0, vsx1, vsxh, vsxd, vmean, vmode, vn, vidx, vcodes, vscale, voffset, vdbg,
    idx0_ptr, idx1_ptr, sc_p, sc_h, sc_r, sm_p, sm_h, sm_r, slots_ptr, N, num_heads,
    D: tl.constexpr, DQ: tl.constexpr, CP: tl.constexpr, BITS: tl.constexpr,
    G: tl.constexpr, NG: tl.constexpr, PAGE: tl.constexpr, BLOCK_R: tl.constexpr, GATHER: tl.constexpr,
    K_MEAN: tl.constexpr, K_KEY16: tl.constexpr, V_MEAN: tl.constexpr, V_KEY16: tl.constexpr, META: tl.constexpr,
    DEBUG: tl.constexpr, CODES: tl.constexpr, CLIP_SORT: tl.constexpr, PREFETCH: tl.constexpr, SIDE0: tl.constexpr,
):
    h = tl.program_id(1)
    if tl.program_id(2) + SIDE0 == 0:  # SIDE0 = 1: V only (K went to channel pages)
        _quant_side(kx, ksx0, ksx1, ksxh, ksxd, kmean, kmode, kn, kidx, kcodes, kscale, koffset,
                    kdbg, idx0_ptr, idx1_ptr, sc_p, sc_h, sc_r, sm_p, sm_h, sm_r, slots_ptr, N, num_heads, h,
                    D, DQ, CP, BITS, G, NG, PAGE, BLOCK_R, GATHER, K_MEAN, K_KEY16, META, DEBUG, CODES,
                    CLIP_SORT, PREFETCH)
    else:
        _quant_side(vx, vsx0, vsx1, vsxh, vsxd, vmean, vmode, vn, vidx, vcodes, vscale, voffset,
                    vdbg, idx0_ptr, idx1_ptr, sc_p, sc_h, sc_r, sm_p, sm_h, sm_r, slots_ptr, N, num_heads, h,
                    D, DQ, CP, BITS, G, NG, PAGE, BLOCK_R, GATHER, V_MEAN, V_KEY16, META, DEBUG, CODES,
                    CLIP_SORT, PREFETCH)


# ------------------------------------------------------------------------------- 16-bit rows, fast path
# A row of d 16-bit floats is read as d/2 int32 words (16-byte loads), four quarters of d/8 words, each split
# into SPLIT column blocks (SPLIT 2: a row spans half as many threads, so the per-row scalar work and the
# cross-thread reductions are shared by fewer threads). Word c of block (j, s) holds elements e and e + 1,
# e = j d/4 + s d/(4 SPLIT) + 2c, in its low and high half; its code bytes are bytes e - j d/4 and the next of
# the row's packed codes, stored as one 16-bit word.
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
def _wrange(w0, w1, w2, w3, w4, w5, w6, w7, SPLIT: tl.constexpr, BF16: tl.constexpr, MAX: tl.constexpr,
            HRED: tl.constexpr, INTERP: tl.constexpr):
    """Per-row max (MAX) or min of the 16-bit elements, float32: packed max/min across the word blocks, then
    across the thread's words and the row's threads in float32."""
    r = _h2max(_h2max(w0, w1, BF16, MAX, INTERP), _h2max(w2, w3, BF16, MAX, INTERP), BF16, MAX, INTERP)
    if SPLIT == 2:
        r = _h2max(r, _h2max(_h2max(w4, w5, BF16, MAX, INTERP), _h2max(w6, w7, BF16, MAX, INTERP), BF16, MAX,
                                 INTERP), BF16, MAX, INTERP)
    if INTERP or not HRED:
        if MAX:
            v = tl.max(tl.maximum(_w_lo(r, BF16), _w_hi(r, BF16)), axis=1)
        else:
            v = tl.min(tl.minimum(_w_lo(r, BF16), _w_hi(r, BF16)), axis=1)
    else:  # HRED: packed across the thread's words and the row's threads too (asm in a reduce), then halves
        if BF16:
            if MAX:
                r = tl.reduce(r, 1, _bmax)
            else:
                r = tl.reduce(r, 1, _bmin)
        else:
            if MAX:
                r = tl.reduce(r, 1, _fmax)
            else:
                r = tl.reduce(r, 1, _fmin)
        if MAX:
            v = tl.maximum(_w_lo(r, BF16), _w_hi(r, BF16))
        else:
            v = tl.minimum(_w_lo(r, BF16), _w_hi(r, BF16))
    return v


@triton.jit
def _bmax(a, b):
    return _h2max(a, b, True, True, False)


@triton.jit
def _bmin(a, b):
    return _h2max(a, b, True, False, False)


@triton.jit
def _fmax(a, b):
    return _h2max(a, b, False, True, False)


@triton.jit
def _fmin(a, b):
    return _h2max(a, b, False, False, False)


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
def _wtau(w0, w1, w2, w3, w4, w5, w6, w7, wc, mode, n, idx, DQ: tl.constexpr, SPLIT: tl.constexpr,
          BF16: tl.constexpr, INTERP: tl.constexpr):
    """``idx``-th smallest ``|x|`` of the rows (float32): mode 1 the max key, then ``n`` steps
    ``m <- max{key < m}``; mode 2 the min key, then ``n`` steps ``m <- min{key > m}``; mode 3 bisection on the
    15 bits of ``|x|`` (counts of keys below a candidate)."""
    SB: tl.constexpr = DQ // SPLIT  # elements per block
    e = (w0 & 0) + 2 * wc[None, :]
    a0, b0 = _wkeys(w0, e, 0, INTERP)
    a1, b1 = _wkeys(w1, e, DQ, INTERP)
    a2, b2 = _wkeys(w2, e, 2 * DQ, INTERP)
    a3, b3 = _wkeys(w3, e, 3 * DQ, INTERP)
    if SPLIT == 2:
        a4, b4 = _wkeys(w4, e, SB, INTERP)
        a5, b5 = _wkeys(w5, e, DQ + SB, INTERP)
        a6, b6 = _wkeys(w6, e, 2 * DQ + SB, INTERP)
        a7, b7 = _wkeys(w7, e, 3 * DQ + SB, INTERP)
    else:  # placeholders, never used
        a4, b4, a5, b5, a6, b6, a7, b7 = a0, b0, a1, b1, a2, b2, a3, b3
    if mode == 1:
        m = tl.max(tl.maximum(tl.maximum(tl.maximum(a0, b0), tl.maximum(a1, b1)),
                              tl.maximum(tl.maximum(a2, b2), tl.maximum(a3, b3))), axis=1)
        if SPLIT == 2:
            m = tl.maximum(m, tl.max(tl.maximum(tl.maximum(tl.maximum(a4, b4), tl.maximum(a5, b5)),
                                                tl.maximum(tl.maximum(a6, b6), tl.maximum(a7, b7))), axis=1))
        for _ in range(n):
            c = (m - 1)[:, None] + tl.zeros_like(a0)
            acc = _wstep(c, a0, b0, a1, b1, a2, b2, a3, b3, True, INTERP)
            if SPLIT == 2:
                acc = tl.minimum(acc.to(tl.uint32, bitcast=True), _wstep(c, a4, b4, a5, b5, a6, b6, a7, b7, True,
                                                                        INTERP).to(tl.uint32, bitcast=True))
            m = m - 1 - tl.min(acc.to(tl.uint32, bitcast=True), axis=1).to(tl.int32, bitcast=True)
        a16 = m >> 16
    elif mode == 2:
        m = tl.min(tl.minimum(tl.minimum(tl.minimum(a0, b0), tl.minimum(a1, b1)),
                              tl.minimum(tl.minimum(a2, b2), tl.minimum(a3, b3))), axis=1)
        if SPLIT == 2:
            m = tl.minimum(m, tl.min(tl.minimum(tl.minimum(tl.minimum(a4, b4), tl.minimum(a5, b5)),
                                                tl.minimum(tl.minimum(a6, b6), tl.minimum(a7, b7))), axis=1))
        for _ in range(n):
            c = (m + 1)[:, None] + tl.zeros_like(a0)
            acc = _wstep(c, a0, b0, a1, b1, a2, b2, a3, b3, False, INTERP)
            if SPLIT == 2:
                acc = tl.minimum(acc.to(tl.uint32, bitcast=True), _wstep(c, a4, b4, a5, b5, a6, b6, a7, b7, False,
                                                                        INTERP).to(tl.uint32, bitcast=True))
            m = m + 1 + tl.min(acc.to(tl.uint32, bitcast=True), axis=1).to(tl.int32, bitcast=True)
        a16 = m >> 16
    else:
        a16 = tl.zeros([w0.shape[0]], tl.int32)
        for b in tl.static_range(14, -1, -1):
            cand = ((a16 | (1 << b)) << 16).to(tl.float32, bitcast=True)  # never beyond +inf (finite rows)
            cnt = _wcount(a0, b0, a1, b1, a2, b2, a3, b3, cand)
            if SPLIT == 2:
                cnt += _wcount(a4, b4, a5, b5, a6, b6, a7, b7, cand)
            a16 = tl.where(cnt <= idx, a16 | (1 << b), a16)
    return _from16(a16, BF16)


@triton.jit
def _wwin(w0, w1, w2, w3, w4, w5, w6, w7, wc, nb, n, DQ: tl.constexpr, SPLIT: tl.constexpr, TB: tl.constexpr,
          CLAMP: tl.constexpr, INTERP: tl.constexpr):
    """Window value ``v`` of the key :func:`_wtau` mode 1 ends on (the max key, then ``n`` steps
    ``m <- max{key < m}``), on 16-bit keys, two per word: ``key = v << TB | tag``, ``v = clamp(p + nb, 0,
    VMAX)`` (``p`` the bits of ``|x|``, ``VMAX = 2^(16 - TB) - 1``; CLAMP: the upper clamp, which the first
    window does not need), the tag the element index (``TB = log2 d`` bits): unique keys, ordered by ``p``
    wherever ``p + nb`` is not clamped. A step is one add-min per word: keys ``>= m`` wrap to the top of the lanes."""
    SB: tl.constexpr = DQ // SPLIT
    z = w0 & 0
    nb2 = ((nb & 0xFFFF) * 65537)[:, None] + z
    top2 = ((((1 << (16 - TB)) - 1 - nb) & 0xFFFF) * 65537)[:, None] + z
    ne = z + (-131074) * wc[None, :]  # -(e * 0x10001), e = 2 wc; the tags are e + E0 (low), e + E0 + 1 (high)
    k0 = _pk_nkeys(w0, nb2, top2, ne, -1 - 65536, TB, CLAMP, INTERP)
    k1 = _pk_nkeys(w1, nb2, top2, ne, -1 - DQ * 65537 - 65536, TB, CLAMP, INTERP)
    k2 = _pk_nkeys(w2, nb2, top2, ne, -1 - 2 * DQ * 65537 - 65536, TB, CLAMP, INTERP)
    k3 = _pk_nkeys(w3, nb2, top2, ne, -1 - 3 * DQ * 65537 - 65536, TB, CLAMP, INTERP)
    mn = _pk_umin(_pk_umin(k0, k1, INTERP), _pk_umin(k2, k3, INTERP), INTERP)
    if SPLIT == 2:
        k4 = _pk_nkeys(w4, nb2, top2, ne, -1 - SB * 65537 - 65536, TB, CLAMP, INTERP)
        k5 = _pk_nkeys(w5, nb2, top2, ne, -1 - (DQ + SB) * 65537 - 65536, TB, CLAMP, INTERP)
        k6 = _pk_nkeys(w6, nb2, top2, ne, -1 - (2 * DQ + SB) * 65537 - 65536, TB, CLAMP, INTERP)
        k7 = _pk_nkeys(w7, nb2, top2, ne, -1 - (3 * DQ + SB) * 65537 - 65536, TB, CLAMP, INTERP)
        mn = _pk_umin(mn, _pk_umin(_pk_umin(k4, k5, INTERP), _pk_umin(k6, k7, INTERP), INTERP), INTERP)
    else:  # placeholders, never used
        k4, k5, k6, k7 = k0, k1, k2, k3
    m2 = -1 - _pk_rowmin2(mn, INTERP)  # the max key in both lanes (complemented keys: their min)
    for _ in range(n):  # lanes k + m = m - 1 - key (mod 2^16): the next key below m gives the smallest
        mb = m2[:, None] + z
        acc = _pk_addmin(_pk_addmin(_pk_addmin(_pk_add(k0, mb, INTERP), k1, mb, INTERP), k2, mb, INTERP), k3, mb,
                         INTERP)
        if SPLIT == 2:
            acc = _pk_addmin(_pk_addmin(_pk_addmin(_pk_addmin(acc, k4, mb, INTERP), k5, mb, INTERP), k6, mb, INTERP),
                             k7, mb, INTERP)
        m2 = m2 - 65537 - _pk_rowmin2(acc, INTERP)  # lane-wise m - 1 - y >= 0: no borrow
    return (m2 & 0xFFFF) >> TB


@triton.jit
def _wbelow(w0, w1, w2, w3, w4, w5, w6, w7, nb, SPLIT: tl.constexpr, INTERP: tl.constexpr):
    """Per row, ``y = -nb - q``: how far below ``-nb`` (the bottom of the window ``nb``, whose keys are 0 for
    ``p <= -nb``) the row's largest bits ``q`` of ``|x|`` at or below ``-nb`` lie (rows with such an element;
    garbage for the others). One linear :func:`_pk_below` chain over the words, then a packed row minimum."""
    l2 = (((1 - nb) & 0xFFFF) * 65537)[:, None] + (w0 & 0)
    acc = _pk_below(_pk_below(_pk_below(_pk_below(w0 | -1, w0, l2, INTERP), w1, l2, INTERP), w2, l2, INTERP), w3,
                    l2, INTERP)
    if SPLIT == 2:
        acc = _pk_below(_pk_below(_pk_below(_pk_below(acc, w4, l2, INTERP), w5, l2, INTERP), w6, l2, INTERP), w7,
                        l2, INTERP)
    return _pk_rowmin2(acc, INTERP) & 0xFFFF


@triton.jit
def _wtau_win(w0, w1, w2, w3, w4, w5, w6, w7, wc, lo, hi, n, valid, DQ: tl.constexpr, SPLIT: tl.constexpr,
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
    v = _wwin(w0, w1, w2, w3, w4, w5, w6, w7, wc, nb, n, DQ, SPLIT, TB, False, INTERP)
    a16 = v - nb
    bad = valid & (v == 0)
    nwin = 1
    while tl.max(bad.to(tl.int32), axis=0) > 0:
        nb = nb + (VMAX - 1) + _wbelow(w0, w1, w2, w3, w4, w5, w6, w7, nb, SPLIT, INTERP)
        v = _wwin(w0, w1, w2, w3, w4, w5, w6, w7, wc, nb, n, DQ, SPLIT, TB, True, INTERP)
        a16 = tl.where(bad, v - nb, a16)
        bad = bad & (v == 0)
        nwin += 1
    return _from16(a16, BF16), nwin


@triton.jit
def _wload(xw_ptr, sx0, sx1, sxh, idx0_ptr, idx1_ptr, slots_ptr, N, blk, h, wc, DQ: tl.constexpr,
           SPLIT: tl.constexpr, BLOCK_R: tl.constexpr, GATHER: tl.constexpr):
    """Slots and the word blocks of row block ``blk`` (strides in 16-bit elements, all even)."""
    HW: tl.constexpr = DQ // 2
    SW: tl.constexpr = HW // SPLIT
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
    if SPLIT == 2:
        w4 = tl.load(p + SW, mask=lm)
        w5 = tl.load(p + HW + SW, mask=lm)
        w6 = tl.load(p + 2 * HW + SW, mask=lm)
        w7 = tl.load(p + 3 * HW + SW, mask=lm)
    else:
        w4, w5, w6, w7 = w0, w1, w2, w3
    return slot, w0, w1, w2, w3, w4, w5, w6, w7


@triton.jit
def _wprocess(slot, w0, w1, w2, w3, w4, w5, w6, w7, blk, h, wc, mode, n, idx, cw_ptr, scale_ptr, offset_ptr,
              sc_p, sc_h, sc_r, sm_p, sm_h, sm_r, N, DQ: tl.constexpr, SPLIT: tl.constexpr, PAGE: tl.constexpr,
              BLOCK_R: tl.constexpr, META: tl.constexpr, CODES: tl.constexpr, BF16: tl.constexpr,
              HRED: tl.constexpr, WIN: tl.constexpr, TB: tl.constexpr, INTERP: tl.constexpr):
    """Quantize one row block of 16-bit words; write codes and metadata into the slots. WIN: the clip by
    :func:`_wtau_win` (the launcher saw mode 1), without compiling the int32 keys of :func:`_wtau` (a kernel
    holds registers for its largest path: 128 with them, 96 without, sm_90 AOT build)."""
    SW: tl.constexpr = DQ // 2 // SPLIT
    rows = blk * BLOCK_R + tl.arange(0, BLOCK_R)
    valid = (rows < N) & (slot >= 0)  # negative slot = padding row: never written
    lo = _wrange(w0, w1, w2, w3, w4, w5, w6, w7, SPLIT, BF16, False, HRED, INTERP)
    hi = _wrange(w0, w1, w2, w3, w4, w5, w6, w7, SPLIT, BF16, True, HRED, INTERP)
    tau = tl.full([BLOCK_R], float("inf"), tl.float32)
    if WIN:  # the launcher saw mode 1 (top-down)
        tau, _ = _wtau_win(w0, w1, w2, w3, w4, w5, w6, w7, wc, lo, hi, n, valid, DQ, SPLIT, BF16, TB, INTERP)
    elif mode > 0:
        tau = _wtau(w0, w1, w2, w3, w4, w5, w6, w7, wc, mode, n, idx, DQ, SPLIT, BF16, INTERP)
    sc, lo_s, b1, b2, b3 = _group_params_x(lo, hi, tau, META, CODES, BF16)
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
    if SPLIT == 2:
        tl.store(cw_ptr + cbase + SW + ccol[None, :],
                 _wcodes(w4, w5, w6, w7, b1, b2, b3, BF16, INTERP).to(tl.int16), mask=sm)


@triton.jit
def _wside(x_ptr, sx0, sx1, sxh, mode, n, idx, codes_ptr, scale_ptr, offset_ptr, idx0_ptr, idx1_ptr,
           sc_p, sc_h, sc_r, sm_p, sm_h, sm_r, slots_ptr, N, h, DQ: tl.constexpr, SPLIT: tl.constexpr,
           PAGE: tl.constexpr, BLOCK_R: tl.constexpr, GATHER: tl.constexpr, META: tl.constexpr,
           CODES: tl.constexpr, PREFETCH: tl.constexpr, HRED: tl.constexpr, WIN: tl.constexpr, TB: tl.constexpr,
           INTERP: tl.constexpr):
    BF16: tl.constexpr = x_ptr.dtype.element_ty == tl.bfloat16
    SW: tl.constexpr = DQ // 2 // SPLIT
    xw = x_ptr.to(tl.pointer_type(tl.int32))
    cw = codes_ptr.to(tl.pointer_type(tl.int16))
    wc = tl.arange(0, SW)
    pid = tl.program_id(0)
    npr = tl.num_programs(0)
    nblk = tl.cdiv(N, BLOCK_R)
    if PREFETCH:
        slot, w0, w1, w2, w3, w4, w5, w6, w7 = _wload(xw, sx0, sx1, sxh, idx0_ptr, idx1_ptr, slots_ptr, N, pid, h,
                                                      wc, DQ, SPLIT, BLOCK_R, GATHER)
        for blk in range(pid, nblk, npr):
            ns, n0, n1, n2, n3, n4, n5, n6, n7 = _wload(xw, sx0, sx1, sxh, idx0_ptr, idx1_ptr, slots_ptr, N,
                                                        blk + npr, h, wc, DQ, SPLIT, BLOCK_R, GATHER)
            _wprocess(slot, w0, w1, w2, w3, w4, w5, w6, w7, blk, h, wc, mode, n, idx, cw, scale_ptr, offset_ptr,
                      sc_p, sc_h, sc_r, sm_p, sm_h, sm_r, N, DQ, SPLIT, PAGE, BLOCK_R, META, CODES, BF16, HRED,
                      WIN, TB, INTERP)
            slot, w0, w1, w2, w3, w4, w5, w6, w7 = ns, n0, n1, n2, n3, n4, n5, n6, n7
    else:
        for blk in range(pid, nblk, npr):
            slot, w0, w1, w2, w3, w4, w5, w6, w7 = _wload(xw, sx0, sx1, sxh, idx0_ptr, idx1_ptr, slots_ptr, N,
                                                          blk, h, wc, DQ, SPLIT, BLOCK_R, GATHER)
            _wprocess(slot, w0, w1, w2, w3, w4, w5, w6, w7, blk, h, wc, mode, n, idx, cw, scale_ptr, offset_ptr,
                      sc_p, sc_h, sc_r, sm_p, sm_h, sm_r, N, DQ, SPLIT, PAGE, BLOCK_R, META, CODES, BF16, HRED,
                      WIN, TB, INTERP)


@triton.jit(do_not_specialize=["kmode", "kn", "kidx", "vmode", "vn", "vidx", "N"])
def _quant16_kernel(
    kx, ksx0, ksx1, ksxh, kmode, kn, kidx, kcodes, kscale, koffset,
    vx, vsx0, vsx1, vsxh, vmode, vn, vidx, vcodes, vscale, voffset,
    idx0_ptr, idx1_ptr, sc_p, sc_h, sc_r, sm_p, sm_h, sm_r, slots_ptr, N,
    DQ: tl.constexpr, SPLIT: tl.constexpr, PAGE: tl.constexpr, BLOCK_R: tl.constexpr, GATHER: tl.constexpr,
    META: tl.constexpr, CODES: tl.constexpr, PREFETCH: tl.constexpr, SIDE0: tl.constexpr, HRED: tl.constexpr,
    K_WIN: tl.constexpr, V_WIN: tl.constexpr, TB: tl.constexpr, INTERP: tl.constexpr,
):
    """The "fast16" kernel: :func:`_quantize_kv_kernel` for 16-bit rows without mean (2-bit codes, one group
    per row), on 32-bit words (see above). V programs come first in the grid (``program_id(2) == 0``): at the
    default clips they run about 1.4x longer than K's, and the last wave is then made of the shorter ones."""
    h = tl.program_id(1)
    if tl.program_id(2) * (1 - SIDE0) == 1:
        _wside(kx, ksx0, ksx1, ksxh, kmode, kn, kidx, kcodes, kscale, koffset, idx0_ptr, idx1_ptr, sc_p, sc_h,
               sc_r, sm_p, sm_h, sm_r, slots_ptr, N, h, DQ, SPLIT, PAGE, BLOCK_R, GATHER, META, CODES, PREFETCH,
               HRED, K_WIN, TB, INTERP)
    else:
        _wside(vx, vsx0, vsx1, vsxh, vmode, vn, vidx, vcodes, vscale, voffset, idx0_ptr, idx1_ptr, sc_p, sc_h,
               sc_r, sm_p, sm_h, sm_r, slots_ptr, N, h, DQ, SPLIT, PAGE, BLOCK_R, GATHER, META, CODES, PREFETCH,
               HRED, V_WIN, TB, INTERP)


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


def _parse_variant(variant: tuple[str, ...], bits: int) -> dict:
    """Formulation and launch knobs: code/clip names (``_CODE_FORMS``, ``_CLIP_FORMS``) and ``name=int`` for
    ``block_r`` (rows per block), ``warps``, ``bpp`` (row blocks per program), ``prefetch`` (0/1); for fast16
    ``split``, ``hred``, ``win``, ``regs`` and ``warps0`` (see :func:`quantize_write_triton`)."""
    # prefetch off: the kernel is issue-bound (SASS: ~8% more instructions and 96 -> 127 registers with it)
    # 2-bit codes by per-row thresholds (code_thr8): measured 0.113 ms vs 0.158 ms with one division per element
    # (H200, 32768 rows x 8 heads, K+V, clip; docs/results/kernels_h200.md), bit-identical
    opt = {"codes": 3 if bits == 2 else 1, "clip": 0, "block_r": 32, "warps": 4, "bpp": 4,
           "prefetch": 0, "kernel": "rows", "split": 1, "hred": 0, "win": 0,
           "regs": 0, "warps0": 0}
    if isinstance(variant, str):
        raise ValueError(f"variant must be a tuple of names, got the string {variant!r}")
    named = {v.partition("=")[0] for v in variant}
    if bits == 2 and not named & set(_KERNELS):
        # default: the fast16 kernel with a row over 2 threads, one row block per program and float64-exact
        # thresholds, where fast16_ok allows (H200, 32768 rows x 8 heads, K+V, clip 0.96/0.92: 0.0770 ms vs
        # 0.1128 ms for the row kernel's default, bit-identical; docs/results/kernels_h200.md, session 14);
        # _launch falls back to the row kernel with its own defaults elsewhere ("auto16")
        opt.update(kernel="fast16", auto16=1)
        if "split" not in named:
            opt["split"] = 2
        if "bpp" not in named:
            opt["bpp"] = 1
        if not named & set(_CODE_FORMS):
            opt["codes"] = _CODE_FORMS["code_thr64"]
        if "win" not in named:  # H200, session 15 (kernels_probe.py --only win): 0.0672 ms vs win=0's 0.0757
            opt["win"] = 1
        if "warps" not in named:  # ... and one warp per program where a side takes the window: 0.0617 ms
            opt["warps_auto"] = 1
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
        elif not val and name in _KERNELS:
            opt["kernel"] = name
        elif val and name in _TUNING:
            try:
                opt[name] = int(val)
            except ValueError:
                raise ValueError(f"variant {v!r}: {name} needs an integer value") from None
        else:
            raise ValueError(f"unknown variant {v!r}: use {sorted(_CODE_FORMS)}, {sorted(_CLIP_FORMS)}, "
                             f"{list(_KERNELS)} or name=int for {list(_TUNING)}")
    b = opt["block_r"]
    if b < 16 or b & (b - 1) or b > 256:
        raise ValueError(f"block_r must be a power of two in [16, 256], got {b}")
    if opt["warps"] not in (1, 2, 4, 8, 16) or opt["warps0"] not in (0, 1, 2, 4, 8, 16):
        raise ValueError(f"warps must be 1, 2, 4, 8 or 16 and warps0 0 or one of those, got {opt['warps']} and "
                         f"{opt['warps0']}")
    if opt["split"] not in (1, 2) or opt["hred"] not in (0, 1):
        raise ValueError(f"split must be 1 or 2 and hred 0 or 1, got {opt['split']} and {opt['hred']}")
    if opt["win"] not in (0, 1, 2) or not (opt["regs"] == 0 or 24 <= opt["regs"] <= 255):
        raise ValueError(f"win must be 0, 1 or 2 and regs 0 or in [24, 255], got {opt['win']} and {opt['regs']}")
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


def _launch(k_pages, v_pages, k, v, k_strides, v_strides, slots, n, idx0, idx1, *, k_rotation, k_mean, v_mean,
            k_clip, v_clip, debug_rows, gather, variant=(), check_pages=True):
    """``k_rotation`` (fused into the channel-page kernel) only with channel-page keys: rows for the row kernel
    arrive rotated."""
    fmt = k_pages.fmt
    check_kv_formats(k_pages, v_pages)
    if k_pages.codes.shape[0] != v_pages.codes.shape[0]:
        raise ValueError("K and V pools must have the same number of pages (slots address both)")
    check_pool_strides(k_pages, v_pages, k_pages.codes.device)
    d, hkv = fmt.head_dim, fmt.num_kv_heads
    if d % 4:
        raise ValueError(f"the Triton quantize kernel needs head_dim % 4 == 0 (row quarters), got {d}; "
                         "use the reference")
    opt = _parse_variant(variant, fmt.bits)
    if opt.get("auto16") and not fast16_ok(opt, k_pages, v_pages, None if fmt.channel else k, v, k_strides,
                                           v_strides, None if fmt.channel else k_mean, v_mean, debug_rows):
        opt = _parse_variant(tuple(variant) + ("rows",), fmt.bits)  # the row kernel, with its own defaults
    chan = fmt.channel
    if k_rotation is not None and not chan:
        raise ValueError("the row kernel takes rotated rows: a K rotation is fused only into channel pages")
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
    _, _, vmu, vkey, vmode, vcount, vidx = _prep_side(v_pages, v, None, v_mean, v_clip, "V", opt["clip"])
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
    k_win = v_win = False
    if opt["kernel"] == "fast16":
        k_win, v_win = _win_side(opt, kmode, k), _win_side(opt, vmode, v)
        if opt.get("warps_auto") and (k_win or v_win):  # the default: one warp per program where a side windows
            opt["warps"] = 1
        elif kmode == 0 and vmode == 0 and (opt["warps0"] or opt.get("warps_auto")):
            # neither side clips: warps0 where asked for, else one warp (session 17, H200, bf16 K+V of 32768
            # rows: 0.0557 ms at one warp against 0.0656 ms at four, kernels_probe --only w1x)
            opt["warps"] = opt["warps0"] or 1
        if not any(x.startswith("block_r=") for x in variant):
            # one row spans d / (32 split) threads: fill the CTA without replication
            opt["block_r"] = min(256, max(16, 1024 * opt["warps"] * opt["split"] // d))
    dq = d // 4
    block_r = opt["block_r"]
    nblk = triton.cdiv(n, block_r)
    grid = (max(1, triton.cdiv(nblk, opt["bpp"])), hkv, 1 if chan else 2)
    if fast16_ok(opt, k_pages, v_pages, None if chan else k, v, k_strides, v_strides, None if chan else k_mean,
                 v_mean, debug_rows):
        _quant16_kernel[grid](
            k, *k_strides[:3], kmode, kcount, kidx, k_pages.codes, k_pages.scale, k_pages.offset,
            v, *v_strides[:3], vmode, vcount, vidx, v_pages.codes, v_pages.scale, v_pages.offset,
            idx0, idx1, cs[0], cs[1], cs[2], ms[0], ms[1], ms[2], slots, n,
            DQ=dq, SPLIT=opt["split"], PAGE=fmt.page_size, BLOCK_R=block_r, GATHER=gather, META=meta,
            CODES=opt["codes"], PREFETCH=bool(opt["prefetch"]), SIDE0=1 if chan else 0, HRED=bool(opt["hred"]),
            K_WIN=k_win, V_WIN=v_win, TB=d.bit_length() - 1, INTERP=interpreting(), num_warps=opt["warps"],
            **({"maxnreg": opt["regs"]} if opt["regs"] and not interpreting() else {}),
        )
        return
    _quantize_kv_kernel[grid](
        k, *k_strides, kmu, kmode, kcount, kidx, k_pages.codes, k_pages.scale, k_pages.offset, kdbg,
        v, *v_strides, vmu, vmode, vcount, vidx, v_pages.codes, v_pages.scale, v_pages.offset, vdbg,
        idx0, idx1, cs[0], cs[1], cs[2], ms[0], ms[1], ms[2], slots, n, hkv,
        D=d, DQ=dq, CP=next_pow2(dq), BITS=fmt.bits, G=fmt.group, NG=fmt.groups, PAGE=fmt.page_size,
        BLOCK_R=block_r, GATHER=gather, K_MEAN=k_mean is not None, K_KEY16=kkey, V_MEAN=v_mean is not None,
        V_KEY16=vkey, META=meta,
        DEBUG=debug_rows is not None, CODES=opt["codes"], CLIP_SORT=opt["clip"] == 4, PREFETCH=bool(opt["prefetch"]),
        SIDE0=1 if chan else 0, num_warps=opt["warps"],
    )


def _win_side(opt: dict, mode: int, x: Tensor) -> bool:
    """Whether a side of a fast16 launch takes the windowed clip: asked for (win 1: bfloat16 rows, win 2: also
    float16, whose windows span 8x fewer binades) and the top-down order statistic (mode 1)."""
    return mode == 1 and (opt["win"] == 2 or (opt["win"] == 1 and x.dtype == torch.bfloat16))


def fast16_ok(opt: dict, k_pages: QuantPages, v_pages: QuantPages, k: Tensor | None, v: Tensor, k_strides,
              v_strides, k_mean, v_mean, debug_rows) -> bool:
    """Whether the "fast16" kernel serves this launch (else the general row kernel does): asked for; 16-bit
    rows (bfloat16 or float16) without mean on both sides (``k`` None: keys go to channel pages), read as 32-bit
    words (contiguous rows, even strides, 4-byte aligned); 2-bit codes, one group per row, ``d/8`` a power of
    two with ``d/8 >= 4 * split`` (16-byte word blocks) and ``d <= 256`` (8 index bits in the keys), codes
    written as 16-bit words (even strides); no debug rows; a per-row threshold code formulation; no sort."""
    fmt = v_pages.fmt
    d = fmt.head_dim
    wq = d // 8  # words per quarter
    if not (opt["kernel"] == "fast16" and k_mean is None and v_mean is None and debug_rows is None
            and fmt.bits == 2 and fmt.groups == 1 and d <= 256 and wq & (wq - 1) == 0 and wq >= 4 * opt["split"]
            and opt["codes"] >= 2 and opt["clip"] != 4):
        return False
    sides = [(v, v_strides, v_pages)] + ([] if k is None else [(k, k_strides, k_pages)])
    for x, st, pages in sides:
        if x.dtype not in (torch.float16, torch.bfloat16) or st[3] != 1 or any(s % 2 for s in st[:3]):
            return False
        if x.data_ptr() % 4 or pages.codes.data_ptr() % 2 or any(s % 2 for s in pages.codes.stride()[:3]):
            return False
    return True


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
    thresholds, two probes), "code_thr64" (thresholds from an exact float64 product, no division), "code_div"
    (one division per element), "code_floor", "code_thr" (7 probes); "clip_top", "clip_bottom", "clip_bisect",
    "clip_sort" (force one order-statistic method); "block_r=", "warps=", "bpp=" (row blocks per program),
    "prefetch=" (0/1: load the next block before this one's math); "fast16" (the 16-bit-row kernel
    ``_quant16_kernel`` where :func:`fast16_ok` allows, the row kernel otherwise) with "split=" (1/2: a row over
    d/32 or d/64 threads), "hred=" (0/1: packed per-thread min/max reduction), "win=" (0: int32 clip keys, 1:
    windowed 16-bit keys for bfloat16 rows, the default, 2: also float16; top-down clips only), "regs=" (a
    register cap per thread, 0 = none) and "warps0=" (warps per program where neither side clips; 0, the default:
    one warp unless "warps=" is given, then that).
    Rotations of token-page rows are applied in torch float32 (``(x - mean) @ R``) before the row kernel; keys
    in channel pages get theirs fused (``tf32x3`` dot) into the channel-page kernel.

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
    # rows of the row kernel are centered and rotated in torch float32 first (an in-kernel dot needed 278-328 KB
    # of shared memory on sm_90 at d = 128; the codes are exact for the rows used, exposed by debug_rows)
    if v_rotation is not None:
        v, v_mean = _rotated_rows(v, v_rotation, v_mean), None
    if k_rotation is not None and not fmt.channel:
        k, k_rotation, k_mean = _rotated_rows(k, k_rotation, k_mean), None, None
    ks = (k.stride(0), 0, k.stride(1), k.stride(2))
    vs = (v.stride(0), 0, v.stride(1), v.stride(2))
    _launch(k_pages, v_pages, k, v, ks, vs, slots, n, slots, slots, k_rotation=k_rotation, k_mean=k_mean,
            v_mean=v_mean, k_clip=k_clip, v_clip=v_clip, debug_rows=debug_rows, gather=False,
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
            k_rotation=None, k_mean=None, v_mean=None, k_clip=k_clip, v_clip=v_clip,
            debug_rows=None, gather=True, variant=variant, check_pages=check_pages)


__all__ = ["quantize_write_triton", "demote_triton", "clip_plan", "fast16_ok"]
