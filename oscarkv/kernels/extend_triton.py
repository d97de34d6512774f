"""Triton prefill/extend attention over a quantized prefix: the queries of a new chunk attend causally to the
chunk (16-bit) and fully to the earlier tokens as stored (16-bit tiers + quantized pages of any format).

Two paths, picked by :func:`extend_attention_triton`:

* the cuDNN fold (:mod:`oscarkv.kernels.extend_sdpa`) for long chunks: the prefix dequantized segment by
  segment into a bounded workspace and attended by cuDNN;
* the fused kernel (this module) otherwise: flash-attention style, one program = one (sequence, KV head, block of
  query rows), the rows being (token, query head of the GQA group) pairs, so one dequantized tile serves every
  query head of its KV head. Each page's code tiles become float16 ``o + c s`` once
  (:func:`~oscarkv.kernels.extend_tiles._dequant_tile`), then plain flash attention runs on them; token-page
  keys take two pages per step as one tile (fewer, larger online-softmax steps), channel-page keys one page.
"""

from __future__ import annotations

import warnings

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._triton_util import (
    check_device,
    check_kv_formats,
    check_pool_strides,
    interpreting,
    pool_strides,
)
from .extend_sdpa import extend_attention_sdpa, mark_cudnn_broken, sdpa_supported
from .extend_tiles import _dequant_tile, _online, _query_rows
from .layout import QuantPages

BLOCK_M, BLOCK_N, NUM_WARPS = 64, 64, 4


@triton.jit
def _step_pages(bt_row, p, AHEAD: tl.constexpr, npages, PS: tl.constexpr, PPS: tl.constexpr):
    """The page ids of step ``p + AHEAD`` (page 0 past the last): a scalar at one page a step, else that of each
    of the ``PS PPS`` rows (``PPS`` pages)."""
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
    p, page, ntok, kc_ptr, ks_ptr, ko_ptr, vc_ptr, vs_ptr, vo_ptr, s_kcp, s_kch, s_kmp, s_kmh, s_vcp, s_vch, s_vmp,
    s_vmh, h, qk, csc, m_i, l_i, acc,
    D: tl.constexpr, PS: tl.constexpr, PPS: tl.constexpr, KB: tl.constexpr, VB: tl.constexpr, KCH: tl.constexpr,
    ASM: tl.constexpr, F32DOT: tl.constexpr, MASKED: tl.constexpr,
):
    """One step of ``PPS`` pages: K and V tiles dequantized to float16, then a flash-attention step. ``MASKED``:
    the sequence's last, partial step (rows past ``ntok`` are masked out)."""
    NB: tl.constexpr = PS * PPS
    if F32DOT:
        DT: tl.constexpr = tl.float32
    else:
        DT: tl.constexpr = tl.float16
    n = tl.arange(0, NB)
    rows = n % PS
    if MASKED:
        live = p * NB + n < ntok
    else:
        live = n >= 0
    kt = _dequant_tile(kc_ptr, ks_ptr, ko_ptr, page, h, s_kcp, s_kch, s_kmp, s_kmh, rows, live, KB, KCH, D, NB, ASM)
    s = tl.dot(qk, tl.trans(kt.to(DT)))
    if MASKED:
        s = tl.where(live[None, :], s, float("-inf"))
    m_new, alpha, pr = _online(s, m_i, csc)
    l_i = l_i * alpha + tl.sum(pr, axis=1)
    vt = _dequant_tile(vc_ptr, vs_ptr, vo_ptr, page, h, s_vcp, s_vch, s_vmp, s_vmh, rows, live, VB, False, D, NB, ASM)
    acc = tl.dot(pr.to(tl.float16).to(DT), vt.to(DT), acc * alpha[:, None])
    return m_new, l_i, acc


@triton.jit
def _dense_step(k_ptr, v_ptr, base, t0, n_hi, s_t, tq, qd, csc, m_i, l_i, acc, D: tl.constexpr,
                BLOCK_N: tl.constexpr, F32DOT: tl.constexpr, CAUSAL: tl.constexpr):
    """One tile of ``BLOCK_N`` 16-bit keys/values (rows ``t0 + i < n_hi``; ``CAUSAL``: also ``t <= tq``)."""
    if F32DOT:
        DT: tl.constexpr = tl.float32
    else:
        DT: tl.constexpr = k_ptr.dtype.element_ty
    t = t0 + tl.arange(0, BLOCK_N)
    tm = t < n_hi
    off = base + t.to(tl.int64)[:, None] * s_t + tl.arange(0, D)[None, :]
    k = tl.load(k_ptr + off, mask=tm[:, None], other=0.0)
    s = tl.dot(qd, tl.trans(k.to(DT)))
    if CAUSAL:
        s = tl.where((t[None, :] <= tq[:, None]) & tm[None, :], s, float("-inf"))
    else:
        s = tl.where(tm[None, :], s, float("-inf"))
    m_i, alpha, pr = _online(s, m_i, csc)
    l_i = l_i * alpha + tl.sum(pr, axis=1)
    v = tl.load(v_ptr + off, mask=tm[:, None], other=0.0)
    acc = tl.dot(pr.to(v_ptr.dtype.element_ty).to(DT), v.to(DT), acc * alpha[:, None])
    return m_i, l_i, acc


@triton.jit
def _extend_kernel(
    q_ptr, sq_b, sq_t, sq_h, kn_ptr, vn_ptr, sn_b, sn_t, sn_h,
    kc_ptr, ks_ptr, ko_ptr, vc_ptr, vs_ptr, vo_ptr, s_kcp, s_kch, s_kmp, s_kmh, s_vcp, s_vch, s_vmp, s_vmh,
    bt_ptr, s_bt, qlen_ptr, k16_ptr, v16_ptr, s16b, s16h, s16t, len16_ptr, out_ptr, so_b, so_t, so_h,
    T, HKV, sm_scale,
    G: tl.constexpr, D: tl.constexpr, PS: tl.constexpr, PPS: tl.constexpr, KB: tl.constexpr, VB: tl.constexpr,
    KCH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ASM: tl.constexpr, F32DOT: tl.constexpr,
):
    """The queries enter every dot unscaled (float16 for the dequantized tiles, the 16-bit tiers' dtype for
    theirs); ``sm_scale log2(e)`` is applied in the exponent."""
    TOK_M: tl.constexpr = BLOCK_M // G
    if F32DOT:
        DT: tl.constexpr = tl.float32
        DT16: tl.constexpr = tl.float32
    else:
        DT: tl.constexpr = tl.float16
        DT16: tl.constexpr = k16_ptr.dtype.element_ty
    pid_m = tl.program_id(0)
    b, h, tq, hq, rmask, qrow = _query_rows(q_ptr, sq_b, sq_t, sq_h, T, HKV, G, BLOCK_M)
    x = tl.load(qrow + tl.arange(0, D)[None, :], mask=rmask[:, None], other=0.0)
    qk = x.to(DT)
    qd = x.to(DT16)
    csc = sm_scale * 1.4426950408889634
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    # 1) the quantized pages, PPS a step, full steps unmasked, the partial one last; page ids are read a step
    # ahead, so a step's loads depend on a value loaded an iteration earlier and the pipeliner can issue them early
    NB: tl.constexpr = PS * PPS
    ntok = tl.load(qlen_ptr + b)
    bt_row = bt_ptr + b.to(tl.int64) * s_bt
    npages = tl.cdiv(ntok, PS)
    nsteps = ntok // NB
    page = _step_pages(bt_row, 0, 0, npages, PS, PPS)
    for p in range(nsteps):
        page_next = _step_pages(bt_row, p, 1, npages, PS, PPS)
        m_i, l_i, acc = _page_step(p, page, ntok, kc_ptr, ks_ptr, ko_ptr, vc_ptr, vs_ptr, vo_ptr, s_kcp, s_kch, s_kmp,
                                   s_kmh, s_vcp, s_vch, s_vmp, s_vmh, h, qk, csc, m_i, l_i, acc, D, PS, PPS, KB, VB,
                                   KCH, ASM, F32DOT, False)
        page = page_next
    if nsteps * NB < ntok:
        m_i, l_i, acc = _page_step(nsteps, page, ntok, kc_ptr, ks_ptr, ko_ptr, vc_ptr, vs_ptr, vo_ptr, s_kcp, s_kch,
                                   s_kmp, s_kmh, s_vcp, s_vch, s_vmp, s_vmh, h, qk, csc, m_i, l_i, acc, D, PS, PPS,
                                   KB, VB, KCH, ASM, F32DOT, True)
    # 2) the 16-bit tiers (sink + recent), then 3) the chunk itself, causally
    n16 = tl.load(len16_ptr + b)
    base16 = b.to(tl.int64) * s16b + h * s16h
    for t0 in tl.range(0, n16, BLOCK_N, num_stages=2):
        m_i, l_i, acc = _dense_step(k16_ptr, v16_ptr, base16, t0, n16, s16t, tq, qd, csc, m_i, l_i, acc, D, BLOCK_N,
                                    F32DOT, False)
    basen = b.to(tl.int64) * sn_b + h * sn_h
    hi = tl.minimum(T, (pid_m + 1) * TOK_M)
    for t0 in tl.range(0, hi, BLOCK_N, num_stages=2):
        m_i, l_i, acc = _dense_step(kn_ptr, vn_ptr, basen, t0, T, sn_t, tq, qd, csc, m_i, l_i, acc, D, BLOCK_N,
                                    F32DOT, True)
    inv = 1.0 / tl.where(l_i > 0, l_i, 1.0)
    optr = out_ptr + b.to(tl.int64) * so_b + tq.to(tl.int64)[:, None] * so_t + hq[:, None] * so_h
    tl.store(optr + tl.arange(0, D)[None, :], (acc * inv[:, None]).to(out_ptr.dtype.element_ty),
             mask=rmask[:, None])


def _pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def extend_attention_triton(
    q: Tensor, k_new: Tensor, v_new: Tensor, k_pages: QuantPages, v_pages: QuantPages, block_table: Tensor,
    qlen: Tensor, k16: Tensor, v16: Tensor, len16: Tensor, sm_scale: float | None = None, *,
    out: Tensor | None = None, host_lengths: tuple | None = None, fold: str | None = None,
) -> Tensor:
    """Chunk attention over a quantized prefix; semantics of :func:`oscarkv.kernels.reference.extend_attention_ref`.
    q ``[B, T, Hq, d]`` (float16/bfloat16/float32; rotated), k_new/v_new ``[B, T, Hkv, d]``, pools of any format
    (head_dim and page size powers of two >= 16), 16-bit tiers ``k16/v16 [B, Hkv, C16, d]``; returns
    ``[B, T, Hq, d]`` in q's dtype (or written into ``out``). Channel-page keys: every page holding a live token
    written whole.

    ``fold``: None picks the cuDNN fold where :func:`~oscarkv.kernels.extend_sdpa.sdpa_supported` (long chunks;
    inside a CUDA-graph capture only with ``host_lengths``), else the fused kernel, which also takes over, with a
    warning, where cuDNN fails; ``"sdpa"`` / ``"fused"`` force one. ``host_lengths``: ``(qlen, len16)`` as host
    integers, if the caller has them (the cuDNN fold otherwise reads them from the device). The fused kernel does
    not synchronise with the host."""
    B, T, hq, d = q.shape
    fmt = k_pages.fmt
    dev = q.device
    check_kv_formats(k_pages, v_pages)
    if d != fmt.head_dim or hq % fmt.num_kv_heads or not _pow2(d) or d < 16:
        raise ValueError(f"q {tuple(q.shape)} vs pages (d={fmt.head_dim}, Hkv={fmt.num_kv_heads}): the kernel "
                         "needs d a power of two >= 16 and Hq a multiple of Hkv")
    if k_new.shape != (B, T, fmt.num_kv_heads, d) or v_new.shape != k_new.shape:
        raise ValueError(f"k_new/v_new must be [{B}, {T}, {fmt.num_kv_heads}, {d}], got {tuple(k_new.shape)}")
    if fmt.page_size < 16 or not _pow2(fmt.page_size):
        raise ValueError(f"the extend kernels need a power-of-two page_size >= 16, got {fmt.page_size}: use "
                         "backend='reference'")
    for name, t in (("block_table", block_table), ("qlen", qlen), ("len16", len16), ("k16", k16),
                    ("k_new", k_new)):
        check_device(name, t, dev)
    check_pool_strides(k_pages, v_pages, dev)
    if k16.stride(3) != 1 or v16.stride() != k16.stride() or k_new.stride(3) != 1 or v_new.stride() != k_new.stride():
        raise ValueError("k16/v16 and k_new/v_new must have unit last stride and equal strides")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q must be float16, bfloat16 or float32, got {q.dtype}")
    if fold not in (None, "sdpa", "fused"):
        raise ValueError(f"fold must be None, 'sdpa' or 'fused', got {fold!r}")
    g = hq // fmt.num_kv_heads
    if g > BLOCK_M:
        raise ValueError(f"at most {BLOCK_M} query heads per KV head, got {g}")
    if q.stride(3) != 1:
        q = q.contiguous()
    if out is None:
        out = torch.empty(B, T, hq, d, dtype=q.dtype, device=dev)
    sm_scale = float(d**-0.5 if sm_scale is None else sm_scale)
    if k_new.dtype != k16.dtype:  # one dtype for the dense dots: the chunk's rows as the 16-bit tiers store them
        k_new, v_new = k_new.to(k16.dtype), v_new.to(k16.dtype)
    if q.dtype == torch.float32:  # the dots take 16-bit queries: prescale to float16
        q, sm_scale = (q * sm_scale).to(torch.float16), 1.0
    if fold == "sdpa" or (fold is None and sdpa_supported(q, d, host_lengths is not None)):
        try:
            return extend_attention_sdpa(q, k_new, v_new, k_pages, v_pages, block_table, qlen, k16, v16, len16,
                                         sm_scale, out, host_lengths=host_lengths)
        except RuntimeError as e:  # cuDNN refused the shape or the device: the default falls back
            if fold == "sdpa":
                raise
            if isinstance(e, torch.OutOfMemoryError):  # this call's memory, not cuDNN failing: not remembered
                warnings.warn("extend: out of memory for the cuDNN fold's workspace; this call runs the fused "
                              "kernel, which needs none", stacklevel=2)
            else:
                mark_cudnn_broken(q, d, e)
    pps = 1 if fmt.channel else 2
    grid = (triton.cdiv(T, BLOCK_M // g), B * fmt.num_kv_heads)
    interp = interpreting()
    _extend_kernel[grid](
        q, q.stride(0), q.stride(1), q.stride(2), k_new, v_new, k_new.stride(0), k_new.stride(1), k_new.stride(2),
        k_pages.codes, k_pages.scale, k_pages.offset, v_pages.codes, v_pages.scale, v_pages.offset,
        *pool_strides(k_pages), *pool_strides(v_pages), block_table, block_table.stride(0), qlen, k16, v16,
        k16.stride(0), k16.stride(1), k16.stride(2), len16, out, out.stride(0), out.stride(1), out.stride(2),
        T, fmt.num_kv_heads, sm_scale,
        G=g, D=d, PS=fmt.page_size, PPS=pps, KB=fmt.bits, VB=v_pages.fmt.bits, KCH=fmt.channel, BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N, ASM=not interp, F32DOT=interp, num_warps=NUM_WARPS, num_stages=2 if pps > 1 else 3,
    )
    return out


__all__ = ["extend_attention_triton"]
