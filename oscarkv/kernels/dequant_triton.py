"""Triton kernel dequantizing the quantized pages of sequences into a dense 16-bit workspace: the prefix that the
cuDNN fold of the extend attention (:mod:`oscarkv.kernels.extend_sdpa`) attends to. Every format (keys in token
or channel pages of 2 or 4 bits, values in token pages of 2 or 4 bits); the values are the fused extend
kernel's, float16 ``o + c s`` rounded once (:func:`~oscarkv.kernels.extend_tiles._dequant_tile`), stored in the
workspace's dtype."""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from ._triton_util import interpreting, pool_strides
from .extend_tiles import _dequant_tile
from .layout import QuantPages


@triton.jit
def _dequant_ws_kernel(
    kc_ptr, ks_ptr, ko_ptr, vc_ptr, vs_ptr, vo_ptr, s_kcp, s_kch, s_kmp, s_kmh, s_vcp, s_vch, s_vmp, s_vmh,
    bt_ptr, s_bt, qlen_ptr, kw_ptr, vw_ptr, sw_b, sw_h, sw_t, HKV, p0,
    D: tl.constexpr, PS: tl.constexpr, KB: tl.constexpr, VB: tl.constexpr, KCH: tl.constexpr, ASM: tl.constexpr,
):
    """One (page slot, sequence, KV head) per program: page slot ``p0 + p`` of the sequence's K and V into the
    workspace rows ``[p PS, (p+1) PS)``; rows past the sequence end (and slots past its last page) are zeros."""
    p = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // HKV
    h = bh % HKV
    n = tl.arange(0, PS)
    dcol = tl.arange(0, D)
    ntok = tl.load(qlen_ptr + b) - p0 * PS
    live = p * PS + n < ntok
    woff = b.to(tl.int64) * sw_b + h * sw_h + (p * PS + n).to(tl.int64)[:, None] * sw_t + dcol[None, :]
    if p * PS < ntok:
        page = tl.load(bt_ptr + b.to(tl.int64) * s_bt + p0 + p).to(tl.int64)
        kh = _dequant_tile(kc_ptr, ks_ptr, ko_ptr, page, h, s_kcp, s_kch, s_kmp, s_kmh, n, live, KB, KCH, D, PS, ASM)
        vh = _dequant_tile(vc_ptr, vs_ptr, vo_ptr, page, h, s_vcp, s_vch, s_vmp, s_vmh, n, live, VB, False, D, PS, ASM)
        tl.store(kw_ptr + woff, kh.to(kw_ptr.dtype.element_ty))
        tl.store(vw_ptr + woff, vh.to(vw_ptr.dtype.element_ty))
    else:
        zero = tl.zeros([PS, D], kw_ptr.dtype.element_ty)
        tl.store(kw_ptr + woff, zero)
        tl.store(vw_ptr + woff, zero)


def dequant_pages_into(k_pages: QuantPages, v_pages: QuantPages, block_table: Tensor, qlen: Tensor, kw: Tensor,
                       vw: Tensor, npages: int, p0: int = 0) -> None:
    """Dequantize page slots ``[p0, p0 + npages)`` of every sequence of ``block_table`` (``[B, max_pages]``
    int32; ``qlen [B]`` int32 tokens): slot ``p0 + p`` into rows ``[p PS, (p+1) PS)`` of ``kw``/``vw``
    ``[B, Hkv, rows, d]`` (16-bit, equal strides, unit last stride); rows past a sequence's ``qlen`` are zeros.
    One launch, no host synchronisation."""
    fmt = k_pages.fmt
    _dequant_ws_kernel[(npages, block_table.shape[0] * fmt.num_kv_heads)](
        k_pages.codes, k_pages.scale, k_pages.offset, v_pages.codes, v_pages.scale, v_pages.offset,
        *pool_strides(k_pages), *pool_strides(v_pages), block_table, block_table.stride(0), qlen, kw, vw,
        kw.stride(0), kw.stride(1), kw.stride(2), fmt.num_kv_heads, p0,
        D=fmt.head_dim, PS=fmt.page_size, KB=fmt.bits, VB=v_pages.fmt.bits, KCH=fmt.channel, ASM=not interpreting(),
        num_warps=4,
    )


__all__ = ["dequant_pages_into"]
