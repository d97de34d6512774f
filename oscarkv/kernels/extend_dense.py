"""Prefill/extend attention as plain flash attention over 16-bit keys and values, with the extend kernel's program
geometry (:mod:`oscarkv.kernels.extend_triton`: rows = (token, GQA head) pairs of one KV head): a dense
``[B, Hkv, NP, d]`` prefix, then the 16-bit tiers, then the chunk causally. Two uses:

* ``fold="workspace"`` of :func:`~oscarkv.kernels.extend_triton.extend_attention_triton`: the 2-bit pages are
  first dequantized (:func:`dequant_workspace`, one program per (page, KV head): float16 ``o + c s`` rounded once,
  the fused kernel's values) into a transient workspace, then :func:`extend_attention_dense` runs over it; every
  query block of a KV head then shares one dequantization of each page, and the attention loop holds no
  unpacking. Cost: the workspace (``2 B Hkv NP d`` float16 values; 133 MB at 32K tokens x 8 KV heads x d 128)
  and one pass writing it.
* over a bfloat16 prefix, the Triton ceiling at the benchmark shape without quantization
  (``benchmarks/extend_probe.py``).

The prefix loop runs whole tiles unmasked (loads pipelined by ``cp.async``, or with ``tma`` through TMA
descriptors) and one masked partial tile; only the chunk's diagonal tiles are masked; ``sm_scale log2(e)`` rides
in the exponent's fma.
"""

from __future__ import annotations

import torch
from torch import Tensor

import triton
import triton.language as tl

from ._triton_util import check_device, interpreting, pool_strides
from .extend_tiles import _cat4, _dequant4, _fa_update, _query_rows, _unpack4
from .layout import QuantPages


@triton.jit
def _dequant_ws_kernel(
    kc_ptr, ks_ptr, ko_ptr, vc_ptr, vs_ptr, vo_ptr, s_cp, s_ch, s_kmp, s_kmh, s_mp, s_mh, bt_ptr, s_bt, qlen_ptr,
    kw_ptr, vw_ptr, sw_b, sw_h, sw_t, HKV, p0,
    D: tl.constexpr, PS: tl.constexpr, ASM: tl.constexpr, KCH: tl.constexpr,
):
    """``fold="workspace"``, pass 1: one (page slot, sequence, KV head) per program; the page's K and V as
    float16 ``o + c s`` rows (the fused kernel's asm: the same values; stored in the workspace's dtype) into the
    workspace at rows ``[p PS, (p+1) PS)``; rows past the sequence end (and slots past its last page) are written
    as zeros, so that the attention pass may read whole tiles. ``p0``: the first page slot (``fold="sdpa"``
    dequantizes a prefix segment by segment): program ``p`` takes slot ``p0 + p``."""
    DQ: tl.constexpr = D // 4
    p = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // HKV
    h = bh % HKV
    n = tl.arange(0, PS)
    c = tl.arange(0, DQ)
    dcol = tl.arange(0, D)
    ntok = tl.load(qlen_ptr + b) - p0 * PS
    tm = p * PS + n < ntok
    woff = b.to(tl.int64) * sw_b + h * sw_h + (p * PS + n).to(tl.int64)[:, None] * sw_t + dcol[None, :]
    if p * PS < ntok:
        page = tl.load(bt_ptr + b.to(tl.int64) * s_bt + p0 + p).to(tl.int64)
        crow = page * s_cp + h * s_ch + n * DQ
        row = page * s_mp + h * s_mh + n
        kc = tl.load(kc_ptr + crow[:, None] + c[None, :])
        vc = tl.load(vc_ptr + crow[:, None] + c[None, :])
        # metadata past the sequence end may be NaN: zero scale and offset give zero rows
        vs = tl.where(tm, tl.load(vs_ptr + row), 0.0).to(tl.float16)
        vo = tl.where(tm, tl.load(vo_ptr + row), 0.0).to(tl.float16)
        v0, v1, v2, v3 = _dequant4(vc, tl.broadcast_to(vs[:, None], (PS, DQ)), tl.broadcast_to(vo[:, None], (PS, DQ)),
                                   ASM, tl.float16)
        if KCH:  # a scale/offset per channel (page written whole); rows past the end are zeroed
            k0, k1, k2, k3 = _unpack4(kc, 0, ASM, tl.float32)
            kmeta = page * s_kmp + h * s_kmh
            ks = tl.load(ks_ptr + kmeta + dcol).to(tl.float32)
            ko = tl.load(ko_ptr + kmeta + dcol).to(tl.float32)
            kh = ko[None, :] + _cat4(k0, k1, k2, k3, PS, D).to(tl.float32) * ks[None, :]
            kh = tl.where(tm[:, None], kh, 0.0).to(tl.float16)
        else:
            ks = tl.where(tm, tl.load(ks_ptr + row), 0.0).to(tl.float16)
            ko = tl.where(tm, tl.load(ko_ptr + row), 0.0).to(tl.float16)
            k0, k1, k2, k3 = _dequant4(kc, tl.broadcast_to(ks[:, None], (PS, DQ)),
                                       tl.broadcast_to(ko[:, None], (PS, DQ)), ASM, tl.float16)
            kh = _cat4(k0, k1, k2, k3, PS, D)
        tl.store(kw_ptr + woff, kh.to(kw_ptr.dtype.element_ty))
        tl.store(vw_ptr + woff, _cat4(v0, v1, v2, v3, PS, D).to(vw_ptr.dtype.element_ty))
    else:
        zero = tl.zeros([PS, D], kw_ptr.dtype.element_ty)
        tl.store(kw_ptr + woff, zero)
        tl.store(vw_ptr + woff, zero)


@triton.jit
def _masked_tile(k_ptr, v_ptr, base, t, lim, s_t, dcol, qp, tq, m_i, l_i, acc, csc, DTP: tl.constexpr,
                 P16: tl.constexpr, CAUSAL: tl.constexpr):
    """One flash step over key/value rows ``t`` of a 16-bit tensor (row stride ``s_t`` from ``base``), rows at or
    past ``lim`` masked (and, CAUSAL, keys after each query row's token ``tq``)."""
    tm = t < lim
    off = base + t.to(tl.int64)[:, None] * s_t + dcol[None, :]
    k = tl.load(k_ptr + off, mask=tm[:, None], other=0.0)
    v = tl.load(v_ptr + off, mask=tm[:, None], other=0.0)
    s = tl.dot(qp, tl.trans(k.to(DTP)))
    if CAUSAL:
        keep = (t[None, :] <= tq[:, None]) & tm[None, :]
    else:
        keep = tm[None, :]
    s = tl.where(keep, s, float("-inf"))
    return _fa_update(s, v.to(DTP), m_i, l_i, acc, csc, P16)


@triton.jit
def _flash_extend_kernel(
    q_ptr, sq_b, sq_t, sq_h, kn_ptr, vn_ptr, sn_b, sn_t, sn_h,
    kp_ptr, vp_ptr, kp_desc, vp_desc, sp_b, sp_h, sp_t, NP, lenp_ptr,
    k16_ptr, v16_ptr, s16b, s16h, s16t, len16_ptr, out_ptr, so_b, so_t, so_h,
    T, HKV, sm_scale,
    G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, F32DOT: tl.constexpr,
    DESC: tl.constexpr, DENSE_STAGES: tl.constexpr,
):
    """Plain flash attention of a chunk over 16-bit keys/values, with the extend kernel's program geometry
    (rows = (token, GQA head) pairs of one KV head): 1) a dense prefix ``[B, Hkv, NP, d]`` of ``lenp[b]``
    rows (the dequantized workspace of ``fold="workspace"``, or any 16-bit tensor: the Triton ceiling without
    quantization), full tiles unmasked, through TMA descriptors with ``DESC`` (rows up to the tile end must
    then be finite: the workspace zeroes them); 2) the 16-bit tiers; 3) the chunk, causally, only the
    diagonal tiles masked. ``sm_scale log2(e)`` rides in the exponent; no ``lv``/offset sums."""
    TOK_M: tl.constexpr = BLOCK_M // G
    LOG2E: tl.constexpr = 1.4426950408889634
    # every dot in the prefix's dtype (one copy of q in shared memory; the 16-bit tiers' and chunk's tiles are
    # converted in registers when their dtype differs: float16 holds them as it holds q)
    P16: tl.constexpr = vp_ptr.dtype.element_ty
    if F32DOT:
        DTP: tl.constexpr = tl.float32
    else:
        DTP: tl.constexpr = P16
    pid_m = tl.program_id(0)
    b, h, tq, hq, rmask, qrow = _query_rows(q_ptr, sq_b, sq_t, sq_h, T, HKV, G, BLOCK_M)
    dcol = tl.arange(0, D)
    n = tl.arange(0, BLOCK_N)
    x = tl.load(qrow + dcol[None, :], mask=rmask[:, None], other=0.0)
    qp = x.to(DTP)
    csc = sm_scale * LOG2E
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    # 1) the dense prefix
    npre = tl.load(lenp_ptr + b)
    basep = b.to(tl.int64) * sp_b + h * sp_h
    row0 = (b * HKV + h) * NP
    nfull = npre // BLOCK_N
    for i in tl.range(0, nfull):
        t0 = i * BLOCK_N
        if DESC:
            k = kp_desc.load([row0 + t0, 0])
            v = vp_desc.load([row0 + t0, 0])
        else:
            off = basep + (t0 + n).to(tl.int64)[:, None] * sp_t + dcol[None, :]
            k = tl.load(kp_ptr + off)
            v = tl.load(vp_ptr + off)
        s = tl.dot(qp, tl.trans(k.to(DTP)))
        m_i, l_i, acc = _fa_update(s, v.to(DTP), m_i, l_i, acc, csc, P16)
    if nfull * BLOCK_N < npre:
        m_i, l_i, acc = _masked_tile(kp_ptr, vp_ptr, basep, nfull * BLOCK_N + n, npre, sp_t, dcol, qp, tq, m_i, l_i,
                                     acc, csc, DTP, P16, False)
    # 2) the 16-bit tiers (masked tiles)
    n16 = tl.load(len16_ptr + b)
    base16 = b.to(tl.int64) * s16b + h * s16h
    for t0 in tl.range(0, n16, BLOCK_N, num_stages=DENSE_STAGES):
        m_i, l_i, acc = _masked_tile(k16_ptr, v16_ptr, base16, t0 + n, n16, s16t, dcol, qp, tq, m_i, l_i, acc, csc,
                                     DTP, P16, False)
    # 3) the chunk: tiles wholly before the block's first token unmasked, then the diagonal ones causally
    basen = b.to(tl.int64) * sn_b + h * sn_h
    lo = (pid_m * TOK_M) // BLOCK_N * BLOCK_N
    for t0 in tl.range(0, lo, BLOCK_N, num_stages=DENSE_STAGES):
        off = basen + (t0 + n).to(tl.int64)[:, None] * sn_t + dcol[None, :]
        k = tl.load(kn_ptr + off)
        v = tl.load(vn_ptr + off)
        s = tl.dot(qp, tl.trans(k.to(DTP)))
        m_i, l_i, acc = _fa_update(s, v.to(DTP), m_i, l_i, acc, csc, P16)
    hi = tl.minimum(T, (pid_m + 1) * TOK_M)
    for t0 in tl.range(lo, hi, BLOCK_N, num_stages=DENSE_STAGES):
        m_i, l_i, acc = _masked_tile(kn_ptr, vn_ptr, basen, t0 + n, T, sn_t, dcol, qp, tq, m_i, l_i, acc, csc, DTP,
                                     P16, True)
    inv = 1.0 / tl.where(l_i > 0, l_i, 1.0)
    optr = out_ptr + b.to(tl.int64) * so_b + tq.to(tl.int64)[:, None] * so_t + hq[:, None] * so_h
    tl.store(optr + dcol[None, :], (acc * inv[:, None]).to(out_ptr.dtype.element_ty), mask=rmask[:, None])


def _pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def dequant_workspace(k_pages: QuantPages, v_pages: QuantPages, block_table: Tensor, qlen: Tensor, *,
                      round_to: int = 128) -> tuple[Tensor, Tensor]:
    """The 2-bit prefixes as float16 ``[B, Hkv, NP, d]`` K and V (``fold="workspace"``, pass 1): row ``t`` of
    sequence ``b`` = token ``t`` dequantized (``o + c s`` rounded once, the fused kernel's values; channel-page
    keys with their per-channel scale/offset); rows ``qlen[b] <= t < NP`` are zeros. ``NP``: the block table's
    pages, rounded up to a multiple of ``round_to`` rows (whole tiles for the attention pass)."""
    fmt = k_pages.fmt
    B, maxp = block_table.shape
    ps, d, hkv = fmt.page_size, fmt.head_dim, fmt.num_kv_heads
    unit = max(ps, round_to)
    npad = max(unit, triton.cdiv(maxp * ps, unit) * unit)
    kw = torch.empty(B, hkv, npad, d, dtype=torch.float16, device=k_pages.codes.device)
    vw = torch.empty_like(kw)
    dequant_pages_into(k_pages, v_pages, block_table, qlen, kw, vw, npad // ps)
    return kw, vw


def dequant_pages_into(k_pages: QuantPages, v_pages: QuantPages, block_table: Tensor, qlen: Tensor, kw: Tensor,
                       vw: Tensor, npages: int, p0: int = 0) -> None:
    """Launch :func:`_dequant_ws_kernel` for page slots ``[p0, p0 + npages)`` of every sequence of
    ``block_table``: slot ``p0 + p`` into rows ``[p PS, (p+1) PS)`` of ``kw``/``vw`` ``[B, Hkv, rows, d]`` (any
    16-bit dtype; rows past a sequence's ``qlen`` zeros)."""
    fmt = k_pages.fmt
    _dequant_ws_kernel[(npages, block_table.shape[0] * fmt.num_kv_heads)](
        k_pages.codes, k_pages.scale, k_pages.offset, v_pages.codes, v_pages.scale, v_pages.offset,
        *pool_strides(k_pages), v_pages.scale.stride(0), v_pages.scale.stride(1), block_table,
        block_table.stride(0), qlen, kw, vw, kw.stride(0), kw.stride(1), kw.stride(2), fmt.num_kv_heads, p0,
        D=fmt.head_dim, PS=fmt.page_size, ASM=not interpreting(), KCH=fmt.channel, num_warps=4,
    )


def _flash(q, k_new, v_new, kp, vp, lenp, k16, v16, len16, sm_scale, out, block_m, block_n, num_warps, num_stages,
           dense_stages, tma, maxnreg):
    B, T, hq, d = q.shape
    hkv = kp.shape[1]
    g = hq // hkv
    interp = interpreting()
    kd, vd = kp, vp
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        if not (kp.is_contiguous() and vp.is_contiguous()):
            raise ValueError("tma=True needs contiguous [B, Hkv, NP, d] prefix tensors")
        kd = TensorDescriptor.from_tensor(kp.view(-1, d), [block_n, d])
        vd = TensorDescriptor.from_tensor(vp.view(-1, d), [block_n, d])
    cap = {"maxnreg": int(maxnreg)} if maxnreg and not interp else {}
    grid = (triton.cdiv(T, block_m // g), B * hkv)
    _flash_extend_kernel[grid](
        q, q.stride(0), q.stride(1), q.stride(2), k_new, v_new, k_new.stride(0), k_new.stride(1), k_new.stride(2),
        kp, vp, kd, vd, kp.stride(0), kp.stride(1), kp.stride(2), kp.shape[2], lenp,
        k16, v16, k16.stride(0), k16.stride(1), k16.stride(2), len16, out, out.stride(0), out.stride(1),
        out.stride(2), T, hkv, sm_scale, G=g, D=d, BLOCK_M=block_m, BLOCK_N=block_n, F32DOT=interp, DESC=bool(tma),
        DENSE_STAGES=dense_stages, num_warps=num_warps, num_stages=num_stages, **cap,
    )
    return out


def extend_attention_dense(
    q: Tensor, k_new: Tensor, v_new: Tensor, k_pre: Tensor, v_pre: Tensor, len_pre: Tensor, k16: Tensor,
    v16: Tensor, len16: Tensor, sm_scale: float | None = None, *, out: Tensor | None = None, block_m: int = 128,
    block_n: int = 64, num_warps: int = 8, num_stages: int = 3, dense_stages: int = 2, tma: bool = False,
    maxnreg: int = 0,
) -> Tensor:
    """Plain Triton flash attention with the extend kernel's geometry and semantics over a 16-bit prefix
    ``k_pre``/``v_pre`` ``[B, Hkv, NP, d]`` (``len_pre[b]`` valid rows) instead of 2-bit pages, then the 16-bit
    tiers and the chunk causally (as :func:`extend_attention_triton`). The attention pass of
    ``fold="workspace"``, and with a bfloat16 prefix the Triton ceiling at the same shape without quantization.
    ``tma``: prefix tiles through TMA descriptors (contiguous prefix; rows up to each sequence's last whole
    ``block_n`` tile must be finite). Every dot runs in the prefix's dtype: q, and the 16-bit tiers' and
    chunk's tiles when theirs differs, are converted to it (float16 must then hold them)."""
    B, T, hq, d = q.shape
    hkv = k_pre.shape[1]
    dev = q.device
    if k_pre.ndim != 4 or k_pre.shape[0] != B or k_pre.shape[3] != d or v_pre.shape != k_pre.shape or \
            v_pre.stride() != k_pre.stride() or k_pre.stride(3) != 1 or hq % hkv or d < 16 or d & (d - 1):
        raise ValueError(f"k_pre/v_pre must be [{B}, Hkv, NP, {d}] with equal strides, Hq a multiple of Hkv; got "
                         f"{tuple(k_pre.shape)}, {tuple(v_pre.shape)}")
    if k_new.shape != (B, T, hkv, d) or v_new.shape != k_new.shape or k16.shape[:2] != (B, hkv):
        raise ValueError(f"k_new/v_new must be [{B}, {T}, {hkv}, {d}] and k16/v16 [{B}, {hkv}, C16, {d}]")
    if k_pre.dtype not in (torch.float16, torch.bfloat16) or v_pre.dtype != k_pre.dtype:
        raise ValueError(f"k_pre/v_pre must be float16 or bfloat16, got {k_pre.dtype}, {v_pre.dtype}")
    for name, t in (("k_pre", k_pre), ("len_pre", len_pre), ("len16", len16), ("k16", k16), ("k_new", k_new)):
        check_device(name, t, dev)
    if k16.stride(3) != 1 or v16.stride() != k16.stride() or k_new.stride(3) != 1 or v_new.stride() != k_new.stride():
        raise ValueError("k16/v16 and k_new/v_new must have unit last stride and equal strides")
    if not (_pow2(block_m) and _pow2(block_n) and block_m >= 16 and block_n >= 16) or hq // hkv > block_m:
        raise ValueError(f"block_m and block_n must be powers of two >= 16 and block_m >= the GQA group, got "
                         f"{block_m}, {block_n}")
    if q.stride(3) != 1:
        q = q.contiguous()
    if out is None:
        out = torch.empty(B, T, hq, d, dtype=q.dtype, device=dev)
    sm_scale = float(d**-0.5 if sm_scale is None else sm_scale)
    if k_new.dtype != k16.dtype:
        k_new, v_new = k_new.to(k16.dtype), v_new.to(k16.dtype)
    if q.dtype == torch.float32:
        q, sm_scale = (q * sm_scale).to(torch.float16), 1.0
    return _flash(q, k_new, v_new, k_pre, v_pre, len_pre, k16, v16, len16, sm_scale, out, block_m, block_n,
                  num_warps, num_stages, dense_stages, tma, maxnreg)


__all__ = ["dequant_pages_into", "dequant_workspace", "extend_attention_dense"]
