"""The paged OSCAR store: every front-end's K/V (transformers cache, engine, vLLM plugin's tier rule) lives here.

For ``L`` layers and ``num_slots`` sequences (one per slot)::

    quantized tier   per layer, K and V: QuantPages in the layer's LayerFormat (kernels/layout.py), page ids shared
                     by every layer, addressed by block_table int32 [num_slots + 1, max_pages] and the slot's
                     quantized-token count ``qlens[slot]`` (tier position j -> logical page j // page_size)
    16-bit tiers     buf [2, L, num_slots + 1, Hkv, C16 + 1, d] (K then V): the sink in rows [0, S), then the recent
                     window in order; a slot's rows [0, lens - qlens) are valid. Column C16 is scratch for padded
                     CUDA-graph rows; slot ``num_slots`` is a spare row.

Which token sits in which tier is :class:`~oscarkv.cache.tiers.TierPolicy`'s rule, a function of the token count
alone. Rows arrive centered and rotated, are rounded to the 16-bit dtype when stored, and a demoted row is
quantized from that 16-bit value (the only copy the store keeps). Every quantized write and demotion goes
through :mod:`oscarkv.kernels.dispatch` (the kernels on CUDA, the PyTorch reference on CPU).

State changes only in :meth:`PagedStore.commit` (after a chunk's write, every layer) and
:meth:`PagedStore.commit_decode` (after a decode forward): a decode forward writes only its own token's row, so
a failed forward can be run again; a demotion happens only after a forward succeeded.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from ..formats import FormatError, LayerFormat
from ..kernels import dispatch
from ..kernels.layout import PageFormat, QuantPages
from ..kernels.reference import dequantize_pages_ref, quantize_write_ref
from .formats import PageGeometry
from .pages import SlotTable, SlotTableOwner
from .tiers import TierPolicy

_GROWABLE_START = 16  # first 16-bit capacity of a growable store whose policy never demotes


@dataclass
class Bytes:
    """Physical bytes of a store (or a sum of stores). ``used_*`` count held tokens only; ``allocated`` counts
    every tensor owned, unused capacity included. ``used_16bit`` is the sink and recent tiers at their real
    dtype (float32 windows count 4 bytes an element); ``used_unquantized`` is K/V held outside the store (a
    sliding-window layer's cache) at its real dtype. ``tokens`` is summed over sequences and layers."""

    tokens: int = 0
    quantized_tokens: int = 0
    used_16bit: int = 0
    used_quantized: int = 0
    used_unquantized: int = 0
    allocated: int = 0
    bf16_equivalent: int = 0  # the same tokens held in a 16-bit cache (K and V)
    elements: int = 0  # K and V elements held

    @property
    def used(self) -> int:
        return self.used_16bit + self.used_quantized + self.used_unquantized

    @property
    def unused(self) -> int:
        return self.allocated - self.used

    @property
    def bits_per_element(self) -> float:
        """Used bits per stored K/V element, every tier at its physical size."""
        return 8 * self.used / self.elements if self.elements else 0.0

    @property
    def ratio_to_bf16(self) -> float:
        return self.used / self.bf16_equivalent if self.bf16_equivalent else 0.0

    def __add__(self, o: Bytes) -> Bytes:
        return Bytes(*(getattr(self, f.name) + getattr(o, f.name) for f in fields(self)))


def _nbytes(*ts: Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


class PagedStore(SlotTableOwner):
    """K/V of ``len(formats)`` layers for ``num_slots`` sequences (see the module docstring).

    Args:
        formats: each layer's :class:`~oscarkv.formats.LayerFormat`, or ``None`` for a layer kept 16-bit
            (allowed only with a policy that never demotes).
        policy: the tier rule. Channel-page keys need ``policy.unit == geometry.page_size`` (pages written whole).
        geometry: page geometry shared by the layers.
        num_slots, num_pages, max_pages: sequences, pages in each pool (page 0 is scratch), block-table width.
        dtype16: dtype of the 16-bit tiers (float32 is allowed, for exactness tests).
        growable: pools, block table and 16-bit buffer grow on demand (the transformers cache); otherwise the
            store is allocated once and its tensors never move (the engine, CUDA graphs).
    """

    def __init__(self, formats: Sequence[LayerFormat | None], policy: TierPolicy, geometry: PageGeometry, *,
                 num_slots: int, num_pages: int, max_pages: int, dtype16: torch.dtype,
                 device: torch.device | str, growable: bool = False):
        self.formats, self.policy, self.geo = tuple(formats), policy, geometry
        self.L, self.H, self.d = len(self.formats), geometry.num_kv_heads, geometry.head_dim
        self.dtype16, self.device, self.growable = dtype16, torch.device(device), growable
        self.table = SlotTable(num_slots, max_pages, num_pages, device)
        self.qlens = [0] * (num_slots + 1)
        demotes = policy.quantized(2**40) > 0
        self.k_pages: list[QuantPages | None] = []
        self.v_pages: list[QuantPages | None] = []
        for i, f in enumerate(self.formats):
            if f is None:
                if demotes:
                    raise ValueError(f"layer {i} has no quantized format but the tier policy demotes tokens")
                self.k_pages.append(None)
                self.v_pages.append(None)
                continue
            if any(t.channel for t in f) and policy.unit != geometry.page_size:
                raise FormatError(f"layer {i}: channel pages are written whole, so tokens must be demoted a page "
                                  f"({geometry.page_size} tokens) at a time, not {policy.unit}")
            kf, vf = geometry.page_formats(f)
            self.k_pages.append(QuantPages.allocate(kf, num_pages, device))
            self.v_pages.append(QuantPages.allocate(vf, num_pages, device))
        if not growable and not demotes:
            raise ValueError("a fixed-size store needs a tier policy that demotes (its 16-bit tiers are bounded)")
        self.c16 = policy.capacity16 if demotes else _GROWABLE_START
        self.buf = torch.zeros(2, self.L, num_slots + 1, self.H, self.c16 + 1, self.d, dtype=dtype16, device=device)
        # demotions the monitor samples (monitor.sample() is True) are handed to monitor.record(layer, which,
        # rows, dequantized rows, clip ratio), rows float32 [m, Hkv, d]
        self.monitor = None

    # ------------------------------------------------------------------------------------------ sizing
    @staticmethod
    def page_bytes(formats: Sequence[LayerFormat | None], geometry: PageGeometry) -> int:
        """Bytes of one page id across every layer's K and V pools."""
        return round(sum(geometry.bytes_per_token(f) for f in formats if f is not None) * geometry.page_size)

    @staticmethod
    def slot_bytes(num_layers: int, policy: TierPolicy, geometry: PageGeometry, dtype16: torch.dtype) -> int:
        """Bytes of one slot's 16-bit tiers (every layer, K and V, scratch column included)."""
        es = torch.empty((), dtype=dtype16).element_size()
        return 2 * num_layers * geometry.num_kv_heads * (policy.capacity16 + 1) * geometry.head_dim * es

    @classmethod
    def for_budget(cls, formats: Sequence[LayerFormat], policy: TierPolicy, geometry: PageGeometry, *,
                   budget_bytes: int, num_slots: int, max_len: int, dtype16: torch.dtype,
                   device: torch.device | str) -> PagedStore:
        """A fixed store in ``budget_bytes``: the slots' 16-bit tiers first, then as many pages as fit."""
        slots = (num_slots + 1) * cls.slot_bytes(len(formats), policy, geometry, dtype16)
        per_page = cls.page_bytes(formats, geometry)
        num_pages = (budget_bytes - slots) // per_page
        if num_pages < 2:
            need = (slots + 2 * per_page) / 2**30
            raise ValueError(f"a KV budget of {budget_bytes / 2**30:.3f} GiB holds no page for {num_slots} sequences; "
                             f"raise kv_budget_gb to at least {need:.3f} or lower max_num_seqs")
        return cls(formats, policy, geometry, num_slots=num_slots, num_pages=int(num_pages),
                   max_pages=math.ceil(max_len / geometry.page_size), dtype16=dtype16, device=device)

    # ------------------------------------------------------------------------------------- slot state
    @property
    def page_size(self) -> int:
        return self.geo.page_size

    def len16(self, slot: int) -> int:
        return self.lens[slot] - self.qlens[slot]

    def pages_for(self, n: int) -> int:
        """Pages a sequence of ``n`` tokens occupies (its quantized tier)."""
        return math.ceil(self.policy.quantized(n) / self.page_size)

    def reserve(self, slot: int, n: int) -> None:
        """Give slot ``slot`` the pages a sequence of ``n`` tokens needs (a growable store grows)."""
        need = self.pages_for(n) - len(self.table.pages[slot])
        if need <= 0:
            return
        alloc = self.allocator
        if need > alloc.num_free and self.growable:
            self._grow_pages(max(alloc.num_pages + need - alloc.num_free, 2 * alloc.num_pages))
        if len(self.table.pages[slot]) + need > self.table.max_pages and self.growable:
            self.table._grow_table(max(len(self.table.pages[slot]) + need, 2 * self.table.max_pages))
        self.table.add_pages(slot, alloc.allocate(need))

    def _grow_pages(self, num_pages: int) -> None:
        for pools in (self.k_pages, self.v_pages):
            for p in pools:
                if p is not None:
                    p.grow(num_pages)
        self.allocator.grow(num_pages)

    def _ensure16(self, rows: int) -> None:
        if rows <= self.c16:
            return
        if not self.growable:
            raise RuntimeError(f"{rows} 16-bit rows needed, the store holds {self.c16} (tier policy violated)")
        new = max(rows, 2 * self.c16)
        grown = self.buf.new_zeros(*self.buf.shape[:4], new + 1, self.d)
        grown[..., : self.c16, :] = self.buf[..., : self.c16, :]
        self.buf, self.c16 = grown, new

    def release(self, slot: int) -> None:
        """Free slot ``slot``'s pages and empty it."""
        self.table.release(slot)
        self.qlens[slot] = 0

    def move(self, src: int, dst: int) -> None:
        """Move a sequence from slot ``src`` to the empty slot ``dst`` (the engine keeps slots compact)."""
        self.buf[:, :, dst] = self.buf[:, :, src]
        self.qlens[dst], self.qlens[src] = self.qlens[src], 0
        self.table.move(src, dst)

    # ---------------------------------------------------------------------------------------- writing
    def write(self, layer: int, slot: int, k: Tensor, v: Tensor) -> None:
        """Store a chunk of new rows ``k``/``v`` ``[T, Hkv, d]`` (centered, rotated; any float dtype) of layer
        ``layer`` after the slot's ``lens[slot]`` tokens, demoting whatever the policy says into the slot's pages
        (:meth:`reserve` them first). Call :meth:`commit` once every layer is written."""
        T = k.shape[0]
        if T == 0:
            return
        pol, S = self.policy, self.policy.sink
        n0, q0 = self.lens[slot], self.qlens[slot]
        s0, s1, q1 = min(n0, S), min(n0 + T, S), pol.quantized(n0 + T)
        kv = torch.stack((k, v)).to(self.dtype16).transpose(1, 2)  # [2, Hkv, T, d], rounded as stored
        r0, a, m = n0 - s0 - q0, s1 - s0, q1 - q0
        self._ensure16(n0 + T - q1)
        buf = self.buf[:, layer, slot]
        if a:
            buf[:, :, s0:s1] = kv[:, :, :a]
        recent = kv[:, :, a:]
        if m:
            recent = torch.cat([buf[:, :, S:S + r0], recent], 2)
            self._quantize(layer, slot, q0, recent[:, :, :m].transpose(1, 2))
            buf[:, :, S:S + recent.shape[2] - m] = recent[:, :, m:]
        else:
            buf[:, :, S + r0:S + r0 + recent.shape[2]] = recent

    def _quantize(self, layer: int, slot: int, q0: int, rows: Tensor) -> None:
        """Rows ``[2, m, Hkv, d]`` (16-bit) into tier positions ``[q0, q0 + m)`` of the slot's pages."""
        fmt = self.formats[layer]
        if fmt is None:
            raise RuntimeError(f"layer {layer} is not quantized but the tier policy demotes tokens")
        pos = torch.arange(q0, q0 + rows.shape[1], device=self.device)
        slots = self.table.slots_of(slot, pos, self.page_size)
        dispatch.quantize_write(self.k_pages[layer], self.v_pages[layer], rows[0], rows[1], slots,
                                k_clip=fmt.k.clip, v_clip=fmt.v.clip)

    def commit(self, slot: int, tokens: int) -> None:
        """Record ``tokens`` new tokens of slot ``slot`` after :meth:`write` stored them in every layer."""
        self.lens[slot] += tokens
        self.qlens[slot] = self.policy.quantized(self.lens[slot])

    def decode_row(self, slot: int) -> int:
        """16-bit row where a decode forward stores slot ``slot``'s next token (the end of its recent window)."""
        return self.lens[slot] - self.qlens[slot]

    def commit_decode(self, slots: Sequence[int]) -> None:
        """After a decode forward stored one token per slot at :meth:`decode_row`: count it, demote the pages the
        policy now says are due (their page ids must be in the block table) and close the gap they leave in the
        recent window. Nothing changes if a demotion raises (it rewrites the same pages when run again)."""
        n = {s: self.lens[s] + 1 for s in slots}
        due = [(s, self.qlens[s], self.policy.quantized(n[s])) for s in slots]
        due = [(s, q0, q1) for s, q0, q1 in due if q1 > q0]
        if due:
            self._demote(due)
        for s in slots:
            self.lens[s] = n[s]
        for s, q0, q1 in due:
            m, n16 = q1 - q0, n[s] - q0
            S = self.policy.sink
            self.buf[:, :, s, :, S:n16 - m] = self.buf[:, :, s, :, S + m:n16].clone()
            self.qlens[s] = q1

    def _demote(self, due: list[tuple[int, int, int]]) -> None:
        """Quantize recent-window rows ``[S, S + q1 - q0)`` of each ``(slot, q0, q1)`` into tier positions
        ``[q0, q1)``, every layer, through the demote op."""
        S, dev = self.policy.sink, self.device
        observe = self.monitor is not None and self.monitor.sample()
        # non-blocking: a blocking copy would wait for the decode step still running on the device
        seq = torch.cat([torch.full((q1 - q0,), s, dtype=torch.long) for s, q0, q1 in due]).to(dev, non_blocking=True)
        src = torch.cat([torch.arange(S, S + q1 - q0) for _, q0, q1 in due]).to(dev, non_blocking=True)
        dst = torch.cat([self.table.slots_of(s, torch.arange(q0, q1, device=dev), self.page_size) for s, q0, q1 in due])
        for layer, fmt in enumerate(self.formats):
            if fmt is None:
                continue
            dispatch.demote(self.k_pages[layer], self.v_pages[layer], self.buf[0, layer], self.buf[1, layer], seq,
                            src, dst, k_clip=fmt.k.clip, v_clip=fmt.v.clip)
            if observe:
                self._observe(layer, seq, src, dst)

    def _observe(self, layer: int, seq: Tensor, src: Tensor, dst: Tensor) -> None:
        """Hand the monitor one layer's demoted rows and what their pages now hold (dequantized)."""
        P, rows = self.page_size, torch.arange(dst.shape[0], device=self.device)
        for which, pages in enumerate((self.k_pages[layer], self.v_pages[layer])):
            x = self.buf[which, layer][seq, :, src].float()  # [m, Hkv, d]
            deq = dequantize_pages_ref(pages, dst // P)[rows, :, dst % P]  # [m, Hkv, d]
            self.monitor.record(layer, which, x, deq, self.formats[layer][which].clip)

    # ---------------------------------------------------------------------------------------- reading
    def lengths(self, slots: Sequence[int]) -> tuple[Tensor, Tensor]:
        """``(qlen, len16)`` int32 ``[len(slots)]`` on the store's device: what the attention kernels read."""
        q = [self.qlens[s] for s in slots]
        n16 = [self.lens[s] - self.qlens[s] for s in slots]
        t = torch.tensor([q, n16], dtype=torch.int32).to(self.device)
        return t[0], t[1]

    def read_quantized(self, layer: int, which: int, slot: int, start: int, end: int) -> Tensor:
        """Dequantized rows ``[Hkv, end - start, d]`` (float32) of tier positions ``[start, end)``."""
        if not 0 <= start <= end <= self.qlens[slot]:
            raise IndexError(f"tier range [{start}, {end}) outside the {self.qlens[slot]} quantized tokens of slot "
                             f"{slot}")
        pages = (self.k_pages, self.v_pages)[which][layer]
        if start == end:
            return torch.zeros(self.H, 0, self.d, device=self.device)
        P = self.page_size
        p0, p1 = start // P, math.ceil(end / P)
        x = dequantize_pages_ref(pages, self.block_table[slot, p0:p1])  # [pages, Hkv, P, d]
        x = x.permute(1, 0, 2, 3).reshape(self.H, -1, self.d)
        return x[:, start - p0 * P: end - p0 * P]

    def prefix(self, layer: int, slot: int, chunk: int = 1024) -> Iterator[tuple[Tensor, Tensor]]:
        """Slot ``slot``'s stored tokens as ``(k, v)`` float32 pieces ``[Hkv, n, d]``: the 16-bit tiers, then the
        quantized tier dequantized ``chunk`` tokens at a time (order is irrelevant to attention)."""
        n16 = self.len16(slot)
        if n16:
            yield self.buf[0, layer, slot, :, :n16].float(), self.buf[1, layer, slot, :, :n16].float()
        q = self.qlens[slot]
        for t0 in range(0, q, chunk):
            t1 = min(q, t0 + chunk)
            yield self.read_quantized(layer, 0, slot, t0, t1), self.read_quantized(layer, 1, slot, t0, t1)

    def tiers(self, layer: int, slot: int) -> dict[str, Tensor]:
        """Slot ``slot``'s rows of ``layer`` by tier, float32 ``[Hkv, n, d]`` copies: sink, quantized
        (dequantized), recent. For tests and inspection."""
        s, q, r = self.policy.split(self.lens[slot])
        S, b = self.policy.sink, self.buf[:, layer, slot].float()
        out = {"k_sink": b[0, :, :s], "v_sink": b[1, :, :s], "k_recent": b[0, :, S:S + r],
               "v_recent": b[1, :, S:S + r], "k_quantized": self.read_quantized(layer, 0, slot, 0, q),
               "v_quantized": self.read_quantized(layer, 1, slot, 0, q)}
        return {k: v.clone() for k, v in out.items()}

    # ------------------------------------------------------------------------------------------ bytes
    def tensors(self) -> list[Tensor]:
        pools = [p for p in (*self.k_pages, *self.v_pages) if p is not None]
        return [t for p in pools for t in (p.codes, p.scale, p.offset)] + [self.buf]

    def allocated_bytes(self) -> int:
        return _nbytes(*self.tensors(), self.block_table)

    def nbytes(self, slots: Sequence[int] | None = None) -> Bytes:
        """Physical bytes of the tokens held by ``slots`` (default: every slot), all layers."""
        slots = range(self.num_slots) if slots is None else slots
        es, H, d = self.buf.element_size(), self.H, self.d
        tokens = sum(self.lens[s] for s in slots)
        quantized = sum(self.qlens[s] for s in slots)
        per_q = sum(p.fmt.bytes_per_token for p in (*self.k_pages, *self.v_pages) if p is not None)
        return Bytes(
            tokens=self.L * tokens, quantized_tokens=self.L * quantized,
            used_16bit=2 * self.L * (tokens - quantized) * H * d * es, used_quantized=int(quantized * per_q),
            allocated=self.allocated_bytes(), bf16_equivalent=2 * self.L * tokens * H * d * 2,
            elements=2 * self.L * tokens * H * d,
        )


def quantize_roundtrip(fmt: PageFormat, clip: float, rows: Tensor) -> Tensor:
    """What storing rows ``[n, Hkv, d]`` (tier positions ``0 .. n - 1``; whole pages for channel pages) in pages
    of ``fmt`` and reading them back gives, float32 ``[n, Hkv, d]``: the store's own write and read, on a
    scratch pool (the teacher-forced simulation)."""
    n, P = rows.shape[0], fmt.page_size
    pages = QuantPages.allocate(fmt, max(1, math.ceil(n / P)), rows.device)
    quantize_write_ref(pages, rows, torch.arange(n, device=rows.device), clip_ratio=clip)
    x = dequantize_pages_ref(pages, torch.arange(pages.num_pages, device=rows.device))  # [pages, Hkv, P, d]
    return x.transpose(1, 2).reshape(-1, fmt.num_kv_heads, fmt.head_dim)[:n]


__all__ = ["Bytes", "PagedStore", "quantize_roundtrip"]
