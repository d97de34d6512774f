"""Triton kernels writing K and V rows into quantized pages: the row kernel (center, clip, quantize and pack rows
of any dtype into token pages of 2 or 4 bits, any group size; K and V in one launch when their pools share a
geometry), the channel-page kernel (keys, whole pages: a scale/offset per channel over the page's tokens), and
the launchers of :func:`quantize_write_triton` and :func:`demote_triton`. 16-bit rows without mean into 2-bit
token pages go to the word kernel of :mod:`oscarkv.kernels.quantize_fast16`. The row math (rounding, code
thresholds, clip order statistic, group metadata and codes) is in :mod:`oscarkv.kernels.quantize_math`.

Bit-exact with :func:`oscarkv.quant.quantize` (method section 3) on the rows the kernels see: a row is held as
four column quarters ``x_j[c] = x[j * d/4 + c]``, so packing byte ``c`` is elementwise and the stores are
vectors. The clip threshold is the exact order statistic, ties included: top-down or bottom-up extraction
(unique keys for 16-bit rows, counts for float32 rows) or a bitwise bisection, whichever needs fewest passes
over the row for this ratio (a run-time choice). Divisions are correctly rounded (``div_rn``), metadata is
rounded to nearest even, codes are computed from the stored metadata. Rotations (``(x - mean) @ R``) are applied
in torch float32 before the kernels, the same einsum as the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..quant import clip_index
from ._triton_util import (
    check_device,
    check_kv_formats,
    check_pool_strides,
    interpreting,
    next_pow2,
)
from .layout import QuantPages
from .quantize_fast16 import _quant16_kernel, fast16_ok, warps_for
from .quantize_math import (
    _codes,
    _group_params,
    _max4,
    _min4,
    _part_codes,
    _part_range,
    _round_meta,
    _store_meta,
    _tau_f32,
    _tau_key16,
    _threshold,
    _to_f32,
)
from .reference import channel_page_ids

_META_CODE = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}


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
                  mode, n, idx, codes_ptr, scale_ptr, offset_ptr, sc_p, sc_h, sc_r, sm_p, sm_h, sm_r, N,
                  D: tl.constexpr, DQ: tl.constexpr, CP: tl.constexpr, BITS: tl.constexpr,
                  G: tl.constexpr, NG: tl.constexpr, PAGE: tl.constexpr, BLOCK_R: tl.constexpr, HAS_MEAN: tl.constexpr,
                  KEY16: tl.constexpr, PADC: tl.constexpr, META: tl.constexpr, CODES: tl.constexpr):
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
    tau = tl.full([BLOCK_R], float("inf"), tl.float32)  # no clip: clamping to +-inf changes nothing
    if mode > 0:
        if KEY16:
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
    idx0_ptr, idx1_ptr, sc_p, sc_h, sc_r, sm_p, sm_h, sm_r, slots_ptr, N, h,
    D: tl.constexpr, DQ: tl.constexpr, CP: tl.constexpr, BITS: tl.constexpr,
    G: tl.constexpr, NG: tl.constexpr, PAGE: tl.constexpr, BLOCK_R: tl.constexpr, GATHER: tl.constexpr,
    HAS_MEAN: tl.constexpr, KEY16: tl.constexpr, META: tl.constexpr, CODES: tl.constexpr,
):
    """Row blocks ``pid, pid + programs, ...`` of one KV head of one side."""
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
    for blk in range(tl.program_id(0), tl.cdiv(N, BLOCK_R), tl.num_programs(0)):
        slot, r0, r1, r2, r3 = _load_rows(x_ptr, sx0, sx1, sxh, sxd, idx0_ptr, idx1_ptr, slots_ptr, N, blk, h,
                                          cols, cmask, DQ, BLOCK_R, GATHER, PADC)
        _process_rows(slot, r0, r1, r2, r3, blk, h, cols, cmask, mu0, mu1, mu2, mu3, mode, n, idx, codes_ptr,
                      scale_ptr, offset_ptr, sc_p, sc_h, sc_r, sm_p, sm_h, sm_r, N, D, DQ, CP, BITS, G, NG, PAGE,
                      BLOCK_R, HAS_MEAN, KEY16, PADC, META, CODES)


# clip method, step count and idx are run-time values: one compiled kernel serves every ratio
@triton.jit(do_not_specialize=["kmode", "kn", "kidx", "vmode", "vn", "vidx", "N"])
def _quantize_kv_kernel(
    kx, ksx0, ksx1, ksxh, ksxd, kmean, kmode, kn, kidx, kcodes, kscale, koffset,
    vx, vsx0, vsx1, vsxh, vsxd, vmean, vmode, vn, vidx, vcodes, vscale, voffset,
    idx0_ptr, idx1_ptr, sc_p, sc_h, sc_r, sm_p, sm_h, sm_r, slots_ptr, N,
    D: tl.constexpr, DQ: tl.constexpr, CP: tl.constexpr, BITS: tl.constexpr,
    G: tl.constexpr, NG: tl.constexpr, PAGE: tl.constexpr, BLOCK_R: tl.constexpr, GATHER: tl.constexpr,
    K_MEAN: tl.constexpr, K_KEY16: tl.constexpr, V_MEAN: tl.constexpr, V_KEY16: tl.constexpr, META: tl.constexpr,
    CODES: tl.constexpr, SIDES: tl.constexpr,
):
    """Grid ``(programs, Hkv, 2 if SIDES == 0 else 1)``: ``SIDES`` 0 both sides (K at ``program_id(2) == 0``),
    1 K only, 2 V only; both sides share the pool geometry (strides, bits, groups, metadata dtype)."""
    h = tl.program_id(1)
    if SIDES == 1 or (SIDES == 0 and tl.program_id(2) == 0):
        _quant_side(kx, ksx0, ksx1, ksxh, ksxd, kmean, kmode, kn, kidx, kcodes, kscale, koffset,
                    idx0_ptr, idx1_ptr, sc_p, sc_h, sc_r, sm_p, sm_h, sm_r, slots_ptr, N, h,
                    D, DQ, CP, BITS, G, NG, PAGE, BLOCK_R, GATHER, K_MEAN, K_KEY16, META, CODES)
    else:
        _quant_side(vx, vsx0, vsx1, vsxh, vsxd, vmean, vmode, vn, vidx, vcodes, vscale, voffset,
                    idx0_ptr, idx1_ptr, sc_p, sc_h, sc_r, sm_p, sm_h, sm_r, slots_ptr, N, h,
                    D, DQ, CP, BITS, G, NG, PAGE, BLOCK_R, GATHER, V_MEAN, V_KEY16, META, CODES)


# ----------------------------------------------------------------------------------------- channel pages
@triton.jit
def _quant_channel_kernel(
    x_ptr, sx0, sx1, sxh, sxd, idx0_ptr, idx1_ptr, mean_ptr, codes_ptr, scale_ptr, offset_ptr, sc_p, sc_h, sc_r,
    sm_p, sm_h, slots_ptr,
    D: tl.constexpr, DP: tl.constexpr, BITS: tl.constexpr, PS: tl.constexpr, GATHER: tl.constexpr,
    HAS_MEAN: tl.constexpr, META: tl.constexpr,
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
    cols = tl.arange(0, PER * CP)  # field-major order: element e = jj * DQ + cc goes to field jj of byte cc
    jj = cols // CP
    cc = cols % CP
    cmask = cc < DQ
    e = jj * DQ + cc
    x = tl.load(x_ptr + xbase[:, None] + e[None, :] * sxd, mask=valid[:, None] & cmask[None, :], other=0.0)
    x = _to_f32(x)
    if HAS_MEAN:
        x = x - tl.load(mean_ptr + h * D + e, mask=cmask, other=0.0)[None, :]
    page = slot0 // PS
    lo = tl.min(x, axis=0)  # per channel, over the page's tokens
    hi = tl.max(x, axis=0)
    lv = tl.full([PER * CP], LEVELS, tl.float32)
    sc = _round_meta(tl.math.div_rn(hi - lo, lv), META)
    lo = _round_meta(lo, META)
    mptr = page * sm_p + h * sm_h + e
    smask = cmask & ((slot0 + e * 0) >= 0)
    _store_meta(scale_ptr + mptr, sc, smask)
    _store_meta(offset_ptr + mptr, lo, smask)
    a = x - lo[None, :]
    live = (cmask & (sc > 0.0))[None, :]
    ssafe = tl.where(sc > 0.0, sc, 1.0)
    q = tl.zeros([PS, PER * CP], tl.int32)
    for kk in tl.static_range(1, LEVELS + 1):
        q += (live & (a >= _threshold(ssafe, kk)[None, :])).to(tl.int32)
    q = q << (BITS * jj)[None, :]
    packed = tl.sum(tl.reshape(q, (PS, PER, CP)), axis=1)
    c = tl.arange(0, CP)
    cptr = codes_ptr + (page * sc_p + h * sc_h + n * sc_r)[:, None] + c[None, :]
    tl.store(cptr, packed.to(tl.uint8), mask=valid[:, None] & (c < DQ)[None, :])


# ------------------------------------------------------------------------------------------------ launchers
def clip_plan(clip: float, d: int, key16: bool) -> tuple[int, int, int]:
    """(mode, loop count, idx) of the clip order statistic for ratio ``clip`` on rows of length ``d``: mode 0 =
    no clip; else the formulation with the fewest passes over the row. 16-bit rows (unique keys): top-down
    ``1 + r`` passes (``r = d-1-idx``), bottom-up ``1 + idx``, bisection 15; float32 rows (two reductions per
    step, for tie counts): top-down ``2 (r + 1)``, bottom-up ``2 (idx + 1)``, bisection 31."""
    idx = clip_index(clip, d)
    if idx is None:
        return 0, 0, 0
    r = d - 1 - idx
    cost = {1: 1 + r, 2: 1 + idx, 3: 15} if key16 else {1: 2 * (r + 1), 2: 2 * (idx + 1), 3: 31}
    mode = min(cost, key=cost.get)
    return mode, (r if mode == 1 else idx), idx


class _Side:
    """One side (K or V) of a write: its pool, rows ``x`` (strides: row index 0, row index 1 for gathers, head,
    element), optional float32 mean and the clip plan."""

    def __init__(self, name: str, pages: QuantPages, x: Tensor, strides: tuple, mean: Tensor | None, clip: float):
        fmt = pages.fmt
        d, hkv = fmt.head_dim, fmt.num_kv_heads
        check_device(f"{name} rows", x, pages.codes.device)
        if not x.is_floating_point():
            raise ValueError(f"{name} rows must be floating point, got {x.dtype}")
        if mean is not None:
            if mean.shape != (hkv, d):
                raise ValueError(f"{name} mean must be [{hkv}, {d}], got {tuple(mean.shape)}")
            mean = mean.to(device=x.device, dtype=torch.float32).contiguous()
        self.pages, self.x, self.strides, self.mean = pages, x, strides, mean
        # rows that are exact 16-bit floats get unique keys (15 bits of |x| and the element index)
        self.key16 = x.dtype in (torch.float16, torch.bfloat16) and mean is None and d <= 256
        self.mode, self.count, self.idx = clip_plan(clip, d, self.key16)
        self.fast16 = fast16_ok(pages, x, strides, mean)
        self.win = self.fast16 and self.mode == 1 and x.dtype == torch.bfloat16  # the windowed top-down clip

    def geometry(self) -> tuple:
        """What a launch over both sides must share."""
        f = self.pages.fmt
        return (f.bits, f.group, f.meta_dtype, self.pages.codes.stride(), self.pages.scale.stride())


def _groups(sides: list[_Side]) -> list[tuple[_Side | None, _Side | None, int]]:
    """Launches as (K side, V side, SIDES): both in one where the kernel and the pool geometry agree."""
    k, v = (sides[0], sides[1]) if len(sides) == 2 else (None, sides[0])
    if k is not None and k.fast16 == v.fast16 and k.geometry() == v.geometry():
        return [(k, v, 0)]
    return ([(k, k, 1)] if k is not None else []) + [(v, v, 2)]


def _launch_rows(k: _Side, v: _Side, sides: int, slots: Tensor, n: int, idx0: Tensor, idx1: Tensor,
                 gather: bool) -> None:
    fmt = k.pages.fmt
    d = fmt.head_dim
    dq = d // 4
    cs, ms = k.pages.codes.stride(), k.pages.scale.stride()
    block_r = 32
    grid = (max(1, triton.cdiv(triton.cdiv(n, block_r), 4)), fmt.num_kv_heads, 2 if sides == 0 else 1)
    _quantize_kv_kernel[grid](
        k.x, *k.strides, k.mean if k.mean is not None else k.x, k.mode, k.count, k.idx, k.pages.codes,
        k.pages.scale, k.pages.offset,
        v.x, *v.strides, v.mean if v.mean is not None else v.x, v.mode, v.count, v.idx, v.pages.codes,
        v.pages.scale, v.pages.offset,
        idx0, idx1, cs[0], cs[1], cs[2], ms[0], ms[1], ms[2], slots, n,
        D=d, DQ=dq, CP=next_pow2(dq), BITS=fmt.bits, G=fmt.group, NG=fmt.groups, PAGE=fmt.page_size,
        BLOCK_R=block_r, GATHER=gather, K_MEAN=k.mean is not None, K_KEY16=k.key16, V_MEAN=v.mean is not None,
        V_KEY16=v.key16, META=_META_CODE[fmt.meta_dtype], CODES=3 if fmt.bits == 2 else 1, SIDES=sides,
        num_warps=4,
    )


def _launch_fast16(k: _Side, v: _Side, sides: int, slots: Tensor, n: int, idx0: Tensor, idx1: Tensor,
                   gather: bool) -> None:
    fmt = k.pages.fmt
    d = fmt.head_dim
    cs, ms = k.pages.codes.stride(), k.pages.scale.stride()
    ks = (k.mode, k.win) if sides != 2 else (0, False)
    vs = (v.mode, v.win) if sides != 1 else (0, False)
    warps = warps_for(ks[0], vs[0], ks[1], vs[1])
    block_r = min(256, max(16, 2048 * warps // d))  # a row spans d / 64 threads: fill the CTA
    grid = (triton.cdiv(n, block_r), fmt.num_kv_heads, 2 if sides == 0 else 1)
    _quant16_kernel[grid](
        k.x, *k.strides[:3], k.mode, k.count, k.idx, k.pages.codes, k.pages.scale, k.pages.offset,
        v.x, *v.strides[:3], v.mode, v.count, v.idx, v.pages.codes, v.pages.scale, v.pages.offset,
        idx0, idx1, cs[0], cs[1], cs[2], ms[0], ms[1], ms[2], slots, n,
        DQ=d // 4, PAGE=fmt.page_size, BLOCK_R=block_r, GATHER=gather, META=_META_CODE[fmt.meta_dtype],
        SIDES=sides, K_WIN=k.win, V_WIN=v.win, TB=d.bit_length() - 1, INTERP=interpreting(), num_warps=warps,
    )


def _launch(k_pages, v_pages, k, v, k_strides, v_strides, slots, n, idx0, idx1, *, k_mean, v_mean, k_clip, v_clip,
            gather, check_pages=True):
    """Check, then launch: the channel-page kernel for channel-page keys, the word kernel for the sides it serves,
    the row kernel for the rest; K and V share a launch where their pools share a geometry."""
    fk = k_pages.fmt
    check_kv_formats(k_pages, v_pages, attention=False)
    check_pool_strides(k_pages, v_pages, k_pages.codes.device)
    d, hkv = fk.head_dim, fk.num_kv_heads
    if d % 4:
        raise ValueError(f"the Triton quantize kernels need head_dim % 4 == 0 (row quarters), got {d}: use "
                         "backend='reference'")
    if fk.channel:
        if clip_index(k_clip, d) is not None:
            raise ValueError(f"channel pages are not clipped (KIVI per-channel keys); got k_clip {k_clip}: pass 0")
        if n % fk.page_size:
            raise ValueError(f"channel pages are written whole: got {n} rows, not a multiple of page_size "
                             f"{fk.page_size}; keep partial pages in the 16-bit tier until they are full")
        if fk.page_size & (fk.page_size - 1):
            raise ValueError(f"the channel-page kernel needs a power-of-two page_size, got {fk.page_size}")
        if check_pages:
            channel_page_ids(slots, fk.page_size)  # raises on a partial page (host synchronisation)
    if n == 0:
        return
    sides = [] if fk.channel else [_Side("K", k_pages, k, k_strides, k_mean, k_clip)]
    sides.append(_Side("V", v_pages, v, v_strides, v_mean, v_clip))
    if fk.channel:
        kmu = _Side("K", k_pages, k, k_strides, k_mean, 0.0).mean
        cs, kms = k_pages.codes.stride(), k_pages.scale.stride()
        _quant_channel_kernel[(n // fk.page_size, hkv)](
            k, *k_strides, idx0, idx1, k if kmu is None else kmu, k_pages.codes, k_pages.scale, k_pages.offset,
            cs[0], cs[1], cs[2], kms[0], kms[1], slots, D=d, DP=next_pow2(d), BITS=fk.bits, PS=fk.page_size,
            GATHER=gather, HAS_MEAN=kmu is not None, META=_META_CODE[fk.meta_dtype], num_warps=4,
        )
    for ks, vs, code in _groups(sides):
        (_launch_fast16 if ks.fast16 else _launch_rows)(ks, vs, code, slots, n, idx0, idx1, gather)


def _as_slots(slots: Tensor, n: int, device: torch.device) -> Tensor:
    if slots.shape != (n,):
        raise ValueError(f"slots must have shape [{n}], got {tuple(slots.shape)}")
    check_device("slots", slots, device)
    return slots.to(torch.int64).contiguous()


def _rotated_rows(x: Tensor, rotation: Tensor, mean: Tensor | None) -> Tensor:
    """``(x - mean) @ R`` in float32, ``R`` ``[d, d]`` or per KV head ``[Hkv, d, d]``; x ``[N, Hkv, d]`` (the
    reference's einsum)."""
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
    k_clip: float = 0.0, v_clip: float = 0.0, check_pages: bool = True,
) -> None:
    """Quantize K and V rows ``[N, Hkv, d]`` into ``slots`` (``[N]``, ``page * page_size + row``; negative =
    skip) of both pools, in place: one launch for K and V where their pools share a geometry, else one each.
    Semantics and bit-exact results of :func:`oscarkv.kernels.reference.quantize_write_ref` on the rows the
    kernels see (with a rotation: torch's float32 einsum of ``(x - mean) @ R``, as in the reference).

    Keys in channel pages (``k_pages.fmt.layout == "channel"``): a second launch, one program per whole page and
    head; ``N`` must be a multiple of ``page_size`` and every run of ``page_size`` slots one whole page (or all
    negative): checked on the host unless ``check_pages=False`` (for graph capture; the caller then guarantees
    it, and a violation writes garbage). ``k_clip`` must be 0."""
    fmt = k_pages.fmt
    shape = (k.shape[0], fmt.num_kv_heads, fmt.head_dim)
    if k.shape != shape or v.shape != shape:
        raise ValueError(f"k and v must both be [N, {fmt.num_kv_heads}, {fmt.head_dim}], got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    n = shape[0]
    slots = _as_slots(slots, n, k_pages.codes.device)
    if v_rotation is not None:
        v, v_mean = _rotated_rows(v, v_rotation, v_mean), None
    if k_rotation is not None:
        k, k_mean = _rotated_rows(k, k_rotation, k_mean), None
    ks = (k.stride(0), 0, k.stride(1), k.stride(2))
    vs = (v.stride(0), 0, v.stride(1), v.stride(2))
    _launch(k_pages, v_pages, k, v, ks, vs, slots, n, slots, slots, k_mean=k_mean, v_mean=v_mean, k_clip=k_clip,
            v_clip=v_clip, gather=False, check_pages=check_pages)


def demote_triton(
    k_pages: QuantPages, v_pages: QuantPages, k16: Tensor, v16: Tensor, seq_ids: Tensor, src_index: Tensor,
    slots: Tensor, *, k_clip: float = 0.0, v_clip: float = 0.0, check_pages: bool = True,
) -> None:
    """Quantize 16-bit-tier rows ``k16/v16[seq_ids[i], :, src_index[i]]`` (``[B, Hkv, C16, d]``, already
    centered and rotated) into ``slots[i]`` of the quantized pools, in place (launches and channel-page rules as
    :func:`quantize_write_triton`). No host synchronisation with ``check_pages=False``."""
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
            k_mean=None, v_mean=None, k_clip=k_clip, v_clip=v_clip, gather=True, check_pages=check_pages)


__all__ = ["clip_plan", "demote_triton", "quantize_write_triton"]
