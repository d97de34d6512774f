"""Triton prefill/extend attention over a quantized prefix: the queries of a new chunk attend causally to the
chunk (16-bit) and fully to the earlier tokens as stored (16-bit tiers + 2-bit pages, unpacked tile by tile in
registers, never materialised; ``fold="workspace"`` excepted, below). Flash-attention style online softmax;
one program = one (sequence, KV head, block of query rows), the rows being (token, query head of the GQA group)
pairs, so one unpacked tile serves every query head of its KV head.

A page's scales and offsets are applied in one of two ways. ``fold="dequant"`` (default): the code tiles become
float16 ``o + c s`` once per page (one more fma per pair inside the unpacking asm, shared by every query row), then
plain flash attention runs on them. ``fold="factor"``: as decode, ``q . k^_t = s_t (q . c_t) + o_t sum(q)`` and
``sum_t p_t v^_t = sum_t (p_t s_t) c_t + sum_t p_t o_t`` on the exact codes, which costs ~4 more float32
operations per score (per query row and key) and several metadata values per thread and page; on sm_90 that
made the page loop 728 instructions per warp instead of 472 (128 rows, 8 warps, cuobjdump of the AOT build).

Field ``j`` of packed byte ``c`` is element ``j d/4 + c`` of the row ("quartered" packing), so field ``j`` of a
``[n, d/4]`` byte tile *is* the contiguous column block ``[j d/4, (j+1) d/4)`` of the keys/values: nothing is
interleaved. ``unpack="cat"`` (default) places the four field tiles side by side as one natural-order ``[n, d]``
operand (a register relabelling: no data movement), so ``QK^T`` and ``P V`` are one dot each against the
natural-order query and output; ``"fields"`` keeps them apart (``QK^T = sum_j q[:, block j] @ field_j^T``, four
dots of K-dim ``d/4``; four ``[m, d/4]`` accumulators); ``"vcat"`` mixes the two (fields for K, one V operand).
The previous kernel (fields interleaved into one operand, queries/outputs permuted to match; 8.35 ms against
4.18 ms at the benchmark shape, docs/results/kernels_h200.md) is in git history (commit 08843a7).

Prefill variants (launcher keywords; ``benchmarks/extend_probe.py`` times them against the plain Triton flash
attention over a bfloat16 prefix and BF16 SDPA): ``pages_per_step`` (``"dequant"``, token pages: 2 or 4 pages as
one key tile per step, so the online-softmax bookkeeping, the accumulator rescale and the per-step barriers are
paid once per 128 or 256 keys instead of per page); ``fold="workspace"`` (:mod:`oscarkv.kernels.extend_dense`):
two passes, the pages dequantized once per (page, KV head) into a transient float16 workspace (the same
``o + c s`` values), then a plain flash-attention loop over it (unmasked full tiles, loads pipelined by
``cp.async`` or, with ``tma``, TMA descriptors, only the diagonal chunk tiles masked) with no unpacking in it:
each dequantized tile is then shared by every query block of its KV head rather than by one program's rows.
Static sm_90 SASS of the key loop (Triton 3.6 AOT, d 128, GQA 4, bfloat16 q; instructions per warp per 64 keys,
no spills unless said): fused, one page a step (64 rows / 4 warps) 606, 472 at 128 / 8 with 2 stages;
``pages_per_step=2`` 502 (64 / 4), at 128 / 8 389 with 3 stages, 384 with 2 (3 spill instructions in the
loop; 383 and none with ``maxnreg=240``); workspace attention 361-365 (347 with ``tma``); the same loop over a
bfloat16 prefix 338-375. (AOT builds must mark pointers and strides divisible by 16, as the launch does: without
it the loads are scalar and the counts near double.) Speed: the probe's
numbers (H200, session 14: one page a step 4.18 ms; ``pages_per_step=2`` at 64 rows / 4 warps 3.43 ms with 3
stages, 3.26 ms with 2: the launcher default for token pages; 4 pages 3.57 ms at 128 rows / 8 warps, 6.37 at 64 /
4; the workspace fold with TMA 2.30 ms; plain Triton over a bfloat16 prefix with TMA 2.12 ms; cuDNN 1.66 ms).
Code tiles through TMA descriptors in the fused fold were tried and removed (no compile at 2 pages a step with
triton 3.6, 4.39 ms at 4).

This module holds the kernel, its per-page and per-tile loop bodies and the launcher; the tile-level device
functions (PTX unpacking/dequantization, operand concatenation, online softmax, rescale, channel-page logits)
are in :mod:`oscarkv.kernels.extend_tiles`.
"""

from __future__ import annotations

import inspect
import warnings

import torch
from torch import Tensor

import triton
import triton.language as tl

from ._triton_util import check_device, check_kv_formats, check_pool_strides, interpreting, pool_strides
from .extend_dense import _flash, _pow2, dequant_workspace, extend_attention_dense
from .extend_sdpa import SEGMENT_TOKENS, extend_attention_sdpa, mark_cudnn_broken, sdpa_supported
from .extend_tiles import _cat4, _channel_logits, _dequant4, _online, _query_rows, _rescale, _unpack4
from .layout import QuantPages

UNPACKS = ("cat", "vcat", "fields")
FOLDS = ("sdpa", "dequant", "factor", "workspace")
RESCALES = ("always", "lazy")
PMULS = ("f16", "f32")
# the launcher keywords of the fused folds only: fold=None picks "sdpa" only when none differs from its default
_FUSED_KNOBS = ("block_m", "block_n", "num_warps", "num_stages", "dense_stages", "unpack", "qnative", "rescale",
                "pmul", "maxnreg", "pages_per_step", "tma")
LAZY_TAU = 3.0  # log2 units: the running max is raised only when a row's max exceeds it by 2^3 (p <= 8)


@triton.jit
def _step_pages(bt_row, p, AHEAD: tl.constexpr, npages, PS: tl.constexpr, PPS: tl.constexpr):
    """The page ids of step ``p + AHEAD`` (page 0 past the last): a scalar at one page a step, else that of each
    of the ``PS PPS`` rows (``PPS`` pages). One return: returns of different types do not compile (sm_90)."""
    if PPS == 1:
        page = tl.load(bt_row + p + AHEAD, mask=p + AHEAD < npages, other=0).to(tl.int64)
    else:
        step = p + AHEAD
        sel = tl.arange(0, PS * PPS) // PS
        page = tl.zeros([PS * PPS], tl.int64)
        for j in tl.static_range(PPS):
            pj = tl.load(bt_row + step * PPS + j, mask=step * PPS + j < npages, other=0).to(tl.int64)
            page = tl.where(sel == j, pj, page)
    return page


@triton.jit
def _page_step(
    p, page, ntok, kc_ptr, ks_ptr, ko_ptr, vc_ptr, vs_ptr, vo_ptr, s_cp, s_ch, s_kmp, s_kmh, s_mp, s_mh, h,
    qk0, qk1, qk2, qk3, qsc, csc, lv, tau, m_i, l_i, osum, a0, a1, a2, a3,
    D: tl.constexpr, PS: tl.constexpr, ASM: tl.constexpr, F32DOT: tl.constexpr, KCH: tl.constexpr,
    CBF: tl.constexpr, KCAT: tl.constexpr, VCAT: tl.constexpr, LAZY: tl.constexpr, PMUL16: tl.constexpr,
    MASKED: tl.constexpr,
):
    """One 2-bit page: logits ``s_t (q . c_t) + o_t sum(q)`` (token pages) or ``q . k^_t`` over the dequantized
    tile (channel pages), online softmax, ``P diag(s_v) / v_ref`` (float16) times the V codes plus
    ``sum_t p_t o_t``. ``MASKED``: the sequence's last, partial page (metadata past ``ntok`` may be NaN)."""
    DQ: tl.constexpr = D // 4
    if F32DOT:
        DT: tl.constexpr = tl.float32
    else:
        DT: tl.constexpr = tl.float16
    n = tl.arange(0, PS)
    c = tl.arange(0, DQ)
    crow = page * s_cp + h * s_ch + n * DQ
    row = page * s_mp + h * s_mh + n
    k0, k1, k2, k3 = _unpack4(tl.load(kc_ptr + crow[:, None] + c[None, :]), CBF, ASM, DT)
    if KCH:
        s = _channel_logits(k0, k1, k2, k3, page, h, ks_ptr, ko_ptr, s_kmp, s_kmh, qk0, qk1, qk2, qk3, D, PS, DT,
                            KCAT)
    else:
        if KCAT:
            s = tl.dot(qk0, tl.trans(_cat4(k0, k1, k2, k3, PS, D)))
        else:
            s = tl.dot(qk0, tl.trans(k0))
            s = tl.dot(qk1, tl.trans(k1), s)
            s = tl.dot(qk2, tl.trans(k2), s)
            s = tl.dot(qk3, tl.trans(k3), s)
        # unmasked (the page is allocated whole), so the loads stay contiguous and vectorised
        ks = tl.load(ks_ptr + row).to(tl.float32)
        ko = tl.load(ko_ptr + row).to(tl.float32)
        s = s * ks[None, :] + qsc[:, None] * ko[None, :]
    if PMUL16:
        vs = tl.load(vs_ptr + row).to(tl.float16)
    else:
        vs = tl.load(vs_ptr + row).to(tl.float32)
    vo = tl.load(vo_ptr + row).to(tl.float32)
    if MASKED:
        tmask = p * PS + n < ntok
        s = tl.where(tmask[None, :], s, float("-inf"))
        vs = tl.where(tmask, vs, 0.0)
        vo = tl.where(tmask, vo, 0.0)
    m_new, alpha, pr = _online(s, m_i, csc, lv, tau, LAZY)
    l_i = l_i * alpha + tl.sum(pr, axis=1)
    osum = osum * alpha + tl.sum(pr * vo[None, :], axis=1)
    if PMUL16:  # two float16 roundings (p, then p s_v) instead of one
        pv = (pr.to(tl.float16) * vs[None, :]).to(DT)
    else:
        pv = (pr * vs[None, :]).to(tl.float16).to(DT)
    v0, v1, v2, v3 = _unpack4(tl.load(vc_ptr + crow[:, None] + c[None, :]), 0, ASM, DT)
    a0, a1, a2, a3 = _rescale(a0, a1, a2, a3, alpha, m_new != m_i, LAZY, VCAT)
    if VCAT:
        a0 = tl.dot(pv, _cat4(v0, v1, v2, v3, PS, D).to(DT), a0)
    else:
        a0 = tl.dot(pv, v0.to(DT), a0)
        a1 = tl.dot(pv, v1.to(DT), a1)
        a2 = tl.dot(pv, v2.to(DT), a2)
        a3 = tl.dot(pv, v3.to(DT), a3)
    return m_new, l_i, osum, a0, a1, a2, a3


@triton.jit
def _meta_rows(ks_ptr, ko_ptr, vs_ptr, vo_ptr, page, h, s_mp, s_mh, PS: tl.constexpr, KROWS: tl.constexpr,
               PPS: tl.constexpr = 1):
    """One step's per-token scales and offsets of K (``KROWS``: token pages) and V as float16 ``[PS PPS]``:
    one page (``page`` a scalar) or ``PPS`` pages (``page`` the ``[PS PPS]`` page id of each row)."""
    if PPS == 1:
        row = page * s_mp + h * s_mh + tl.arange(0, PS)
    else:
        row = page * s_mp + h * s_mh + tl.arange(0, PS * PPS) % PS
    if KROWS:
        ks = tl.load(ks_ptr + row).to(tl.float16)
        ko = tl.load(ko_ptr + row).to(tl.float16)
    else:
        ks = tl.zeros([PS * PPS], tl.float16)
        ko = ks
    vs = tl.load(vs_ptr + row).to(tl.float16)
    vo = tl.load(vo_ptr + row).to(tl.float16)
    return ks, ko, vs, vo


@triton.jit
def _page_step_dq(
    p, page, ntok, kc_ptr, ks_ptr, ko_ptr, vc_ptr, s_cp, s_ch, s_kmp, s_kmh, h, ksr, kor, vsr, vor,
    qk0, qk1, qk2, qk3, csc, tau, m_i, l_i, a0, a1, a2, a3,
    D: tl.constexpr, PS: tl.constexpr, ASM: tl.constexpr, F32DOT: tl.constexpr, KCH: tl.constexpr,
    KCAT: tl.constexpr, VCAT: tl.constexpr, LAZY: tl.constexpr, MASKED: tl.constexpr, PPS: tl.constexpr = 1,
):
    """One 2-bit page, ``fold="dequant"``: the code tiles become float16 ``o + c s`` once per page (the
    dequantization rides in the unpacking asm: one more fma per pair, shared by every query row), then plain
    flash attention on them: no per-score scale/offset work. ``ksr``..``vor``: this page's row metadata,
    loaded a page ahead. Channel-page keys use their own (normalised) dequantization. ``PPS`` > 1 (token pages
    only): ``PPS`` pages per step as one ``[PS PPS, D]`` tile (``page``: each row's page id), step ``p``."""
    DQ: tl.constexpr = D // 4
    NB: tl.constexpr = PS * PPS
    if F32DOT:
        DT: tl.constexpr = tl.float32
    else:
        DT: tl.constexpr = tl.float16
    n = tl.arange(0, NB)
    c = tl.arange(0, DQ)
    if PPS == 1:
        crow = page * s_cp + h * s_ch + n * DQ
    else:
        crow = page * s_cp + h * s_ch + (n % PS) * DQ
    kc = tl.load(kc_ptr + crow[:, None] + c[None, :])
    if MASKED:  # metadata past the sequence end may be NaN: the values' must not reach the product
        tmask = p * NB + n < ntok
        vsr = tl.where(tmask, vsr, 0.0)
        vor = tl.where(tmask, vor, 0.0)
    if KCH:
        k0, k1, k2, k3 = _unpack4(kc, 0, ASM, DT)
        s = _channel_logits(k0, k1, k2, k3, page, h, ks_ptr, ko_ptr, s_kmp, s_kmh, qk0, qk1, qk2, qk3, D, PS, DT,
                            KCAT)
    else:
        k0, k1, k2, k3 = _dequant4(kc, tl.broadcast_to(ksr[:, None], (NB, DQ)),
                                   tl.broadcast_to(kor[:, None], (NB, DQ)), ASM, DT)
        if KCAT:
            s = tl.dot(qk0, tl.trans(_cat4(k0, k1, k2, k3, NB, D)))
        else:
            s = tl.dot(qk0, tl.trans(k0))
            s = tl.dot(qk1, tl.trans(k1), s)
            s = tl.dot(qk2, tl.trans(k2), s)
            s = tl.dot(qk3, tl.trans(k3), s)
    if MASKED:
        s = tl.where(tmask[None, :], s, float("-inf"))
    m_new, alpha, pr = _online(s, m_i, csc, 0.0, tau, LAZY)
    l_i = l_i * alpha + tl.sum(pr, axis=1)
    pv = pr.to(tl.float16).to(DT)
    vc = tl.load(vc_ptr + crow[:, None] + c[None, :])
    v0, v1, v2, v3 = _dequant4(vc, tl.broadcast_to(vsr[:, None], (NB, DQ)), tl.broadcast_to(vor[:, None], (NB, DQ)),
                               ASM, DT)
    a0, a1, a2, a3 = _rescale(a0, a1, a2, a3, alpha, m_new != m_i, LAZY, VCAT)
    if VCAT:
        a0 = tl.dot(pv, _cat4(v0, v1, v2, v3, NB, D), a0)
    else:
        a0 = tl.dot(pv, v0, a0)
        a1 = tl.dot(pv, v1, a1)
        a2 = tl.dot(pv, v2, a2)
        a3 = tl.dot(pv, v3, a3)
    return m_new, l_i, a0, a1, a2, a3


@triton.jit
def _dense_step(
    k_ptr, v_ptr, base, t0, n_hi, s_t, tq, qd0, qd1, qd2, qd3, csc, lv, m_i, l_i, osum, a0, a1, a2, a3,
    D: tl.constexpr, BLOCK_N: tl.constexpr, F32DOT: tl.constexpr, KCAT: tl.constexpr, VCAT: tl.constexpr,
    CAUSAL: tl.constexpr,
):
    """One tile of ``BLOCK_N`` 16-bit keys/values (rows ``t0 + i < n_hi``; ``CAUSAL``: also ``t <= tq``)."""
    DQ: tl.constexpr = D // 4
    if F32DOT:
        DT: tl.constexpr = tl.float32
    else:
        DT: tl.constexpr = k_ptr.dtype.element_ty
    t = t0 + tl.arange(0, BLOCK_N)
    tm = t < n_hi
    off = base + t.to(tl.int64)[:, None] * s_t
    c = tl.arange(0, DQ)
    if KCAT:
        k = tl.load(k_ptr + off + tl.arange(0, D)[None, :], mask=tm[:, None], other=0.0)
        s = tl.dot(qd0, tl.trans(k.to(DT)))
    else:
        s = tl.dot(qd0, tl.trans(tl.load(k_ptr + off + c[None, :], mask=tm[:, None], other=0.0).to(DT)))
        s = tl.dot(qd1, tl.trans(tl.load(k_ptr + off + DQ + c[None, :], mask=tm[:, None], other=0.0).to(DT)), s)
        s = tl.dot(qd2, tl.trans(tl.load(k_ptr + off + 2 * DQ + c[None, :], mask=tm[:, None], other=0.0).to(DT)), s)
        s = tl.dot(qd3, tl.trans(tl.load(k_ptr + off + 3 * DQ + c[None, :], mask=tm[:, None], other=0.0).to(DT)), s)
    if CAUSAL:
        s = tl.where((t[None, :] <= tq[:, None]) & tm[None, :], s, float("-inf"))
    else:
        s = tl.where(tm[None, :], s, float("-inf"))
    m_i, alpha, pr = _online(s, m_i, csc, lv, 0.0, False)
    l_i = l_i * alpha + tl.sum(pr, axis=1)
    osum = osum * alpha
    p16 = pr.to(v_ptr.dtype.element_ty).to(DT)
    if VCAT:
        v = tl.load(v_ptr + off + tl.arange(0, D)[None, :], mask=tm[:, None], other=0.0)
        a0 = tl.dot(p16, v.to(DT), a0 * alpha[:, None])
    else:
        a0 = tl.dot(p16, tl.load(v_ptr + off + c[None, :], mask=tm[:, None], other=0.0).to(DT), a0 * alpha[:, None])
        a1 = tl.dot(p16, tl.load(v_ptr + off + DQ + c[None, :], mask=tm[:, None], other=0.0).to(DT),
                    a1 * alpha[:, None])
        a2 = tl.dot(p16, tl.load(v_ptr + off + 2 * DQ + c[None, :], mask=tm[:, None], other=0.0).to(DT),
                    a2 * alpha[:, None])
        a3 = tl.dot(p16, tl.load(v_ptr + off + 3 * DQ + c[None, :], mask=tm[:, None], other=0.0).to(DT),
                    a3 * alpha[:, None])
    return m_i, l_i, osum, a0, a1, a2, a3


@triton.jit
def _extend_kernel(
    q_ptr, sq_b, sq_t, sq_h, kn_ptr, vn_ptr, sn_b, sn_t, sn_h,
    kc_ptr, ks_ptr, ko_ptr, vc_ptr, vs_ptr, vo_ptr, s_cp, s_ch, s_kmp, s_kmh, s_mp, s_mh, bt_ptr, s_bt, qlen_ptr,
    k16_ptr, v16_ptr, s16b, s16h, s16t, len16_ptr, out_ptr, so_b, so_t, so_h,
    T, HKV, sm_scale,
    G: tl.constexpr, D: tl.constexpr, PS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ASM: tl.constexpr, F32DOT: tl.constexpr, KCH: tl.constexpr, QNAT: tl.constexpr, CBF: tl.constexpr,
    KCAT: tl.constexpr, VCAT: tl.constexpr, LAZY: tl.constexpr, PMUL16: tl.constexpr, TAU: tl.constexpr,
    DENSE_STAGES: tl.constexpr, DEQ: tl.constexpr, PPS: tl.constexpr,
):
    """``DEQ``: ``fold="dequant"`` (:func:`_page_step_dq`), else the scale/offset factoring (:func:`_page_step`).
    ``KCAT``/``VCAT``: keys/values as one natural-order ``[n, D]`` operand (else four field blocks).
    ``QNAT`` (token pages only): the query enters the dots unscaled in its own dtype (exact; codes in that dtype,
    ``CBF`` = bfloat16) and ``sm_scale log2(e)`` goes into the exponent; else it is prescaled and rounded to
    float16 for the code dot (as channel pages need) and to the 16-bit tiers' dtype for theirs. With the
    factoring, all sums are kept in units of ``v_ref`` = the first page's largest V scale rounded up to a power
    of two (>= 2^-6), so that ``P s_v / v_ref`` fits float16; it cancels in the final division."""
    TOK_M: tl.constexpr = BLOCK_M // G
    DQ: tl.constexpr = D // 4
    LOG2E: tl.constexpr = 1.4426950408889634
    if F32DOT:
        DT: tl.constexpr = tl.float32
        DT16: tl.constexpr = tl.float32
    else:
        DT: tl.constexpr = tl.float16
        DT16: tl.constexpr = k16_ptr.dtype.element_ty
    pid_m = tl.program_id(0)
    b, h, tq, hq, rmask, qrow = _query_rows(q_ptr, sq_b, sq_t, sq_h, T, HKV, G, BLOCK_M)
    c = tl.arange(0, DQ)
    scale = sm_scale * LOG2E
    if KCAT:
        x0 = tl.load(qrow + tl.arange(0, D)[None, :], mask=rmask[:, None], other=0.0)
        x1 = x0
        x2 = x0
        x3 = x0
    else:
        x0 = tl.load(qrow + c[None, :], mask=rmask[:, None], other=0.0)
        x1 = tl.load(qrow + DQ + c[None, :], mask=rmask[:, None], other=0.0)
        x2 = tl.load(qrow + 2 * DQ + c[None, :], mask=rmask[:, None], other=0.0)
        x3 = tl.load(qrow + 3 * DQ + c[None, :], mask=rmask[:, None], other=0.0)
    if DEQ and not KCH:
        # dequantized float16 keys: q enters unscaled as float16 (exact for a bfloat16 q in float16's range)
        qk0, qk1, qk2, qk3 = x0.to(DT), x1.to(DT), x2.to(DT), x3.to(DT)
        qd0, qd1, qd2, qd3 = x0.to(DT16), x1.to(DT16), x2.to(DT16), x3.to(DT16)
        csc = scale
        qsc = tl.zeros([BLOCK_M], tl.float32)
    elif QNAT:
        # q . c is exact in q's own dtype; the logits stay unscaled and the exponent applies sm_scale log2(e)
        if F32DOT:
            qk0, qk1, qk2, qk3 = x0.to(tl.float32), x1.to(tl.float32), x2.to(tl.float32), x3.to(tl.float32)
        else:
            qk0, qk1, qk2, qk3 = x0, x1, x2, x3
        qd0, qd1, qd2, qd3 = x0.to(DT16), x1.to(DT16), x2.to(DT16), x3.to(DT16)
        csc = scale
        if KCAT:
            qsc = tl.sum(x0.to(tl.float32), axis=1)
        else:
            qsc = tl.sum(x0.to(tl.float32) + x1.to(tl.float32) + x2.to(tl.float32) + x3.to(tl.float32), axis=1)
    else:
        y0, y1, y2, y3 = x0.to(tl.float32) * scale, x1.to(tl.float32) * scale, x2.to(tl.float32) * scale, \
            x3.to(tl.float32) * scale
        h0, h1, h2, h3 = y0.to(tl.float16), y1.to(tl.float16), y2.to(tl.float16), y3.to(tl.float16)
        qk0, qk1, qk2, qk3 = h0.to(DT), h1.to(DT), h2.to(DT), h3.to(DT)
        qd0, qd1, qd2, qd3 = y0.to(DT16), y1.to(DT16), y2.to(DT16), y3.to(DT16)
        csc = 1.0
        if KCAT:
            qsc = tl.sum(h0.to(tl.float32), axis=1)
        else:
            qsc = tl.sum(h0.to(tl.float32) + h1.to(tl.float32) + h2.to(tl.float32) + h3.to(tl.float32), axis=1)
    tau = TAU / csc  # the lazy threshold in logit units
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    osum = tl.zeros([BLOCK_M], tl.float32)
    if VCAT:
        a0 = tl.zeros([BLOCK_M, D], tl.float32)
        a1 = tl.zeros([1, 1], tl.float32)
        a2 = a1
        a3 = a1
    else:
        a0 = tl.zeros([BLOCK_M, DQ], tl.float32)
        a1 = tl.zeros([BLOCK_M, DQ], tl.float32)
        a2 = tl.zeros([BLOCK_M, DQ], tl.float32)
        a3 = tl.zeros([BLOCK_M, DQ], tl.float32)
    # 1) the 2-bit pages, PPS a step (fold "dequant" with token pages; else one), full steps unmasked, the partial
    # one last
    NB: tl.constexpr = PS * PPS
    n = tl.arange(0, PS)
    ntok = tl.load(qlen_ptr + b)
    bt_row = bt_ptr + b.to(tl.int64) * s_bt
    nfull = ntok // PS
    npages = tl.cdiv(ntok, PS)
    nsteps = nfull if PPS == 1 else ntok // NB  # full steps
    # page ids are read one step ahead, so the code and metadata loads of a step depend on a value loaded an
    # iteration earlier and the loop pipeliner can issue them early (not behind a block-table load)
    page = _step_pages(bt_row, 0, 0, npages, PS, PPS)
    lv = 0.0
    if DEQ:
        # the row metadata too is read a step ahead (in registers: in flight during this step, a few values per
        # thread); page 0 stands in past the last page (every pool holds one; an empty pool is never read)
        ksr = tl.zeros([NB], tl.float16)
        kor = ksr
        vsr = ksr
        vor = ksr
        if npages > 0:
            ksr, kor, vsr, vor = _meta_rows(ks_ptr, ko_ptr, vs_ptr, vo_ptr, page, h, s_mp, s_mh, PS, not KCH, PPS)
        for p in range(0, nsteps):
            page_next = _step_pages(bt_row, p, 1, npages, PS, PPS)
            ks_n, ko_n, vs_n, vo_n = _meta_rows(ks_ptr, ko_ptr, vs_ptr, vo_ptr, page_next, h, s_mp, s_mh, PS,
                                                not KCH, PPS)
            m_i, l_i, a0, a1, a2, a3 = _page_step_dq(
                p, page, ntok, kc_ptr, ks_ptr, ko_ptr, vc_ptr, s_cp, s_ch, s_kmp, s_kmh, h, ksr, kor, vsr, vor,
                qk0, qk1, qk2, qk3, csc, tau, m_i, l_i, a0, a1, a2, a3, D, PS, ASM, F32DOT, KCH, KCAT, VCAT, LAZY,
                False, PPS)
            page = page_next
            ksr, kor, vsr, vor = ks_n, ko_n, vs_n, vo_n
        if nsteps * NB < ntok:
            m_i, l_i, a0, a1, a2, a3 = _page_step_dq(
                nsteps, page, ntok, kc_ptr, ks_ptr, ko_ptr, vc_ptr, s_cp, s_ch, s_kmp, s_kmh, h, ksr, kor, vsr, vor,
                qk0, qk1, qk2, qk3, csc, tau, m_i, l_i, a0, a1, a2, a3, D, PS, ASM, F32DOT, KCH, KCAT, VCAT, LAZY,
                True, PPS)
    else:  # fold "factor": one page a step
        if ntok > 0:
            page0 = tl.load(bt_row).to(tl.int64)
            vs0 = tl.load(vs_ptr + page0 * s_mp + h * s_mh + n, mask=n < ntok, other=0.0).to(tl.float32)
            lv = tl.minimum(tl.maximum(tl.ceil(tl.log2(tl.max(vs0, axis=0))), -6.0), 15.0)
        for p in range(0, nfull):
            page_next = _step_pages(bt_row, p, 1, npages, PS, 1)
            m_i, l_i, osum, a0, a1, a2, a3 = _page_step(
                p, page, ntok, kc_ptr, ks_ptr, ko_ptr, vc_ptr, vs_ptr, vo_ptr, s_cp, s_ch, s_kmp, s_kmh, s_mp,
                s_mh, h, qk0, qk1, qk2, qk3, qsc, csc, lv, tau, m_i, l_i, osum, a0, a1, a2, a3,
                D, PS, ASM, F32DOT, KCH, CBF, KCAT, VCAT, LAZY, PMUL16, False)
            page = page_next
        if nfull * PS < ntok:
            m_i, l_i, osum, a0, a1, a2, a3 = _page_step(
                nfull, page, ntok, kc_ptr, ks_ptr, ko_ptr, vc_ptr, vs_ptr, vo_ptr, s_cp, s_ch, s_kmp, s_kmh, s_mp,
                s_mh, h, qk0, qk1, qk2, qk3, qsc, csc, lv, tau, m_i, l_i, osum, a0, a1, a2, a3,
                D, PS, ASM, F32DOT, KCH, CBF, KCAT, VCAT, LAZY, PMUL16, True)
    # 2) the 16-bit tiers (sink + recent), then 3) the chunk itself, causally
    n16 = tl.load(len16_ptr + b)
    base16 = b.to(tl.int64) * s16b + h * s16h
    for t0 in tl.range(0, n16, BLOCK_N, num_stages=DENSE_STAGES):
        m_i, l_i, osum, a0, a1, a2, a3 = _dense_step(
            k16_ptr, v16_ptr, base16, t0, n16, s16t, tq, qd0, qd1, qd2, qd3, csc, lv, m_i, l_i, osum,
            a0, a1, a2, a3, D, BLOCK_N, F32DOT, KCAT, VCAT, False)
    basen = b.to(tl.int64) * sn_b + h * sn_h
    hi = tl.minimum(T, (pid_m + 1) * TOK_M)
    for t0 in tl.range(0, hi, BLOCK_N, num_stages=DENSE_STAGES):
        m_i, l_i, osum, a0, a1, a2, a3 = _dense_step(
            kn_ptr, vn_ptr, basen, t0, T, sn_t, tq, qd0, qd1, qd2, qd3, csc, lv, m_i, l_i, osum,
            a0, a1, a2, a3, D, BLOCK_N, F32DOT, KCAT, VCAT, True)
    inv = 1.0 / tl.where(l_i > 0, l_i, 1.0)
    oo = (osum * inv)[:, None]
    optr = out_ptr + b.to(tl.int64) * so_b + tq.to(tl.int64)[:, None] * so_t + hq[:, None] * so_h
    ot = out_ptr.dtype.element_ty
    if VCAT:
        tl.store(optr + tl.arange(0, D)[None, :], (a0 * inv[:, None] + oo).to(ot), mask=rmask[:, None])
    else:
        tl.store(optr + c[None, :], (a0 * inv[:, None] + oo).to(ot), mask=rmask[:, None])
        tl.store(optr + DQ + c[None, :], (a1 * inv[:, None] + oo).to(ot), mask=rmask[:, None])
        tl.store(optr + 2 * DQ + c[None, :], (a2 * inv[:, None] + oo).to(ot), mask=rmask[:, None])
        tl.store(optr + 3 * DQ + c[None, :], (a3 * inv[:, None] + oo).to(ot), mask=rmask[:, None])


def extend_attention_triton(
    q: Tensor, k_new: Tensor, v_new: Tensor, k_pages: QuantPages, v_pages: QuantPages, block_table: Tensor,
    qlen: Tensor, k16: Tensor, v16: Tensor, len16: Tensor, sm_scale: float | None = None, *,
    out: Tensor | None = None, block_m: int = 64, block_n: int = 64, num_warps: int = 4, num_stages: int | None = None,
    dense_stages: int = 2, fold: str | None = None, unpack: str = "cat", qnative: bool | None = None,
    rescale: str = "always", pmul: str = "f16", maxnreg: int = 0, pages_per_step: int | None = None,
    tma: bool = False, segment_tokens: int = SEGMENT_TOKENS, host_lengths: tuple | None = None,
) -> Tensor:
    """Chunk attention over a quantized prefix; semantics of
    :func:`oscarkv.kernels.reference.extend_attention_ref`. q ``[B, T, Hq, d]``, k_new/v_new
    ``[B, T, Hkv, d]``; returns ``[B, T, Hq, d]`` (dtype of q unless ``out`` is given). Keys may be in
    channel pages (each page holding a live token written whole): the tile is dequantized with the page's
    per-channel scale/offset before the product.

    Tuning (results agree within the error budget): ``block_m`` query rows ((token, GQA head) pairs) per
    program; ``block_n`` 16-bit keys per tile (2-bit tiles are one page); ``num_warps``; ``num_stages``
    (software pipelining of the page loop's loads; default None: 2 with more than one page a step, else 3,
    as measured fastest on the H200, docs/results/kernels_h200.md) and ``dense_stages`` (of the 16-bit loops); ``maxnreg``
    (register cap, 0 = none): these apply to the fused folds, and setting any of them makes the default fold
    ``"dequant"``. Variants: ``fold`` (default None: ``"sdpa"`` where
    :func:`~oscarkv.kernels.extend_sdpa.sdpa_supported`, else ``"dequant"``; ``"sdpa"``: the prefix dequantized
    segment by segment, at most ``segment_tokens`` tokens, into a bounded workspace and attended by cuDNN with
    its log-sum-exp, the chunk causally likewise, the partials merged
    (:mod:`oscarkv.kernels.extend_sdpa`; ``host_lengths = (qlen, len16)`` as host integers spares a device
    read); ``"dequant"``: each page's code tiles are
    dequantized to float16 once, shared by all query rows, and attention runs on them; ``"factor"``: scale and
    offset factored out of both products, applied per score); ``unpack`` (module docstring); ``rescale``
    (``"lazy"``: the running max moves only by more than 2^3 and the accumulator rescale is skipped, behind one
    block-wide flag, when no row's max moved; ``"always"``: every page, as flash attention). ``"factor"``
    only: ``qnative`` (token pages: the query enters the code dot unscaled in its own dtype, default True;
    False prescales it to float16 as channel pages always do) and ``pmul`` (``"f16"``: ``P s_v`` multiplied
    in float16, ``"f32"``: in float32 then rounded). ``"dequant"`` with token pages only: ``pages_per_step``
    (1, 2 or 4 pages as one ``[page_size pages_per_step, d]`` tile per step: fewer, larger online-softmax
    steps; default None = 2 there, 1 otherwise).
    ``fold="workspace"``: two passes, the 2-bit pages first dequantized (float16, the same values as
    ``"dequant"``) into a transient ``[B, Hkv, pages, d]`` K and V workspace (``2 B Hkv page_size
    block_table.shape[1] d`` float16 values: 133 MB at 32K tokens x 8 KV heads x d 128), then plain flash
    attention over it (:func:`extend_attention_dense`; ``block_n`` keys per tile everywhere, ``tma``: the
    workspace tiles through TMA descriptors: materialised, unlike the fused folds);
    ``unpack``/``rescale``/``qnative``/``pmul`` do not apply.
    """
    given = locals()  # only the arguments so far
    fused_knobs_set = any(given[k] != _FUSED_DEFAULTS[k] for k in _FUSED_KNOBS)
    B, T, hq, d = q.shape
    fmt = k_pages.fmt
    dev = q.device
    if fmt.bits != 2 or fmt.groups != 1:
        raise ValueError("the Triton extend kernel supports bits=2 with one group per row: use the reference "
                         "(backend='reference')")
    check_kv_formats(k_pages, v_pages)
    if d != fmt.head_dim or hq % fmt.num_kv_heads or d < 64 or d & (d - 1):
        raise ValueError(f"q {tuple(q.shape)} vs pages (d={fmt.head_dim}, Hkv={fmt.num_kv_heads}): the kernel "
                         "needs d a power of two >= 64 and Hq a multiple of Hkv")
    if k_new.shape != (B, T, fmt.num_kv_heads, d) or v_new.shape != k_new.shape:
        raise ValueError(f"k_new/v_new must be [{B}, {T}, {fmt.num_kv_heads}, {d}], got {tuple(k_new.shape)}")
    if fmt.page_size < 16 or fmt.page_size & (fmt.page_size - 1):
        raise ValueError(f"the kernel needs a power-of-two page_size >= 16, got {fmt.page_size}")
    for name, t in (("block_table", block_table), ("qlen", qlen), ("len16", len16), ("k16", k16),
                    ("k_new", k_new)):
        check_device(name, t, dev)
    check_pool_strides(k_pages, v_pages, dev)
    if k16.stride(3) != 1 or v16.stride() != k16.stride() or k_new.stride(3) != 1 or v_new.stride() != k_new.stride():
        raise ValueError("k16/v16 and k_new/v_new must have unit last stride and equal strides")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q must be float16, bfloat16 or float32, got {q.dtype}")
    default_fold = fold is None
    if default_fold:  # a fused-kernel knob set by the caller asks for the fused kernel
        fold = "sdpa" if not fused_knobs_set and sdpa_supported(q, d, host_lengths is not None) else "dequant"
    elif fold == "sdpa" and fused_knobs_set:
        raise ValueError(f"the fused-kernel knobs ({', '.join(_FUSED_KNOBS)}) do not apply to fold='sdpa'")
    if unpack not in UNPACKS or rescale not in RESCALES or pmul not in PMULS or fold not in FOLDS:
        raise ValueError(f"unpack must be one of {UNPACKS}, rescale one of {RESCALES}, pmul one of {PMULS}, fold "
                         f"one of {FOLDS}; got {unpack!r}, {rescale!r}, {pmul!r}, {fold!r}")
    if not (_pow2(block_m) and _pow2(block_n) and block_m >= 16 and block_n >= 16):
        raise ValueError(f"block_m and block_n must be powers of two >= 16, got {block_m}, {block_n}")
    if pages_per_step is None:  # the measured best fused geometry: 2 pages a step (token pages, "dequant"; also
        # what a default "sdpa" falls back to)
        pages_per_step = 2 if fold in ("dequant", "sdpa") and not fmt.channel else 1
    if num_stages is None:  # H200, session 14: 2 pages a step 3.26 ms with 2 stages, 3.43 with 3
        num_stages = 2 if pages_per_step > 1 else 3
    if num_stages < 1 or dense_stages < 1 or maxnreg < 0:
        raise ValueError(f"num_stages and dense_stages must be >= 1 and maxnreg >= 0, got {num_stages}, "
                         f"{dense_stages}, {maxnreg}")
    if tma and fold != "workspace":  # code tiles through TMA in the fused folds: removed (session 14: did not
        # compile at 2 pages a step with triton 3.6, and 4.39 vs 3.57 ms at 4 pages on the H200)
        raise ValueError("tma=True applies to fold='workspace' only (the workspace tiles through TMA descriptors)")
    if pages_per_step not in (1, 2, 4) or (pages_per_step > 1 and (fold not in ("dequant", "sdpa") or fmt.channel)):
        raise ValueError(f"pages_per_step must be 1, 2 or 4, and > 1 only with fold='dequant' and token-page "
                         f"keys; got {pages_per_step} (fold {fold!r}, key layout {fmt.layout!r})")
    g = hq // fmt.num_kv_heads
    if g > block_m:
        raise ValueError(f"GQA group {g} larger than block_m {block_m}")
    if q.stride(3) != 1:
        q = q.contiguous()
    if out is None:
        out = torch.empty(B, T, hq, d, dtype=q.dtype, device=dev)
    sm_scale = float(d**-0.5 if sm_scale is None else sm_scale)
    if k_new.dtype != k16.dtype:  # one dtype for the dense dots: the chunk's rows as the 16-bit tiers store them
        k_new, v_new = k_new.to(k16.dtype), v_new.to(k16.dtype)
    if q.dtype == torch.float32:  # the dots take 16-bit queries: prescale (as the previous kernel did) to float16
        q, sm_scale = (q * sm_scale).to(torch.float16), 1.0
    if fold == "sdpa":
        try:
            return extend_attention_sdpa(q, k_new, v_new, k_pages, v_pages, block_table, qlen, k16, v16, len16,
                                         sm_scale, out, segment_tokens=segment_tokens, host_lengths=host_lengths)
        except RuntimeError as e:  # cuDNN refused the shape or the device: the default falls back, once
            if not default_fold:
                raise
            if isinstance(e, torch.OutOfMemoryError):  # this call's memory, not cuDNN failing: not remembered
                warnings.warn("extend: out of memory for the cuDNN fold's workspace; this call runs the fused "
                              "kernel (fold='dequant'), which needs none", stacklevel=2)
            else:
                mark_cudnn_broken(q, d, e)
            fold = "dequant"
    if fold == "workspace":
        kw, vw = dequant_workspace(k_pages, v_pages, block_table, qlen, round_to=block_n)
        if k16.dtype != torch.float16:  # every dot in float16 (as q and the workspace): convert once, not per tile
            k_new, v_new, k16, v16 = (x.to(torch.float16) for x in (k_new, v_new, k16, v16))
        return _flash(q, k_new, v_new, kw, vw, qlen, k16, v16, len16, sm_scale, out, block_m, block_n, num_warps,
                      num_stages, dense_stages, tma, maxnreg)
    tok_m = block_m // g
    grid = (triton.cdiv(T, tok_m), B * fmt.num_kv_heads)
    args = (
        q, q.stride(0), q.stride(1), q.stride(2), k_new, v_new, k_new.stride(0), k_new.stride(1),
        k_new.stride(2), k_pages.codes, k_pages.scale, k_pages.offset, v_pages.codes, v_pages.scale,
        v_pages.offset, *pool_strides(k_pages), v_pages.scale.stride(0), v_pages.scale.stride(1), block_table,
        block_table.stride(0), qlen, k16, v16, k16.stride(0), k16.stride(1), k16.stride(2), len16, out,
        out.stride(0), out.stride(1), out.stride(2), T, fmt.num_kv_heads, sm_scale,
    )
    interp = interpreting()
    cap = {"maxnreg": int(maxnreg)} if maxnreg and not interp else {}
    qnat = (True if qnative is None else bool(qnative)) and not fmt.channel
    _extend_kernel[grid](
        *args, G=g, D=d, PS=fmt.page_size, BLOCK_M=block_m, BLOCK_N=block_n, ASM=not interp, F32DOT=interp,
        KCH=fmt.channel, QNAT=qnat, CBF=qnat and q.dtype == torch.bfloat16, KCAT=unpack == "cat",
        VCAT=unpack in ("vcat", "cat"), LAZY=rescale == "lazy", PMUL16=pmul == "f16", TAU=LAZY_TAU,
        DENSE_STAGES=dense_stages, DEQ=fold == "dequant", PPS=pages_per_step, num_warps=num_warps,
        num_stages=num_stages, **cap,
    )
    return out


_FUSED_DEFAULTS = {k: inspect.signature(extend_attention_triton).parameters[k].default for k in _FUSED_KNOBS}

__all__ = ["FOLDS", "PMULS", "RESCALES", "UNPACKS", "dequant_workspace", "extend_attention_dense",
           "extend_attention_triton"]
