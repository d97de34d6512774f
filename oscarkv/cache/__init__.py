"""Framework-free cache bookkeeping: the demotion rule (:class:`TierPolicy`), quantized-tier pools, one layer's
three-tier store and the chunked attention over it. Used by :mod:`oscarkv.hf` (and open to the engine)."""

from .attention import OnlineSoftmax, chunk_attention
from .pools import ChannelPool, TokenPool
from .store import Bytes, LayerStore
from .tiers import TierPolicy
from .build import build_store

__all__ = ["TierPolicy", "TokenPool", "ChannelPool", "LayerStore", "Bytes", "chunk_attention", "OnlineSoftmax",
           "build_store"]
