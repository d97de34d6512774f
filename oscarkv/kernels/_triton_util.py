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
    ``page_size`` contiguous rows and K and V share their strides."""
    fmt = k_pages.fmt
    for name, t, row in (("codes", k_pages.codes, fmt.row_bytes), ("scale", k_pages.scale, fmt.groups),
                         ("offset", k_pages.offset, fmt.groups)):
        vt = getattr(v_pages, name)
        check_device(f"K {name}", t, device)
        check_device(f"V {name}", vt, device)
        if t.stride(3) != 1 or t.stride(2) != row or vt.stride() != t.stride():
            raise ValueError(f"page pool {name} must have rows of {row} contiguous elements and equal K/V "
                             f"strides, got K {t.stride()} V {vt.stride()}")
    if k_pages.scale.stride() != k_pages.offset.stride():
        raise ValueError("scale and offset must have equal strides")


def pool_strides(pages) -> tuple[int, int, int, int]:
    """(codes page stride, codes head stride, meta page stride, meta head stride) in elements."""
    return pages.codes.stride(0), pages.codes.stride(1), pages.scale.stride(0), pages.scale.stride(1)


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())
