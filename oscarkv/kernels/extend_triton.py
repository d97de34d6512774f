"""Triton prefill/extend attention over a quantized prefix: the queries of a new chunk attend causally to the
chunk (16-bit) and fully to the earlier tokens as stored (16-bit tiers + 2-bit pages, unpacked tile by tile in
registers, never materialised). Flash-attention style online softmax; one program = one (sequence, KV head,
block of query rows), the rows being (token, query head of the GQA group) pairs, so one unpacked tile serves
every query head of its KV head. Scale and offset are factored out of the products as in decode.
"""

from __future__ import annotations

import torch
from torch import Tensor

import triton
import triton.language as tl

from ._triton_util import check_device, check_kv_formats, check_pool_strides, interpreting, next_pow2, pool_strides
from .decode_triton import _fields4
from .layout import QuantPages


@triton.jit
def _softmax_step(s, m_i, l_i):
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_use = tl.where(m_new > float("-inf"), m_new, 0.0)  # rows fully masked so far stay at zero weight
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    return m_new, alpha, p, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def _codes_tile(codes, PS: tl.constexpr, D: tl.constexpr, ASM: tl.constexpr):
    """uint8 codes ``[PS, D/4]`` -> exact float16 codes ``[PS, D]`` in interleaved order: column ``4 c + j``
    holds field ``j`` of byte ``c``, i.e. element ``j D/4 + c`` (queries and outputs use the same order)."""
    f0, f1, f2, f3 = _fields4(codes, ASM)
    return tl.reshape(tl.join(tl.join(f0, f2), tl.join(f1, f3)), (PS, D))  # [.., i, w] = f_{2i+w}


@triton.jit
def _extend_kernel(
    q_ptr, sq_b, sq_t, sq_h, kn_ptr, vn_ptr, sn_b, sn_t, sn_h,
    kc_ptr, ks_ptr, ko_ptr, vc_ptr, vs_ptr, vo_ptr, s_cp, s_ch, s_kmp, s_kmh, s_mp, s_mh, bt_ptr, s_bt, qlen_ptr,
    k16_ptr, v16_ptr, s16b, s16h, s16t, len16_ptr, out_ptr, so_b, so_t, so_h,
    T, HKV, sm_scale,
    G: tl.constexpr, D: tl.constexpr, PS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ASM: tl.constexpr, F32DOT: tl.constexpr, KCH: tl.constexpr,
):
    TOK_M: tl.constexpr = BLOCK_M // G
    DQ: tl.constexpr = D // 4
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // HKV
    h = bh % HKV
    r = tl.arange(0, BLOCK_M)
    tq = pid_m * TOK_M + r // G
    hq = h * G + r % G
    rmask = (tq < T) & (r < TOK_M * G)
    col = tl.arange(0, D)
    perm = (col % 4) * DQ + col // 4  # interleaved column -> element of the head dimension
    if F32DOT:
        DT: tl.constexpr = tl.float32
    else:
        DT: tl.constexpr = tl.float16
    qrow = q_ptr + b.to(tl.int64) * sq_b + tq.to(tl.int64)[:, None] * sq_t + hq[:, None] * sq_h
    q = tl.load(qrow + perm[None, :], mask=rmask[:, None], other=0.0).to(tl.float32) * (sm_scale * 1.4426950408889634)
    q2 = q.to(tl.float16)
    qsum = tl.sum(q2.to(tl.float32), axis=1)
    q2 = q2.to(DT)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    osum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    # 1) the 2-bit pages, one page per step; scale/offset factored out of both products, P * s_v / v_ref in
    # float16 (v_ref: the first page's largest V scale, at least 2^-6, so 16-bit P / v_ref stays in range)
    n = tl.arange(0, PS)
    c = tl.arange(0, DQ)
    ntok = tl.load(qlen_ptr + b)
    bt_row = bt_ptr + b.to(tl.int64) * s_bt
    vref = 1.0
    if ntok > 0:
        page0 = tl.load(bt_row).to(tl.int64)
        vs0 = tl.load(vs_ptr + page0 * s_mp + h * s_mh + n, mask=n < ntok, other=0.0).to(tl.float32)
        vref = tl.minimum(tl.maximum(tl.max(vs0, axis=0), 0.015625), 65504.0)
    ivref = 1.0 / vref
    for p in range(0, tl.cdiv(ntok, PS)):
        page = tl.load(bt_row + p).to(tl.int64)
        crow = page * s_cp + h * s_ch + n * DQ
        row = page * s_mp + h * s_mh + n
        tmask = p * PS + n < ntok
        kt = _codes_tile(tl.load(kc_ptr + crow[:, None] + c[None, :]), PS, D, ASM)
        if KCH:
            # channel page (written whole, metadata valid): dequantize the tile, normalised by its largest
            # |k^| so that the 16-bit operand cannot overflow, and undo the normalisation on the logits
            kmeta = page * s_kmp + h * s_kmh + perm
            ksv = tl.load(ks_ptr + kmeta).to(tl.float32)
            kov = tl.load(ko_ptr + kmeta).to(tl.float32)
            khat = kov[None, :] + kt.to(tl.float32) * ksv[None, :]
            kmax = tl.max(tl.maximum(tl.abs(kov), tl.abs(kov + 3.0 * ksv)), axis=0)
            kmax = tl.where(kmax > 0.0, kmax, 1.0)
            s = tl.dot(q2, tl.trans((khat * (1.0 / kmax)).to(tl.float16).to(DT))) * kmax
        else:
            s = tl.dot(q2, tl.trans(kt.to(DT)))
            ks = tl.load(ks_ptr + row, mask=tmask, other=0.0).to(tl.float32)
            ko = tl.load(ko_ptr + row, mask=tmask, other=0.0).to(tl.float32)
            s = s * ks[None, :] + qsum[:, None] * ko[None, :]
        s = tl.where(tmask[None, :], s, float("-inf"))
        m_i, alpha, pr, l_i = _softmax_step(s, m_i, l_i)
        vs = tl.load(vs_ptr + row, mask=tmask, other=0.0).to(tl.float32)
        vo = tl.load(vo_ptr + row, mask=tmask, other=0.0).to(tl.float32)
        osum = osum * alpha + tl.sum(pr * vo[None, :], axis=1)
        pv = (pr * (vs * ivref)[None, :]).to(tl.float16).to(DT)
        vt = _codes_tile(tl.load(vc_ptr + crow[:, None] + c[None, :]), PS, D, ASM).to(DT)
        acc = tl.dot(pv, vt, acc * alpha[:, None])
    # 2) the 16-bit tiers (sink + recent), then 3) the chunk itself, causally
    kv = tl.arange(0, BLOCK_N)
    n16 = tl.load(len16_ptr + b)
    base16 = b.to(tl.int64) * s16b + h * s16h
    for t0 in range(0, n16, BLOCK_N):
        t = t0 + kv
        tm = t < n16
        off = base16 + t.to(tl.int64)[:, None] * s16t + perm[None, :]
        k = tl.load(k16_ptr + off, mask=tm[:, None], other=0.0)
        s = tl.dot(q.to(k.dtype).to(DT), tl.trans(k.to(DT)))
        s = tl.where(tm[None, :], s, float("-inf"))
        m_i, alpha, pr, l_i = _softmax_step(s, m_i, l_i)
        osum = osum * alpha
        v = tl.load(v16_ptr + off, mask=tm[:, None], other=0.0)
        acc = tl.dot((pr * ivref).to(v.dtype).to(DT), v.to(DT), acc * alpha[:, None])
    basen = b.to(tl.int64) * sn_b + h * sn_h
    hi = tl.minimum(T, (pid_m + 1) * TOK_M)
    for t0 in range(0, hi, BLOCK_N):
        t = t0 + kv
        tm = t < T
        off = basen + t.to(tl.int64)[:, None] * sn_t + perm[None, :]
        k = tl.load(kn_ptr + off, mask=tm[:, None], other=0.0)
        s = tl.dot(q.to(k.dtype).to(DT), tl.trans(k.to(DT)))
        s = tl.where((t[None, :] <= tq[:, None]) & tm[None, :], s, float("-inf"))
        m_i, alpha, pr, l_i = _softmax_step(s, m_i, l_i)
        osum = osum * alpha
        v = tl.load(vn_ptr + off, mask=tm[:, None], other=0.0)
        acc = tl.dot((pr * ivref).to(v.dtype).to(DT), v.to(DT), acc * alpha[:, None])
    inv = 1.0 / tl.where(l_i > 0, l_i, 1.0)[:, None]
    res = acc * (vref * inv) + osum[:, None] * inv
    optr = out_ptr + b.to(tl.int64) * so_b + tq.to(tl.int64)[:, None] * so_t + hq[:, None] * so_h + perm[None, :]
    tl.store(optr, res.to(out_ptr.dtype.element_ty), mask=rmask[:, None])


def extend_attention_triton(
    q: Tensor, k_new: Tensor, v_new: Tensor, k_pages: QuantPages, v_pages: QuantPages, block_table: Tensor,
    qlen: Tensor, k16: Tensor, v16: Tensor, len16: Tensor, sm_scale: float | None = None, *,
    out: Tensor | None = None, block_m: int = 128, block_n: int = 64, num_warps: int = 8, num_stages: int = 2,
) -> Tensor:
    """Chunk attention over a quantized prefix; semantics of
    :func:`oscarkv.kernels.reference.extend_attention_ref`. q ``[B, T, Hq, d]``, k_new/v_new
    ``[B, T, Hkv, d]``; returns ``[B, T, Hq, d]`` (dtype of q unless ``out`` is given). Keys may be in
    channel pages (each page holding a live token written whole): the tile is dequantized with the page's
    per-channel scale/offset before the product."""
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
    g = hq // fmt.num_kv_heads
    if g > block_m:
        raise ValueError(f"GQA group {g} larger than block_m {block_m}")
    if q.stride(3) != 1:
        q = q.contiguous()
    if out is None:
        out = torch.empty(B, T, hq, d, dtype=q.dtype, device=dev)
    tok_m = block_m // g
    grid = (triton.cdiv(T, tok_m), B * fmt.num_kv_heads)
    _extend_kernel[grid](
        q, q.stride(0), q.stride(1), q.stride(2), k_new, v_new, k_new.stride(0), k_new.stride(1),
        k_new.stride(2), k_pages.codes, k_pages.scale, k_pages.offset, v_pages.codes, v_pages.scale,
        v_pages.offset, *pool_strides(k_pages), v_pages.scale.stride(0), v_pages.scale.stride(1), block_table,
        block_table.stride(0), qlen, k16, v16, k16.stride(0), k16.stride(1), k16.stride(2), len16, out,
        out.stride(0), out.stride(1), out.stride(2), T, fmt.num_kv_heads,
        float(d**-0.5 if sm_scale is None else sm_scale),
        G=g, D=d, PS=fmt.page_size, BLOCK_M=block_m, BLOCK_N=block_n, ASM=not interpreting(),
        F32DOT=interpreting(), KCH=fmt.channel, num_warps=num_warps, num_stages=num_stages,
    )
    return out


__all__ = ["extend_attention_triton"]
