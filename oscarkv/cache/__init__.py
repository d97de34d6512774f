"""Framework-free cache bookkeeping: the demotion rule (:class:`TierPolicy`), quantized-tier pools, one layer's
three-tier store and the chunked attention over it. Used by :mod:`oscarkv.hf` (and open to the engine)."""

from .attention import OnlineSoftmax, chunk_attention
from .build import build_store
from .pools import TokenPool
from .store import Bytes, LayerStore
from .tiers import TierPolicy

__all__ = [
           "Bytes",
           "LayerStore",
           "OnlineSoftmax",
           "TierPolicy",
           "TokenPool",
           "build_store",
           "chunk_attention",
]
