"""The 16-bit paged store (no quantization): the engine's BF16 baseline cache.

``kv [L, 2, num_pages, Hkv, page_size, d]`` (K then V) in the model's dtype, addressed by the same block table
and slots as :class:`~oscarkv.cache.paged.PagedStore` (:class:`~oscarkv.cache.pages.SlotTable`); a sequence of
``n`` tokens occupies ``ceil(n / page_size)`` pages.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .pages import SlotTable, SlotTableOwner


class Paged16Store(SlotTableOwner):
    """K/V of ``num_layers`` layers in 16-bit pages for ``num_slots`` sequences."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, page_size: int, *, num_slots: int,
                 num_pages: int, max_pages: int, dtype: torch.dtype, device: torch.device | str):
        self.L, self.H, self.d, self.page_size = num_layers, num_kv_heads, head_dim, page_size
        self.dtype, self.device = dtype, torch.device(device)
        self.table = SlotTable(num_slots, max_pages, num_pages, device)
        self.kv = torch.zeros(num_layers, 2, num_pages, num_kv_heads, page_size, head_dim, dtype=dtype, device=device)

    @staticmethod
    def page_bytes(num_layers: int, num_kv_heads: int, head_dim: int, page_size: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * page_size * head_dim * torch.empty((), dtype=dtype).element_size()

    @classmethod
    def for_budget(cls, num_layers: int, num_kv_heads: int, head_dim: int, page_size: int, *, budget_bytes: int,
                   num_slots: int, max_len: int, dtype: torch.dtype, device: torch.device | str) -> Paged16Store:
        per_page = cls.page_bytes(num_layers, num_kv_heads, head_dim, page_size, dtype)
        num_pages = budget_bytes // per_page
        if num_pages < 2:
            raise ValueError(f"a KV budget of {budget_bytes / 2**30:.3f} GiB holds no page; raise kv_budget_gb to at "
                             f"least {2 * per_page / 2**30:.3f}")
        return cls(num_layers, num_kv_heads, head_dim, page_size, num_slots=num_slots, num_pages=int(num_pages),
                   max_pages=math.ceil(max_len / page_size), dtype=dtype, device=device)

    def pages_for(self, n: int) -> int:
        return math.ceil(n / self.page_size)

    def release(self, slot: int) -> None:
        self.table.release(slot)

    def move(self, src: int, dst: int) -> None:
        self.table.move(src, dst)

    def commit(self, slot: int, tokens: int) -> None:
        self.lens[slot] += tokens

    def commit_decode(self, slots) -> None:
        for s in slots:
            self.lens[s] += 1

    def tensors(self) -> list[Tensor]:
        return [self.kv]

    def allocated_bytes(self) -> int:
        return self.kv.numel() * self.kv.element_size() + self.block_table.numel() * 4


__all__ = ["Paged16Store"]
