"""Pages of running sequences: how many a sequence needs, and handing them out from the store's allocator."""

from __future__ import annotations

from ..cache import Paged16Store, PagedStore
from .sequence import Sequence


class BlockManager:
    """Allocates the store's pages to sequences (a sequence of ``n`` tokens holds ``store.pages_for(n)`` pages:
    its quantized tier for OSCAR, every token for BF16)."""

    def __init__(self, store: PagedStore | Paged16Store):
        self.store = store

    @property
    def num_free(self) -> int:
        return self.store.allocator.num_free

    @property
    def capacity(self) -> int:
        return self.store.allocator.capacity

    def pages_for(self, n: int) -> int:
        return self.store.pages_for(n)

    def held(self, seq: Sequence) -> int:
        return len(self.store.table.pages[seq.slot]) if seq.slot >= 0 else 0

    def missing(self, seq: Sequence, n: int) -> int:
        """Pages ``seq`` still needs to hold ``n`` tokens."""
        return max(0, self.pages_for(n) - self.held(seq))

    def allocate(self, seq: Sequence, n: int) -> None:
        """Give ``seq`` (in a slot) the pages for ``n`` tokens; raises ``MemoryError`` if too few are free."""
        need = self.missing(seq, n)
        if need:
            self.store.table.add_pages(seq.slot, self.store.allocator.allocate(need))

    def free(self, seq: Sequence) -> None:
        """Give ``seq``'s pages back and empty its slot."""
        self.store.release(seq.slot)


__all__ = ["BlockManager"]
