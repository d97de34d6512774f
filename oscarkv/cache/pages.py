"""Page ids, block tables and per-slot lengths: the bookkeeping every paged store shares.

Sequences live in *slots* ``0 .. num_slots - 1``; row ``num_slots`` of the block table is a spare row for padded
CUDA-graph rows. Page 0 is a scratch page that is never handed out: a padded row's block table points at it, so
it can never write into a live page.
"""

from __future__ import annotations

import torch
from torch import Tensor


class PageAllocator:
    """Free list of page ids ``1 .. num_pages - 1`` (page 0 is the scratch page)."""

    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"a pool needs at least the scratch page, got num_pages={num_pages}")
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

    def grow(self, num_pages: int) -> None:
        """Add page ids up to ``num_pages`` (the pools must grow alongside)."""
        if num_pages > self.num_pages:
            self._free[:0] = range(num_pages - 1, self.num_pages - 1, -1)
            self.num_pages = num_pages


class SlotTable:
    """Block table ``int32 [num_slots + 1, max_pages]`` (logical page ``j`` of slot ``s`` -> page id), each slot's
    page list and token count (host integers are authoritative; the device table mirrors the page lists)."""

    def __init__(self, num_slots: int, max_pages: int, num_pages: int, device: torch.device | str):
        self.num_slots = num_slots
        self.device = torch.device(device)
        self.allocator = PageAllocator(num_pages)
        self.block_table = torch.zeros(num_slots + 1, max(1, max_pages), dtype=torch.int32, device=device)
        self.pages: list[list[int]] = [[] for _ in range(num_slots + 1)]
        self.lens = [0] * (num_slots + 1)

    @property
    def max_pages(self) -> int:
        return self.block_table.shape[1]

    def _grow_table(self, width: int) -> None:
        grown = torch.zeros(self.block_table.shape[0], width, dtype=torch.int32, device=self.device)
        grown[:, : self.max_pages] = self.block_table
        self.block_table = grown

    def add_pages(self, slot: int, pages: list[int]) -> None:
        """Append page ids (already allocated) to slot ``slot``'s logical pages."""
        if not pages:
            return
        first = len(self.pages[slot])
        if first + len(pages) > self.max_pages:
            raise ValueError(f"slot {slot} would hold {first + len(pages)} pages; the block table holds "
                             f"{self.max_pages} (max_model_len)")
        # non-blocking (stream-ordered): the host need not wait for a step still running on the device
        self.block_table[slot, first:first + len(pages)] = torch.tensor(pages, dtype=torch.int32).to(
            self.device, non_blocking=True)
        self.pages[slot] += pages

    def release(self, slot: int) -> None:
        """Give slot ``slot``'s pages back and empty it."""
        self.allocator.free(self.pages[slot])
        self.clear(slot)

    def clear(self, slot: int) -> None:
        self.block_table[slot].zero_()
        self.pages[slot], self.lens[slot] = [], 0

    def move(self, src: int, dst: int) -> None:
        """Move slot ``src``'s pages and length to the empty slot ``dst``."""
        self.block_table[dst] = self.block_table[src]
        self.pages[dst], self.lens[dst] = self.pages[src], self.lens[src]
        self.clear(src)

    def slots_of(self, slot: int, positions: Tensor, page_size: int) -> Tensor:
        """Physical slots (``page * page_size + row``, int64) of logical ``positions`` of slot ``slot``."""
        pages = self.block_table[slot, (positions // page_size).long()].long()
        return pages * page_size + (positions % page_size).long()


class SlotTableOwner:
    """What a store built on a :class:`SlotTable` (its ``table``) exposes of it: the block table, the token
    counts, the allocator and the slot count, always read live (a growable store replaces its block table)."""

    table: SlotTable

    @property
    def block_table(self) -> Tensor:
        return self.table.block_table

    @property
    def lens(self) -> list[int]:
        return self.table.lens

    @property
    def allocator(self) -> PageAllocator:
        return self.table.allocator

    @property
    def num_slots(self) -> int:
        return self.table.num_slots


__all__ = ["PageAllocator", "SlotTable", "SlotTableOwner"]
