"""From a layer's :class:`~oscarkv.formats.LayerFormat` to the kernels' page geometry, and the bytes it costs.

A store's geometry (KV heads, head dimension, page size, row group, metadata dtype) is shared by every layer;
the format decides each pool's layout and code width. Nothing here describes a format a second time: a
:class:`~oscarkv.kernels.layout.PageFormat` is built from the layer's format plus this geometry.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..formats import FormatError, LayerFormat
from ..kernels.layout import PageFormat
from ..quant import resolve_meta_dtype


@dataclass(frozen=True)
class PageGeometry:
    """The page geometry every quantized layer of a store shares.

    ``group_size``: elements per scale/offset group of a token row (``None``: the whole row); channel pages
    have one scale/offset per channel per page instead. ``meta_dtype``: dtype of scales and offsets."""

    num_kv_heads: int
    head_dim: int
    page_size: int
    group_size: int | None = None
    meta_dtype: str | torch.dtype = "float16"

    def page_formats(self, fmt: LayerFormat) -> tuple[PageFormat, PageFormat]:
        """``(K, V)`` page formats of a layer stored in ``fmt``. Raises :class:`~oscarkv.formats.FormatError`
        where the geometry cannot pack the format (e.g. channel pages of a page size that is not a multiple of
        the codes per byte, or a row group that does not divide the head dimension)."""
        out = []
        for which, f in zip("KV", fmt):
            try:
                out.append(PageFormat(num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                                      page_size=self.page_size, bits=f.bits,
                                      group_size=None if f.channel else self.group_size,
                                      meta_dtype=self.meta_dtype, layout=f.layout))
            except ValueError as e:
                raise FormatError(f"{which} in {f.label} pages of {self.page_size} tokens (head_dim "
                                  f"{self.head_dim}, group {self.group_size}): {e}") from None
        return out[0], out[1]

    def bytes_per_token(self, fmt: LayerFormat | None, dtype16: torch.dtype = torch.bfloat16) -> float:
        """Physical bytes per token of one layer's K and V in the quantized tier (or, for a layer that is not
        quantized, in ``dtype16``)."""
        if fmt is None:
            return 2 * self.num_kv_heads * self.head_dim * torch.empty((), dtype=dtype16).element_size()
        return float(sum(p.bytes_per_token for p in self.page_formats(fmt)))

    @property
    def meta_bits(self) -> int:
        return 8 * torch.empty((), dtype=resolve_meta_dtype(self.meta_dtype)).element_size()


__all__ = ["PageGeometry"]
