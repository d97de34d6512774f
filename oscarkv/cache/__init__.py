"""The 2-bit KV store every front-end sits on: the tier rule (:class:`TierPolicy`), the paged store
(:class:`PagedStore`: per-layer quantized pages in each layer's format, 16-bit sink + recent window per
sequence, block table; writes and demotions through :mod:`oscarkv.kernels.dispatch`), the 16-bit paged store of
the engine's BF16 baseline and the chunked attention of the transformers integration's CPU path."""

from .attention import OnlineSoftmax, chunk_attention
from .build import geometry_for, growable_store, policy_for
from .dense import Paged16Store
from .formats import PageGeometry
from .paged import Bytes, PagedStore
from .pages import PageAllocator, SlotTable
from .tiers import TierPolicy

__all__ = [
    "Bytes",
    "OnlineSoftmax",
    "PageAllocator",
    "PageGeometry",
    "Paged16Store",
    "PagedStore",
    "SlotTable",
    "TierPolicy",
    "chunk_attention",
    "geometry_for",
    "growable_store",
    "policy_for",
]
