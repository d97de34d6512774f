"""Small helpers shared by the kernel launchers (device checks, pool strides, interpreter detection)."""

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
    metadata), K and V codes share their strides, and so does the metadata of K and V when their layouts agree."""
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
    if v_pages.codes.stride() != k_pages.codes.stride():
        raise ValueError(f"K and V codes must have equal strides, got {k_pages.codes.stride()} and "
                         f"{v_pages.codes.stride()}")
    if k_pages.fmt.layout == v_pages.fmt.layout and v_pages.scale.stride() != k_pages.scale.stride():
        raise ValueError(f"K and V metadata must have equal strides, got {k_pages.scale.stride()} and "
                         f"{v_pages.scale.stride()}")


def check_kv_formats(k_pages, v_pages) -> None:
    """K and V pools must agree on everything but the key layout; values are always token pages."""
    if v_pages.fmt.channel:
        raise ValueError("values are stored in token pages only; channel pages are a key format")
    if not k_pages.fmt.same_geometry(v_pages.fmt):
        raise ValueError(f"K and V page formats differ beyond the key layout: {k_pages.fmt} vs {v_pages.fmt}")


def pool_strides(pages) -> tuple[int, int, int, int]:
    """(codes page stride, codes head stride, meta page stride, meta head stride) in elements."""
    return pages.codes.stride(0), pages.codes.stride(1), pages.scale.stride(0), pages.scale.stride(1)


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())
