"""Quantized-tier storage for one layer and one of K or V, shared by the sequences of a batch.

* :class:`TokenPool`: the paged layout of :mod:`oscarkv.kernels.layout` (``QuantPages`` + block table + qlen),
  one quantized row per token and KV head (OSCAR and every per-token baseline).

Both append rows in order (``write``), read any token range back dequantized (``read``), and count their bytes:
``used_bytes`` for tokens held, ``allocated_bytes`` for every tensor they own (unused capacity included).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..kernels.layout import PageFormat, QuantPages, slot_mapping
from ..kernels.reference import dequantize_pages_ref, quantize_write_ref
from ..quant import dequantize, dequantize_per_channel, quantize, quantize_per_channel


def _tensor_bytes(*ts: Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


class TokenPool:
    """Per-token quantized rows in pages of ``fmt.page_size`` tokens, addressed by a block table; or, with
    ``fmt.layout == "channel"`` (keys of oscar-auto), the same pages holding one scale and offset per channel per
    page (``quantize_per_channel`` on the page's rows; written in whole pages, never clipped).

    ``block_table`` int32 ``[B, max_pages]`` and ``qlen`` int32 ``[B]`` follow the kernels' layout, so the decode
    kernels can read this pool directly. Pages come from a free list; the pool grows geometrically.
    """

    def __init__(self, fmt: PageFormat, clip: float, batch_size: int, device: torch.device | str):
        self.fmt, self.clip = fmt, float(clip)
        self.pages = QuantPages.allocate(fmt, 0, device)
        self.block_table = torch.zeros(batch_size, 1, dtype=torch.int32, device=device)
        self.qlen = torch.zeros(batch_size, dtype=torch.int32, device=device)
        self._n = [0] * batch_size
        self._owned: list[list[int]] = [[] for _ in range(batch_size)]
        self._free: list[int] = []

    # ---------------------------------------------------------------------------------------- writing
    def _reserve(self, b: int, ntok: int) -> None:
        need = math.ceil(ntok / self.fmt.page_size) - len(self._owned[b])
        if need <= 0:
            return
        if len(self._free) < need:
            old = self.pages.num_pages
            new = max(old + need - len(self._free), 2 * old, 4)
            self.pages.grow(new)
            self._free.extend(range(old, new))
        self._owned[b].extend(self._free.pop(0) for _ in range(need))
        width = max(len(p) for p in self._owned)
        if width > self.block_table.shape[1]:
            grown = torch.zeros(self.block_table.shape[0], max(width, 2 * self.block_table.shape[1]),
                                dtype=torch.int32, device=self.block_table.device)
            grown[:, : self.block_table.shape[1]] = self.block_table
            self.block_table = grown
        self.block_table[b, : len(self._owned[b])] = torch.tensor(self._owned[b], dtype=torch.int32)

    def write(self, b: int, rows: Tensor) -> None:
        """Quantize and append ``rows`` ``[Hkv, D, d]`` (already centered and rotated) to sequence ``b``."""
        D = rows.shape[1]
        if D == 0:
            return
        start = self._n[b]
        self._reserve(b, start + D)
        dev = self.block_table.device
        pos = torch.arange(start, start + D, device=dev)
        slots = slot_mapping(self.block_table, pos, torch.full_like(pos, b), self.fmt.page_size)
        quantize_write_ref(self.pages, rows.permute(1, 0, 2), slots, clip_ratio=self.clip)
        self._n[b] = start + D
        self.qlen[b] = start + D

    # ---------------------------------------------------------------------------------------- reading
    def read(self, b: int, start: int, end: int) -> Tensor:
        """Dequantized rows ``[Hkv, end - start, d]`` (float32) of tokens ``[start, end)`` of sequence ``b``."""
        fmt = self.fmt
        if not 0 <= start <= end <= self._n[b]:
            raise IndexError(f"token range [{start}, {end}) outside the {self._n[b]} quantized tokens of seq {b}")
        if start == end:
            return torch.zeros(fmt.num_kv_heads, 0, fmt.head_dim, device=self.qlen.device)
        p0, p1 = start // fmt.page_size, math.ceil(end / fmt.page_size)
        ids = torch.tensor(self._owned[b][p0:p1], dtype=torch.long, device=self.qlen.device)
        x = dequantize_pages_ref(self.pages, ids).permute(1, 0, 2, 3).reshape(fmt.num_kv_heads, -1, fmt.head_dim)
        off = start - p0 * fmt.page_size
        return x[:, off: off + end - start]

    def roundtrip(self, rows: Tensor) -> Tensor:
        """What :meth:`write` then :meth:`read` give for ``rows`` ``[Hkv, D, d]`` (whole pages for the channel
        layout), without storing them."""
        if self.fmt.channel:
            H, D, d = rows.shape
            ps = self.fmt.page_size
            if D % ps:
                raise ValueError(f"channel pages are written whole: {D} rows is not a multiple of {ps}")
            pages = rows.float().reshape(H, D // ps, ps, d).transpose(0, 1)
            q = quantize_per_channel(pages, bits=self.fmt.bits, group_size=ps, meta_dtype=self.fmt.meta_dtype)
            return dequantize_per_channel(q).transpose(0, 1).reshape(H, D, d)
        q = quantize(rows.float(), bits=self.fmt.bits, group_size=self.fmt.group_size, clip_ratio=self.clip,
                     meta_dtype=self.fmt.meta_dtype, check_finite=False)
        return dequantize(q)

    # ------------------------------------------------------------------------------------------ bytes
    def tokens(self, b: int | None = None) -> int:
        return sum(self._n) if b is None else self._n[b]

    def used_bytes(self) -> int:
        return sum(self._n) * self.fmt.bytes_per_token

    def allocated_bytes(self) -> int:
        return self.pages.nbytes() + _tensor_bytes(self.block_table, self.qlen)


__all__ = ["TokenPool"]
