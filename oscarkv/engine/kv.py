"""Paged KV pools behind one interface: ``Bf16Pool`` (16-bit pages) and ``OscarPool`` (16-bit sink + recent
window per slot, 2-bit pages in between), plus the page allocator.

Sequences live in *slots* ``0..max_slots-1``; the engine keeps running sequences in slots ``[0, n)`` so a
decode batch of size ``bs`` is simply slots ``[0, bs)``; padded CUDA-graph rows use free slots whose block
tables point at page 0, a scratch page that is never handed out, so they can never write into a live page.

Tier rule (OSCAR): the state of a sequence of ``n`` tokens is a function of ``n`` alone
(:func:`quantized_len`): the first ``S`` tokens are the sink, the ``quantized_len(n)`` tokens after them are
2-bit (whole pages, in order), the rest is the recent window. Attention at any step sees the state after the
step's tokens are appended, and a step's demotion happens after its attention: a chunk (or a decode
token) attends to the prefix as stored plus itself in full precision, as in :mod:`oscarkv.hf`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from ..kernels.layout import PageFormat, QuantPages
from ..kernels.reference import quantize_write_ref
from ..quant import quantize


def quantized_len(n: int, sink: int, window: int, page: int) -> int:
    """Tokens in the 2-bit tier of a sequence of ``n`` tokens: whole pages, demoted once the recent window
    (tokens after the sink and the 2-bit tier) reaches ``window + page``. Same rule as
    :class:`oscarkv.cache.TierPolicy` (``tests/engine`` checks that they agree)."""
    return page * max(0, (n - sink - window) // page)


@dataclass(frozen=True)
class CacheConfig:
    """``kind`` "bf16" or "oscar"; tier sizes and 2-bit format for "oscar" (from the calibration's spec).

    ``layer_formats``: ``None`` (every layer stores K and V in ``bits``-bit token pages) or one
    ``(k_bits, v_bits, key_layout)`` per layer (``key_layout`` "token" or "channel": keys in channel pages), as
    an ``oscar-auto`` calibration selects them (:meth:`oscarkv.methods.Recipe.layer_format`)."""

    kind: str = "oscar"
    page_size: int = 64
    sink: int = 64
    window: int = 256
    bits: int = 2
    group_size: int | None = None
    meta_dtype: str = "float16"
    layer_formats: tuple[tuple[int, int, str], ...] | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("bf16", "oscar"):
            raise ValueError(f"kv must be 'bf16' or 'oscar', got {self.kind!r}")
        if self.page_size < 1 or self.window % self.page_size:
            raise ValueError(f"window {self.window} must be a multiple of page_size {self.page_size}")
        for i, f in enumerate(self.layer_formats or ()):
            if len(f) != 3 or f[0] not in (2, 4) or f[1] not in (2, 4) or f[2] not in ("token", "channel"):
                raise ValueError(f"layer_formats[{i}] = {f!r}: expected (k_bits in 2/4, v_bits in 2/4, "
                                 "key_layout 'token' or 'channel')")

    def page_formats(self, num_layers: int, num_kv_heads: int, head_dim: int) -> list[tuple[PageFormat, PageFormat]]:
        """``(K format, V format)`` of every layer."""
        if self.layer_formats is not None and len(self.layer_formats) != num_layers:
            raise ValueError(f"layer_formats has {len(self.layer_formats)} entries for a {num_layers}-layer model")
        fmts = self.layer_formats or [(self.bits, self.bits, "token")] * num_layers
        out = []
        for kb, vb, layout in fmts:
            k_group = None if layout == "channel" else self.group_size
            out.append((PageFormat(num_kv_heads, head_dim, self.page_size, kb, k_group, self.meta_dtype, layout),
                        PageFormat(num_kv_heads, head_dim, self.page_size, vb, self.group_size, self.meta_dtype)))
        return out

    @property
    def mixed(self) -> bool:
        """True when layers differ in format or keys use channel pages (the pool then stores layer by layer)."""
        return self.layer_formats is not None and any(f != (self.bits, self.bits, "token") for f in self.layer_formats)

    @property
    def c16(self) -> int:
        """16-bit slots per sequence: sink + the largest recent window held (a step's token is appended before
        the step's demotion)."""
        if self.kind == "bf16":
            return 0
        return max(n - self.qlen(n - 1) for n in range(1, self.sink + self.window + 3 * self.page_size))

    def qlen(self, n: int) -> int:
        return quantized_len(n, self.sink, self.window, self.page_size) if self.kind == "oscar" else 0

    def pages_for(self, n: int) -> int:
        """Pages a sequence of ``n`` tokens occupies."""
        return math.ceil(n / self.page_size) if self.kind == "bf16" else self.qlen(n) // self.page_size


class PageAllocator:
    """Free list of page ids ``1..num_pages-1`` (page 0 is the scratch page)."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, 0, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity(self) -> int:
        return self.num_pages - 1

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"{n} pages requested, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def free(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))


class KVPool:
    """Common state: block tables and per-slot lengths (host copies are authoritative)."""

    def __init__(self, cfg: CacheConfig, num_layers: int, num_kv_heads: int, head_dim: int, num_pages: int,
                 max_slots: int, max_len: int, dtype: torch.dtype, device: torch.device | str):
        self.cfg, self.L, self.H, self.d = cfg, num_layers, num_kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.max_slots, self.max_len = max_slots, max_len
        self.max_pages = max(1, math.ceil(max_len / cfg.page_size))
        self.alloc = PageAllocator(num_pages)
        # one extra row: the dummy slot used for padding when every real slot is busy
        self.block_table = torch.zeros(max_slots + 1, self.max_pages, dtype=torch.int32, device=device)
        self.lens = [0] * (max_slots + 1)

    # -------------------------------------------------------------------------------------- accounting
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def bytes_per_token_paged(self) -> float:
        """Bytes of the paged tier per token (all layers, K and V), from the pool's own tensors."""
        raise NotImplementedError

    def used_bytes(self) -> int:
        """Bytes of pages in use plus the 16-bit buffers of occupied slots."""
        per_page = self.bytes_per_token_paged() * self.cfg.page_size
        return int((self.alloc.capacity - self.alloc.num_free) * per_page)

    def set_pages(self, slot: int, first: int, pages: list[int]) -> None:
        if pages:
            self.block_table[slot, first:first + len(pages)] = torch.tensor(pages, dtype=torch.int32).to(self.device)

    def move_slot(self, src: int, dst: int) -> None:
        """Move a sequence's state from slot ``src`` to ``dst`` (used to keep running sequences compact)."""
        self.block_table[dst] = self.block_table[src]
        self.lens[dst] = self.lens[src]
        self.clear_slot(src)

    def clear_slot(self, slot: int) -> None:
        self.block_table[slot].zero_()
        self.lens[slot] = 0


class Bf16Pool(KVPool):
    """16-bit paged pool: ``kv`` ``[L, 2, num_pages, Hkv, page, d]`` (K then V)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        shape = (self.L, 2, self.alloc.num_pages, self.H, self.cfg.page_size, self.d)
        self.kv = torch.zeros(shape, dtype=self.dtype, device=self.device)

    @staticmethod
    def page_bytes(cfg: CacheConfig, L: int, H: int, d: int, dtype: torch.dtype) -> int:
        return 2 * L * H * cfg.page_size * d * torch.empty((), dtype=dtype).element_size()

    @staticmethod
    def slot_bytes(cfg: CacheConfig, L: int, H: int, d: int, dtype: torch.dtype) -> int:
        return 0

    def tensors(self) -> list[Tensor]:
        return [self.kv]

    def bytes_per_token_paged(self) -> float:
        return self.nbytes() / (self.alloc.num_pages * self.cfg.page_size)


class OscarPool(KVPool):
    """Per slot a 16-bit buffer ``[2, L, slots, Hkv, C16 + 1, d]`` (sink then recent, in position order; the last
    column is scratch for padded decode rows) and 2-bit pages
    ``[L, num_pages, Hkv, P, ...]`` viewed per layer as :class:`QuantPages`. Holds the calibration tensors.

    With per-layer formats (``cfg.mixed``) each layer's K and V pages are separate tensors of that layer's
    :class:`PageFormat` (page ids are shared: a page id holds the same tokens in every layer)."""

    def __init__(self, *args, r_k: Tensor, mu_k: Tensor, k_clip: Tensor, v_clip: Tensor, **kw):
        super().__init__(*args, **kw)
        c, L = self.cfg, self.L
        self.formats = c.page_formats(L, self.H, self.d)
        self.fmt = self.formats[0][1]
        if c.mixed:
            self.codes = self.scale = self.offset = None
            self.pages = [[QuantPages.allocate(self.formats[l][i], self.alloc.num_pages, self.device)
                           for l in range(L)] for i in range(2)]
        else:
            q = QuantPages.allocate(self.fmt, self.alloc.num_pages * 2 * L, self.device)
            shape = lambda t: t.view(2, L, self.alloc.num_pages, *t.shape[1:])  # noqa: E731
            self.codes, self.scale, self.offset = shape(q.codes), shape(q.scale), shape(q.offset)
            self.pages = [[QuantPages(self.codes[i, l], self.scale[i, l], self.offset[i, l], self.fmt)
                           for l in range(L)] for i in range(2)]
        self.buf = torch.zeros(2, L, self.max_slots + 1, self.H, c.c16 + 1, self.d, dtype=self.dtype, device=self.device)
        self.r_k = r_k.to(self.device, torch.float32)  # [L, Hkv, d, d]
        self.mu_k = mu_k.to(self.device, torch.float32)  # [L, Hkv, d]
        self.clip = torch.stack([k_clip.float(), v_clip.float()]).to(self.device)  # [2, L]
        self.qlens = [0] * (self.max_slots + 1)
        self.n_q_heads = self.H
        self.monitor: Callable[..., None] | None = None  # (which, layers, rows, clipped rows, QuantizedRows)

    @staticmethod
    def page_bytes(cfg: CacheConfig, L: int, H: int, d: int, dtype: torch.dtype) -> int:
        return int(sum(fk.bytes_per_token + fv.bytes_per_token for fk, fv in cfg.page_formats(L, H, d))
                   * cfg.page_size)

    @staticmethod
    def slot_bytes(cfg: CacheConfig, L: int, H: int, d: int, dtype: torch.dtype) -> int:
        return 2 * L * H * (cfg.c16 + 1) * d * torch.empty((), dtype=dtype).element_size()

    def _paged_tensors(self) -> list[Tensor]:
        if self.codes is not None:
            return [self.codes, self.scale, self.offset]
        return [t for side in self.pages for p in side for t in (p.codes, p.scale, p.offset)]

    def tensors(self) -> list[Tensor]:
        return [*self._paged_tensors(), self.buf]

    def bytes_per_token_paged(self) -> float:
        paged = sum(t.numel() * t.element_size() for t in self._paged_tensors())
        return paged / (self.alloc.num_pages * self.cfg.page_size)

    def used_bytes(self) -> int:
        busy = sum(1 for n in self.lens[:-1] if n > 0)
        per_slot = self.buf[:, :, 0].numel() * self.buf.element_size()
        return super().used_bytes() + busy * per_slot

    def rotate_k(self, layer: int, k: Tensor) -> Tensor:
        """``(k - mu_k) @ R_K`` per KV head, float32 math, returned in the pool dtype. k ``[N, Hkv, d]``."""
        x = k.float() - self.mu_k[layer]
        return torch.einsum("nhd,hde->nhe", x, self.r_k[layer]).to(self.dtype)

    def rotate_q(self, layer: int, q: Tensor) -> Tensor:
        """``q @ R_K`` with query head ``j`` using KV head ``j // g``. q ``[N, Hq, d]``."""
        N, Hq, d = q.shape
        x = q.float().view(N, self.H, Hq // self.H, d)
        return torch.einsum("nhgd,hde->nhge", x, self.r_k[layer]).reshape(N, Hq, d).to(self.dtype)

    def move_slot(self, src: int, dst: int) -> None:
        self.buf[:, :, dst] = self.buf[:, :, src]
        self.qlens[dst] = self.qlens[src]
        super().move_slot(src, dst)

    def clear_slot(self, slot: int) -> None:
        super().clear_slot(slot)
        self.qlens[slot] = 0

    def quantize_into(self, x: Tensor, which: int, pages: Tensor, layers: slice = slice(None)) -> None:
        """Quantize rows ``x`` ``[L, npages, Hkv, P, d]`` (rotated) of K (``which=0``) or V (1) into ``pages``
        (int64 ``[npages]``) for ``layers`` at once, with each layer's clip ratio. Bit-identical to
        :func:`oscarkv.quant.quantize` per layer with that layer's ``clip_ratio``."""
        if self.codes is None:
            self._quantize_layers(x, which, pages, layers)
            return
        xf = x.float()
        d = xf.shape[-1]
        ratio = self.clip[which][layers]
        idx = torch.clamp((ratio * d).floor(), max=d - 1).long()
        off = (ratio <= 0) | (ratio >= 1)
        tau = xf.abs().sort(dim=-1).values.gather(-1, idx.view(-1, 1, 1, 1, 1).expand(*xf.shape[:-1], 1))
        tau = torch.where(off.view(-1, 1, 1, 1, 1), torch.full_like(tau, float("inf")), tau)
        xc = torch.minimum(torch.maximum(xf, -tau), tau)
        f = self.fmt
        q = quantize(xc, bits=f.bits, group_size=f.group_size, meta_dtype=f.meta_dtype, check_finite=False)
        self.codes[which][layers, pages] = q.packed
        self.scale[which][layers, pages] = q.scale
        self.offset[which][layers, pages] = q.offset
        if self.monitor is not None:
            self.monitor(which, layers, xf, xc, q)

    def _quantize_layers(self, x: Tensor, which: int, pages: Tensor, layers: slice) -> None:
        """Per-layer formats: each layer through the reference writer of its own format (token rows with the
        layer's clip, or whole channel pages); the quantization monitor is not fed on this path."""
        P = self.cfg.page_size
        slots = (pages.view(-1, 1) * P + torch.arange(P, device=pages.device)).reshape(-1)
        for j, layer in enumerate(range(self.L)[layers]):
            qp = self.pages[which][layer]
            rows = x[j].transpose(1, 2).reshape(-1, self.H, self.d)  # [npages * P, Hkv, d] in slot order
            clip = 0.0 if qp.fmt.channel else float(self.clip[which, layer])
            quantize_write_ref(qp, rows, slots, clip_ratio=clip)

    def demote(self, slots: list[int], new_pages: list[list[int]]) -> None:
        """Demote whole pages from the front of each slot's recent window into ``new_pages[i]`` (already
        in the block table). Afterwards the recent window is shifted to start at the sink's end again."""
        c = self.cfg
        S, P = c.sink, c.page_size
        for slot, pages in zip(slots, new_pages):
            if not pages:
                continue
            m = len(pages) * P
            n16 = self.lens[slot] - self.qlens[slot]  # tokens in 16-bit
            rows = self.buf[:, :, slot, :, S:S + m]  # [2, L, H, m, d]
            x = rows.reshape(2, self.L, self.H, len(pages), P, self.d).transpose(2, 3)
            ids = torch.tensor(pages, dtype=torch.long, device=self.device)
            for which in range(2):
                self.quantize_into(x[which], which, ids)
            keep = self.buf[:, :, slot, :, S + m:n16].clone()
            self.buf[:, :, slot, :, S:n16 - m] = keep
            self.qlens[slot] += m


def make_pool(cfg: CacheConfig, *, num_layers: int, num_kv_heads: int, head_dim: int, budget_bytes: int,
              max_slots: int, max_len: int, dtype: torch.dtype, device: torch.device | str,
              calib: dict | None = None) -> KVPool:
    """Size a pool from a byte budget: the 16-bit slot buffers first (OSCAR), then as many pages as fit."""
    cls = Bf16Pool if cfg.kind == "bf16" else OscarPool
    geo = (cfg, num_layers, num_kv_heads, head_dim, dtype)
    rest = budget_bytes - (max_slots + 1) * cls.slot_bytes(*geo)
    num_pages = rest // cls.page_bytes(*geo)
    if num_pages < 2:
        need = (max_slots + 1) * cls.slot_bytes(*geo) + 2 * cls.page_bytes(*geo)
        raise ValueError(f"a KV budget of {budget_bytes / 2**30:.3f} GiB holds no page for {max_slots} slots; "
                         f"raise kv_budget_gb to at least {need / 2**30:.3f} or lower max_num_seqs")
    args = (cfg, num_layers, num_kv_heads, head_dim, int(num_pages), max_slots, max_len, dtype, device)
    if cls is Bf16Pool:
        return Bf16Pool(*args)
    if calib is None:
        raise ValueError("the OSCAR cache needs calibration tensors (r_k, mu_k, k_clip, v_clip)")
    return OscarPool(*args, **calib)


__all__ = ["CacheConfig", "PageAllocator", "KVPool", "Bf16Pool", "OscarPool", "make_pool", "quantized_len"]
