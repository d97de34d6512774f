"""Quantized-tier storage for one layer and one of K or V, shared by the sequences of a batch.

* :class:`TokenPool`: the paged layout of :mod:`oscarkv.kernels.layout` (``QuantPages`` + block table + qlen),
  one quantized row per token and KV head (OSCAR and every per-token baseline).
* :class:`ChannelPool`: KIVI keys, one quantized row per channel over a group of 32 tokens.

Both append rows in order (``write``), read any token range back dequantized (``read``), and count their bytes:
``used_bytes`` for tokens held, ``allocated_bytes`` for every tensor they own (unused capacity included).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..kernels.layout import PageFormat, QuantPages, slot_mapping
from ..kernels.reference import dequantize_pages_ref, quantize_write_ref
from ..quant import QuantizedRows, dequantize, dequantize_per_channel, quantize, quantize_per_channel


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


class ChannelPool:
    """KIVI keys: each group of ``group`` consecutive tokens is quantized per channel (one scale and offset per
    channel and group, quantizer of :func:`oscarkv.quant.quantize_per_channel`). Rows are appended whole groups
    at a time. Storage: codes uint8 ``[G_alloc, Hkv, d, group * bits / 8]``, scale/offset ``[G_alloc, Hkv, d, 1]``.
    """

    def __init__(self, num_kv_heads: int, head_dim: int, group: int, bits: int, meta_dtype: torch.dtype,
                 batch_size: int, device: torch.device | str):
        if group % (8 // bits):
            raise ValueError(f"group {group} must be a multiple of {8 // bits} for {bits}-bit packing")
        self.H, self.d, self.group, self.bits, self.meta_dtype = num_kv_heads, head_dim, group, bits, meta_dtype
        self.codes = torch.zeros(0, num_kv_heads, head_dim, group * bits // 8, dtype=torch.uint8, device=device)
        self.scale = torch.zeros(0, num_kv_heads, head_dim, 1, dtype=meta_dtype, device=device)
        self.offset = torch.zeros_like(self.scale)
        self._owned: list[list[int]] = [[] for _ in range(batch_size)]
        self._used = 0

    def _quantize(self, rows: Tensor) -> QuantizedRows:
        return quantize_per_channel(rows.float(), bits=self.bits, group_size=self.group, meta_dtype=self.meta_dtype)

    def write(self, b: int, rows: Tensor) -> None:
        """Quantize and append ``rows`` ``[Hkv, D, d]``, ``D`` a multiple of the group, to sequence ``b``."""
        D = rows.shape[1]
        if D % self.group:
            raise ValueError(f"KIVI keys are written in whole groups of {self.group} tokens, got {D}")
        for g0 in range(0, D, self.group):
            if self._used == self.codes.shape[0]:
                self._grow(max(4, 2 * self._used))
            q = self._quantize(rows[:, g0: g0 + self.group])
            i = self._used
            self.codes[i], self.scale[i], self.offset[i] = q.packed, q.scale, q.offset
            self._owned[b].append(i)
            self._used += 1

    def _grow(self, n: int) -> None:
        def more(t: Tensor) -> Tensor:
            return torch.cat([t, torch.zeros(n - t.shape[0], *t.shape[1:], dtype=t.dtype, device=t.device)])

        self.codes, self.scale, self.offset = more(self.codes), more(self.scale), more(self.offset)

    def read(self, b: int, start: int, end: int) -> Tensor:
        """Dequantized keys ``[Hkv, end - start, d]`` (float32) of tokens ``[start, end)`` of sequence ``b``."""
        n = len(self._owned[b]) * self.group
        if not 0 <= start <= end <= n:
            raise IndexError(f"token range [{start}, {end}) outside the {n} quantized tokens of seq {b}")
        if start == end:
            return torch.zeros(self.H, 0, self.d, device=self.codes.device)
        g0, g1 = start // self.group, math.ceil(end / self.group)
        ids = torch.tensor(self._owned[b][g0:g1], dtype=torch.long, device=self.codes.device)
        q = QuantizedRows(packed=self.codes[ids], scale=self.scale[ids], offset=self.offset[ids], bits=self.bits,
                          group_size=self.group, dim=self.group)
        x = dequantize_per_channel(q)  # [g, Hkv, group, d]
        x = x.permute(1, 0, 2, 3).reshape(self.H, -1, self.d)
        off = start - g0 * self.group
        return x[:, off: off + end - start]

    def roundtrip(self, rows: Tensor) -> Tensor:
        """What writing ``rows`` ``[Hkv, D, d]`` (whole groups) then reading them back gives."""
        D = rows.shape[1]
        if D % self.group:
            raise ValueError(f"KIVI keys are written in whole groups of {self.group} tokens, got {D}")
        out = [dequantize_per_channel(self._quantize(rows[:, g0: g0 + self.group])) for g0 in range(0, D, self.group)]
        return torch.cat(out, 1) if out else rows.float()[:, :0]

    def tokens(self, b: int | None = None) -> int:
        owned = self._owned if b is None else [self._owned[b]]
        return sum(len(o) for o in owned) * self.group

    def used_bytes(self) -> int:
        per_group = self.H * self.d * (self.group * self.bits // 8 + 2 * self.scale.element_size())
        return self._used * per_group

    def allocated_bytes(self) -> int:
        return _tensor_bytes(self.codes, self.scale, self.offset)


__all__ = ["TokenPool", "ChannelPool"]
