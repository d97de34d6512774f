"""The paged KV layout shared by the kernels, the transformers cache and the engine.

One layer's cache for one of K or V::

    2-bit tier (paged pool, shared by all sequences)
      codes  uint8  [num_pages, Hkv, page_size, d * bits / 8]   quartered packing of method section 3
      scale  meta   [num_pages, Hkv, page_size, d / G]           meta = float16 by default
      offset meta   [num_pages, Hkv, page_size, d / G]
    keys in "channel pages" (PageFormat(layout="channel"), KIVI-style)
      codes  uint8  [num_pages, Hkv, page_size, d * bits / 8]   same token-major quartered packing as above
      scale  meta   [num_pages, Hkv, 1, d]                      one scale/offset per (page, head, channel),
      offset meta   [num_pages, Hkv, 1, d]                      computed over the page's tokens; pages written whole
    addressed by
      block_table int32 [B, max_pages]   logical page j of sequence b -> physical page id
      qlen        int32 [B]              tokens held in the 2-bit tier (pages filled in order, last may be partial)

    16-bit tiers (per sequence, dense): sink (first S tokens) then the recent window (last W..W+page tokens)
      buf16  fp16/bf16 [B, Hkv, C16, d]  slots [0, len16[b]) are valid; order within them is irrelevant to
      len16  int32 [B]                   attention (RoPE is already applied), so sink and recent share one buffer

One (page, head) block is ``page_size * d * bits / 8`` contiguous bytes (2 KiB at page 64, d 128, 2-bit): a decode
program streams it with 16-byte loads. Rows are already centered and rotated; queries are rotated by ``R_K``
before attention and outputs stay in the rotated V basis.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from ..quant import resolve_meta_dtype

LAYOUTS = ("token", "channel")


@dataclass(frozen=True)
class PageFormat:
    """Geometry of a 2-bit (or 4-bit) page pool.

    ``layout``: "token" (the method's format: a scale/offset per row and group) or "channel" (keys only: a
    scale/offset per (page, head, channel) over the page's ``page_size`` tokens, numerically
    ``oscarkv.quant.quantize_per_channel(x_page, group_size=page_size)``; no groups along d, no clipping; pages
    are written whole). Codes use the same token-major packing in both layouts.
    """

    num_kv_heads: int
    head_dim: int
    page_size: int = 64
    bits: int = 2
    group_size: int | None = None
    meta_dtype: torch.dtype = torch.float16
    layout: str = "token"

    def __post_init__(self) -> None:
        if self.bits not in (2, 4):
            raise ValueError(f"bits must be 2 or 4, got {self.bits}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.layout == "channel" and self.group_size not in (None, self.head_dim):
            raise ValueError(f"channel pages have one scale/offset per channel per page: group_size must be None, "
                             f"got {self.group_size}")
        if self.layout == "channel" and self.page_size % (8 // self.bits):
            raise ValueError(f"channel pages need page_size a multiple of {8 // self.bits}, got {self.page_size}")
        if self.head_dim % (8 // self.bits):
            raise ValueError(f"head_dim {self.head_dim} must be a multiple of {8 // self.bits}")
        if self.head_dim % self.group:
            raise ValueError(f"group_size {self.group} must divide head_dim {self.head_dim}")
        object.__setattr__(self, "meta_dtype", resolve_meta_dtype(self.meta_dtype))

    @property
    def group(self) -> int:
        return self.head_dim if self.group_size is None else self.group_size

    @property
    def row_bytes(self) -> int:
        return self.head_dim * self.bits // 8

    @property
    def groups(self) -> int:
        return self.head_dim // self.group

    @property
    def channel(self) -> bool:
        return self.layout == "channel"

    @property
    def meta_shape(self) -> tuple[int, int]:
        """Per (page, head) shape of scale and offset: ``(page_size, d / G)`` (token) or ``(1, d)`` (channel)."""
        return (1, self.head_dim) if self.channel else (self.page_size, self.groups)

    @property
    def bytes_per_token(self) -> int | float:
        """Physical bytes per token per layer for one of K or V (codes + scale + offset, all heads). An int for
        token pages; for channel pages the per-page metadata is amortized over ``page_size`` tokens (a float
        when that does not divide evenly)."""
        meta = torch.empty((), dtype=self.meta_dtype).element_size()
        if not self.channel:
            return self.num_kv_heads * (self.row_bytes + 2 * self.groups * meta)
        num = self.num_kv_heads * (self.row_bytes * self.page_size + 2 * self.head_dim * meta)
        return num // self.page_size if num % self.page_size == 0 else num / self.page_size

    def same_geometry(self, other: PageFormat) -> bool:
        """Equal except for the key layout (K in channel pages and V in token pages share slots and codes)."""
        return dataclasses.replace(self, layout="token") == dataclasses.replace(other, layout="token")


@dataclass
class QuantPages:
    """A pool of quantized pages (one layer, K or V). See the module docstring for shapes."""

    codes: Tensor
    scale: Tensor
    offset: Tensor
    fmt: PageFormat

    @classmethod
    def allocate(cls, fmt: PageFormat, num_pages: int, device: torch.device | str = "cpu") -> QuantPages:
        shape = (num_pages, fmt.num_kv_heads, fmt.page_size)
        meta = (num_pages, fmt.num_kv_heads, *fmt.meta_shape)
        return cls(
            codes=torch.zeros(*shape, fmt.row_bytes, dtype=torch.uint8, device=device),
            scale=torch.zeros(*meta, dtype=fmt.meta_dtype, device=device),
            offset=torch.zeros(*meta, dtype=fmt.meta_dtype, device=device),
            fmt=fmt,
        )

    @property
    def num_pages(self) -> int:
        return self.codes.shape[0]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.offset))

    def grow(self, num_pages: int) -> None:
        """Enlarge the pool in place to ``num_pages`` pages (existing pages keep their ids)."""
        extra = num_pages - self.num_pages
        if extra <= 0:
            return
        more = QuantPages.allocate(self.fmt, extra, self.codes.device)
        self.codes = torch.cat([self.codes, more.codes])
        self.scale = torch.cat([self.scale, more.scale])
        self.offset = torch.cat([self.offset, more.offset])


def slot_mapping(block_table: Tensor, positions: Tensor, seq_ids: Tensor, page_size: int) -> Tensor:
    """Physical slots (``page * page_size + row``, int64) of 2-bit-tier token ``positions`` of ``seq_ids``."""
    pages = block_table[seq_ids.long(), (positions // page_size).long()].long()
    return pages * page_size + (positions % page_size).long()


class KVDest(NamedTuple):
    """Where a decode step's new 16-bit K/V rows go in a pool (the fused QK preparation stores them there):
    element ``i`` of head ``h`` of token ``t`` of side ``which`` (0 = K, 1 = V) is ``dst``'s element at offset
    ``which * s_which + off[t] + h * s_head + i`` (``off`` int64 ``[N]``, computed once per step)."""

    dst: Tensor
    off: Tensor
    s_which: int
    s_head: int


__all__ = ["LAYOUTS", "KVDest", "PageFormat", "QuantPages", "slot_mapping"]
