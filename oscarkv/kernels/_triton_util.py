"""Helpers shared by the kernel launchers (argument checks, pool strides, interpreter detection); no Triton
import, so the CUDA launcher uses them too."""

from __future__ import annotations

import os

import torch
from torch import Tensor


def interpreting() -> bool:
    """True when Triton runs in its CPU interpreter (``TRITON_INTERPRET=1``, tests only)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_device(what: str, t: Tensor, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{what} is on {t.device}, expected {device} (all kernel inputs must share one device)")
    if t.device.type != "cuda" and not interpreting():
        raise ValueError(f"{what} is on {t.device}: Triton kernels need CUDA tensors (use the reference on CPU)")


def check_pool_strides(k_pages, v_pages, device: torch.device) -> None:
    """Pools may be strided views (e.g. carved from one vLLM block tensor) as long as every (page, head) block is
    ``page_size`` contiguous rows (codes, token-page metadata) or one contiguous ``d``-vector (channel-page
    metadata), and scale and offset of a pool share their strides. K and V pass their own strides."""
    for side, pages in (("K", k_pages), ("V", v_pages)):
        fmt = pages.fmt
        mrows, mcols = fmt.meta_shape
        for name, t, shape in (("codes", pages.codes, (fmt.page_size, fmt.row_bytes)),
                               ("scale", pages.scale, (mrows, mcols)), ("offset", pages.offset, (mrows, mcols))):
            check_device(f"{side} {name}", t, device)
            if t.ndim != 4 or tuple(t.shape[2:]) != shape or t.shape[1] != fmt.num_kv_heads:
                raise ValueError(f"{side} page pool {name} must be [pages, {fmt.num_kv_heads}, {shape[0]}, "
                                 f"{shape[1]}] ({fmt.layout} layout), got {tuple(t.shape)}")
            if t.stride(3) != 1 or (shape[0] > 1 and t.stride(2) != shape[1]):
                raise ValueError(f"{side} page pool {name} must have rows of {shape[1]} contiguous elements, "
                                 f"got strides {t.stride()}")
        if pages.scale.stride() != pages.offset.stride():
            raise ValueError(f"{side} scale and offset must have equal strides")
    if k_pages.codes.shape[0] != v_pages.codes.shape[0]:
        raise ValueError(f"K and V pools must hold the same number of pages (slots address both), got "
                         f"{k_pages.codes.shape[0]} and {v_pages.codes.shape[0]}")


def check_kv_formats(k_pages, v_pages, attention: bool = True) -> None:
    """K and V pools of one layer share heads, head_dim and page size (one slot addresses both); each has its own
    bits and metadata dtype, keys their own layout; values are token pages. ``attention``: also one
    scale/offset group per row (the attention kernels' operands; the writers take any group size)."""
    fk, fv = k_pages.fmt, v_pages.fmt
    if fv.channel:
        raise ValueError("values are stored in token pages only; channel pages are a key format")
    if (fk.num_kv_heads, fk.head_dim, fk.page_size) != (fv.num_kv_heads, fv.head_dim, fv.page_size):
        raise ValueError(f"K and V pools must share num_kv_heads, head_dim and page_size: {fk} vs {fv}")
    if attention and (fk.groups != 1 or fv.groups != 1):
        raise ValueError(f"the kernels take one scale/offset group per row (group_size None or head_dim), got "
                         f"{fk.group_size} and {fv.group_size}: use backend='reference'")


def check_decode(q, k_pages, v_pages, block_table, qlen, k16, v16, len16, plan) -> None:
    """Argument checks shared by the decode kernels (shapes, dtypes, devices, the plan; see
    :func:`oscarkv.kernels.decode_triton.decode_attention_triton`)."""
    fmt = k_pages.fmt
    B, hq, d = q.shape
    dev = q.device
    check_kv_formats(k_pages, v_pages)
    if d != fmt.head_dim or hq % fmt.num_kv_heads:
        raise ValueError(f"q [B, Hq, d] = {tuple(q.shape)} does not fit the pages (d={fmt.head_dim}, "
                         f"Hkv={fmt.num_kv_heads})")
    if d < 16 or d & (d - 1) or fmt.page_size % 16:
        raise ValueError(f"the decode kernels need head_dim a power of two >= 16 and page_size a multiple of 16, "
                         f"got {d} and {fmt.page_size}: use backend='reference'")
    for name, t in (("block_table", block_table), ("qlen", qlen), ("len16", len16)):
        check_device(name, t, dev)
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {t.dtype}")
    if qlen.shape != (B,) or len16.shape != (B,) or block_table.shape[0] < B:
        raise ValueError("qlen and len16 must be [B]; block_table [>= B, max_pages]")
    if k16.shape != v16.shape or k16.ndim != 4 or k16.shape[0] < B or k16.shape[1] != fmt.num_kv_heads \
            or k16.shape[3] != d or k16.stride(3) != 1 or v16.stride() != k16.stride():
        raise ValueError(f"k16/v16 must be [B, Hkv, C16, d] with unit last stride, got {tuple(k16.shape)}")
    check_pool_strides(k_pages, v_pages, dev)
    if plan.batch != B or plan.num_q_heads != hq or plan.head_dim != d or plan.page_size != fmt.page_size:
        raise ValueError(f"plan (batch {plan.batch}, Hq {plan.num_q_heads}, d {plan.head_dim}, page "
                         f"{plan.page_size}) does not match this call (B {B}, Hq {hq}, d {d}, page "
                         f"{fmt.page_size}): call plan.update(batch)")
    if plan.max_pages < block_table.shape[1] or plan.max_len16 < k16.shape[2]:
        raise ValueError("the plan was built for fewer pages or a smaller 16-bit tier than this call")


def pool_strides(pages) -> tuple[int, int, int, int]:
    """(codes page stride, codes head stride, meta page stride, meta head stride) in elements."""
    return pages.codes.stride(0), pages.codes.stride(1), pages.scale.stride(0), pages.scale.stride(1)


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())
