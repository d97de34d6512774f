"""Triton kernels: center, rotate, clip, quantize and pack K and V rows straight into their page slots (one
launch for both), and the demotion of 16-bit rows to 2-bit pages.

Bit-exact with :func:`oscarkv.quant.quantize` (method section 3): the per-row clip threshold is the exact order
statistic (a bitwise binary search over the float bits of ``|x|``), divisions are correctly rounded
(``div_rn``), metadata is rounded to nearest even, codes are computed from the stored metadata. With a fused
rotation the float32 rows come from a ``tf32x3`` dot (float32-level accuracy, but not torch's summation
order): the codes are then bit-exact with ``quantize()`` of the rows the kernel computed, which
``debug_rows`` exposes (docs/kernels.md).
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
def _kth_smallest_abs(x, cmask, k, BLOCK_R: tl.constexpr):
    """Exact ``k``-th smallest (0-based) ``|x|`` of each row: bitwise binary search on the float bits
    (monotone for non-negative floats), 31 counting passes; the largest ``t`` with ``#{|x| < t} <= k``."""
    a = tl.where(cmask[None, :], tl.abs(x), float("inf")).to(tl.int32, bitcast=True)
    res = tl.zeros([BLOCK_R], tl.int32)
    for b in tl.static_range(30, -1, -1):
        cand = res | (1 << b)
        cnt = tl.sum((a < cand[:, None]).to(tl.int32), axis=1)
        res = tl.where(cnt <= k, cand, res)
    return res.to(tl.float32, bitcast=True)


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
def _quant_rows(
    x_ptr, sx0, sx1, sxh, sxd, idx0_ptr, idx1_ptr, mean_ptr, rot_ptr, s_rot_h, clip_idx,
    codes_ptr, scale_ptr, offset_ptr, sc_p, sc_h, sc_r, sm_p, sm_h, sm_r,
    slots_ptr, dbg_ptr, N, page_size, pid_r, h, num_heads,
    D: tl.constexpr, DP: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr, NG: tl.constexpr,
    BLOCK_R: tl.constexpr, GATHER: tl.constexpr, HAS_MEAN: tl.constexpr, HAS_ROT: tl.constexpr,
    META: tl.constexpr, DEBUG: tl.constexpr, CODE_DIV: tl.constexpr, CLIP_SORT: tl.constexpr,
):
    PER: tl.constexpr = 8 // BITS
    DQ: tl.constexpr = D // PER
    CP: tl.constexpr = DP // PER
    LEVELS: tl.constexpr = (1 << BITS) - 1
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < N
    slot = tl.load(slots_ptr + rows, mask=rmask, other=-1).to(tl.int64)
    valid = rmask & (slot >= 0)  # negative slot = padding row (vLLM convention): never written
    if GATHER:
        i0 = tl.load(idx0_ptr + rows, mask=valid, other=0).to(tl.int64)
        i1 = tl.load(idx1_ptr + rows, mask=valid, other=0).to(tl.int64)
        xbase = i0 * sx0 + i1 * sx1 + h * sxh
    else:
        xbase = rows.to(tl.int64) * sx0 + h * sxh
    # columns in "quartered" order: col = j * CP + c holds element e = j * DQ + c (packing field j of byte c)
    cols = tl.arange(0, PER * CP)
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
        x = tl.dot(xin, r, input_precision="tf32x3")  # ~float32 accuracy on tensor cores
    else:
        x = tl.load(x_ptr + xbase[:, None] + e[None, :] * sxd, mask=valid[:, None] & cmask[None, :], other=0.0)
        x = x.to(tl.float32)
        if HAS_MEAN:
            x = x - tl.load(mean_ptr + h * D + e, mask=cmask, other=0.0)[None, :]
    if DEBUG:
        dptr = dbg_ptr + (rows.to(tl.int64) * num_heads + h)[:, None] * D + e[None, :]
        tl.store(dptr, x, mask=valid[:, None] & cmask[None, :])
    if clip_idx >= 0:
        if CLIP_SORT:  # alternative (slower) exact order statistic: bitonic sort of |x|
            srt = tl.sort(tl.where(cmask[None, :], tl.abs(x), float("inf")), dim=1)
            tau = tl.max(tl.where(cols[None, :] == clip_idx, srt, -1.0), axis=1)[:, None]
        else:
            tau = _kth_smallest_abs(x, cmask, clip_idx, BLOCK_R)[:, None]
        x = tl.minimum(tl.maximum(x, -tau), tau)
    page = slot // page_size
    prow = slot % page_size
    mbase = page * sm_p + h * sm_h + prow * sm_r
    lv = tl.full([BLOCK_R], LEVELS, tl.float32)
    q = tl.zeros([BLOCK_R, PER * CP], tl.int32)
    for gi in tl.static_range(NG):
        if NG == 1:
            gm = cmask[None, :]
        else:
            gm = ((e // G == gi) & cmask)[None, :]
        lo = tl.min(tl.where(gm, x, float("inf")), axis=1)
        hi = tl.max(tl.where(gm, x, float("-inf")), axis=1)
        sc = _round_meta(tl.math.div_rn(hi - lo, lv), META)
        lo = _round_meta(lo, META)
        tl.store(scale_ptr + mbase + gi, sc.to(scale_ptr.dtype.element_ty), mask=valid)
        tl.store(offset_ptr + mbase + gi, lo.to(offset_ptr.dtype.element_ty), mask=valid)
        a = x - lo[:, None]
        live = gm & (sc > 0.0)[:, None]  # a zero scale (constant group) gives all-zero codes
        ssafe = tl.where(sc > 0.0, sc, 1.0)
        if CODE_DIV:  # reference formulation: one correctly rounded division per element
            t = tl.math.div_rn(a, ssafe[:, None]) + 0.5
            qd = tl.minimum(tl.maximum(tl.floor(t), 0.0), LEVELS * 1.0).to(tl.int32)
            q += tl.where(live, qd, 0)
        else:
            for k in tl.static_range(1, LEVELS + 1):
                q += (live & (a >= _threshold(ssafe, k)[:, None])).to(tl.int32)
    q = q << (BITS * jj)[None, :]
    packed = tl.sum(tl.reshape(q, (BLOCK_R, PER, CP)), axis=1)
    c = tl.arange(0, CP)
    cptr = codes_ptr + (page * sc_p + h * sc_h + prow * sc_r)[:, None] + c[None, :]
    tl.store(cptr, packed.to(tl.uint8), mask=valid[:, None] & (c < DQ)[None, :])


@triton.jit
def _quantize_kv_kernel(
    kx, ksx0, ksx1, ksxh, ksxd, kmean, krot, ks_rot_h, kclip, kcodes, kscale, koffset, kdbg,
    vx, vsx0, vsx1, vsxh, vsxd, vmean, vrot, vs_rot_h, vclip, vcodes, vscale, voffset, vdbg,
    idx0_ptr, idx1_ptr, sc_p, sc_h, sc_r, sm_p, sm_h, sm_r, slots_ptr, N, page_size, num_heads,
    D: tl.constexpr, DP: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr, NG: tl.constexpr,
    BLOCK_R: tl.constexpr, GATHER: tl.constexpr, K_MEAN: tl.constexpr, K_ROT: tl.constexpr,
    V_MEAN: tl.constexpr, V_ROT: tl.constexpr, META: tl.constexpr, DEBUG: tl.constexpr,
    CODE_DIV: tl.constexpr, CLIP_SORT: tl.constexpr, SIDE0: tl.constexpr,
):
    pid_r = tl.program_id(0)
    h = tl.program_id(1)
    if tl.program_id(2) + SIDE0 == 0:  # SIDE0 = 1: V only (K went to channel pages)
        _quant_rows(kx, ksx0, ksx1, ksxh, ksxd, idx0_ptr, idx1_ptr, kmean, krot, ks_rot_h, kclip,
                    kcodes, kscale, koffset, sc_p, sc_h, sc_r, sm_p, sm_h, sm_r, slots_ptr, kdbg, N, page_size,
                    pid_r, h, num_heads, D, DP, BITS, G, NG, BLOCK_R, GATHER, K_MEAN, K_ROT, META, DEBUG,
                    CODE_DIV, CLIP_SORT)
    else:
        _quant_rows(vx, vsx0, vsx1, vsxh, vsxd, idx0_ptr, idx1_ptr, vmean, vrot, vs_rot_h, vclip,
                    vcodes, vscale, voffset, sc_p, sc_h, sc_r, sm_p, sm_h, sm_r, slots_ptr, vdbg, N, page_size,
                    pid_r, h, num_heads, D, DP, BITS, G, NG, BLOCK_R, GATHER, V_MEAN, V_ROT, META, DEBUG,
                    CODE_DIV, CLIP_SORT)


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


def _prep_side(pages: QuantPages, x: Tensor, rotation: Tensor | None, mean: Tensor | None, clip: float,
               name: str):
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
    idx = clip_index(clip, d)
    return rot, s_rot_h, mu, -1 if idx is None else idx


def _launch(k_pages, v_pages, k, v, k_strides, v_strides, slots, n, idx0, idx1, *, k_rotation, v_rotation,
            k_mean, v_mean, k_clip, v_clip, debug_rows, gather, variant=(), check_pages=True):
    fmt = k_pages.fmt
    check_kv_formats(k_pages, v_pages)
    if k_pages.codes.shape[0] != v_pages.codes.shape[0]:
        raise ValueError("K and V pools must have the same number of pages (slots address both)")
    check_pool_strides(k_pages, v_pages, k_pages.codes.device)
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
    d, hkv = fmt.head_dim, fmt.num_kv_heads
    krot, ksr, kmu, kclip = _prep_side(k_pages, k, k_rotation, k_mean, 0.0 if chan else k_clip, "K")
    vrot, vsr, vmu, vclip = _prep_side(v_pages, v, v_rotation, v_mean, v_clip, "V")
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
    block_r = 64 if (k_rotation is not None or v_rotation is not None) else 32
    grid = (triton.cdiv(n, block_r), hkv, 1 if chan else 2)
    _quantize_kv_kernel[grid](
        k, *k_strides, kmu, krot, ksr, kclip, k_pages.codes, k_pages.scale, k_pages.offset, kdbg,
        v, *v_strides, vmu, vrot, vsr, vclip, v_pages.codes, v_pages.scale, v_pages.offset, vdbg,
        idx0, idx1, cs[0], cs[1], cs[2], ms[0], ms[1], ms[2], slots, n, fmt.page_size, hkv,
        D=d, DP=next_pow2(d), BITS=fmt.bits, G=fmt.group, NG=fmt.groups, BLOCK_R=block_r, GATHER=gather,
        K_MEAN=k_mean is not None, K_ROT=k_rotation is not None, V_MEAN=v_mean is not None,
        V_ROT=v_rotation is not None, META=meta, DEBUG=debug_rows is not None,
        CODE_DIV="code_div" in variant, CLIP_SORT="clip_sort" in variant, SIDE0=1 if chan else 0, num_warps=4,
    )


def _as_slots(slots: Tensor, n: int, device: torch.device) -> Tensor:
    if slots.shape != (n,):
        raise ValueError(f"slots must have shape [{n}], got {tuple(slots.shape)}")
    check_device("slots", slots, device)
    return slots.to(torch.int64).contiguous()


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
    alternative formulations for testing, "code_div" (one division per element) and "clip_sort" (sort |x|).

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
    ks = (k.stride(0), 0, k.stride(1), k.stride(2))
    vs = (v.stride(0), 0, v.stride(1), v.stride(2))
    _launch(k_pages, v_pages, k, v, ks, vs, slots, n, slots, slots, k_rotation=k_rotation, v_rotation=v_rotation,
            k_mean=k_mean, v_mean=v_mean, k_clip=k_clip, v_clip=v_clip, debug_rows=debug_rows, gather=False,
            variant=variant, check_pages=check_pages)


def demote_triton(
    k_pages: QuantPages, v_pages: QuantPages, k16: Tensor, v16: Tensor, seq_ids: Tensor, src_index: Tensor,
    slots: Tensor, *, k_clip: float = 0.0, v_clip: float = 0.0, check_pages: bool = True,
) -> None:
    """Quantize 16-bit-tier rows ``k16/v16[seq_ids[i], :, src_index[i]]`` (``[B, Hkv, C16, d]``, already
    centered and rotated) into ``slots[i]`` of the 2-bit pools, in place, in one launch (two with channel-page
    keys: whole pages only, see :func:`quantize_write_triton`)."""
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
            debug_rows=None, gather=True, check_pages=check_pages)


__all__ = ["quantize_write_triton", "demote_triton"]
