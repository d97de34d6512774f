"""One attention layer's three-tier K/V store for a batch of sequences (framework-free).

16-bit tiers follow :mod:`oscarkv.kernels.layout`: ``k16``/``v16`` ``[B, Hkv, C16, d]`` with ``len16[b]`` valid
slots, the sink in slots ``[0, S)`` and the recent window in order after it. The quantized tier lives in a
:class:`~oscarkv.cache.pools.TokenPool` per K and V (token or channel pages).
Rows arrive already centered and rotated; they are rounded to the 16-bit dtype when stored, and a demoted row is
quantized from its 16-bit value (the only copy the cache holds), then dropped from the 16-bit buffer.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from .pools import TokenPool
from .tiers import TierPolicy


@dataclass
class Bytes:
    """Physical bytes of a store (or a sum of stores). ``used_*`` count held tokens only; ``allocated`` counts
    every tensor owned, unused capacity included. ``tokens`` is summed over sequences (one layer each)."""

    tokens: int = 0
    quantized_tokens: int = 0
    used_16bit: int = 0
    used_quantized: int = 0
    allocated: int = 0
    bf16_equivalent: int = 0  # the same tokens held in a 16-bit cache (K and V)
    elements: int = 0  # K and V elements held

    @property
    def used(self) -> int:
        return self.used_16bit + self.used_quantized

    @property
    def unused(self) -> int:
        return self.allocated - self.used

    @property
    def bits_per_element(self) -> float:
        """Used bits per stored K/V element, 16-bit tiers included."""
        return 8 * self.used / self.elements if self.elements else 0.0

    @property
    def ratio_to_bf16(self) -> float:
        return self.used / self.bf16_equivalent if self.bf16_equivalent else 0.0

    def __add__(self, o: Bytes) -> Bytes:
        return Bytes(*(getattr(self, f) + getattr(o, f) for f in self.__dataclass_fields__))


class LayerStore:
    """K/V of one layer for ``batch_size`` sequences under a :class:`TierPolicy`.

    Args:
        k_pool, v_pool: quantized-tier pools, or ``None`` for a store that never quantizes (policy with
            ``quantized(n) == 0`` for every n).
        dtype16: dtype of the 16-bit tiers (float32 is allowed, for exactness tests).
    """

    def __init__(self, policy: TierPolicy, batch_size: int, num_kv_heads: int, head_dim: int,
                 dtype16: torch.dtype, device: torch.device | str,
                 k_pool: TokenPool | None, v_pool: TokenPool | None):
        self.policy, self.B, self.H, self.d = policy, batch_size, num_kv_heads, head_dim
        self.dtype16 = dtype16
        self.k16 = torch.zeros(batch_size, num_kv_heads, 0, head_dim, dtype=dtype16, device=device)
        self.v16 = torch.zeros_like(self.k16)
        self.len16 = torch.zeros(batch_size, dtype=torch.int32, device=device)
        self.k_pool, self.v_pool = k_pool, v_pool
        self.n = [0] * batch_size  # tokens held per sequence

    # ---------------------------------------------------------------------------------------- writing
    def _ensure(self, slots: int) -> None:
        cap = self.k16.shape[2]
        if slots <= cap:
            return
        new = min(max(slots, 2 * cap, 16), max(slots, self.policy.max_16bit))
        grow = (self.B, self.H, new - cap, self.d)
        self.k16 = torch.cat([self.k16, self.k16.new_zeros(grow)], 2)
        self.v16 = torch.cat([self.v16, self.v16.new_zeros(grow)], 2)

    def append(self, b: int, k: Tensor, v: Tensor) -> None:
        """Append rows ``k``/``v`` ``[Hkv, m, d]`` (centered, rotated; any float dtype) to sequence ``b`` and
        demote whatever the policy says."""
        m = k.shape[1]
        if m == 0:
            return
        k, v = k.to(self.dtype16), v.to(self.dtype16)
        S = self.policy.sink
        n0, n1 = self.n[b], self.n[b] + m
        s0, q0, r0 = self.policy.split(n0)
        s1, q1, r1 = self.policy.split(n1)
        a = s1 - s0
        self._ensure(s1)
        self.k16[b, :, s0:s1], self.v16[b, :, s0:s1] = k[:, :a], v[:, :a]
        k, v = k[:, a:], v[:, a:]
        demote = q1 - q0
        from_buf = min(demote, r0)
        from_new = demote - from_buf
        if demote:
            if self.k_pool is None or self.v_pool is None:
                raise RuntimeError("this store has no quantized tier but its policy demotes tokens")
            kd = torch.cat([self.k16[b, :, S: S + from_buf], k[:, :from_new]], 1)
            vd = torch.cat([self.v16[b, :, S: S + from_buf], v[:, :from_new]], 1)
            self.k_pool.write(b, kd.float())
            self.v_pool.write(b, vd.float())
        keep = r0 - from_buf
        if from_buf and keep:
            self.k16[b, :, S: S + keep] = self.k16[b, :, S + from_buf: S + r0].clone()
            self.v16[b, :, S: S + keep] = self.v16[b, :, S + from_buf: S + r0].clone()
        new = k.shape[1] - from_new
        assert keep + new == r1, (keep, new, r1)
        self._ensure(s1 + r1)
        self.k16[b, :, S + keep: S + r1] = k[:, from_new:]
        self.v16[b, :, S + keep: S + r1] = v[:, from_new:]
        self.n[b] = n1
        self.len16[b] = s1 + r1

    # ---------------------------------------------------------------------------------------- reading
    def prefix(self, b: int, chunk: int = 1024) -> Iterator[tuple[Tensor, Tensor]]:
        """The stored tokens of sequence ``b`` as ``(k, v)`` float32 pieces ``[Hkv, n, d]``: the 16-bit tiers,
        then the quantized tier dequantized ``chunk`` tokens at a time (order is irrelevant to attention)."""
        n16 = int(self.len16[b])
        if n16:
            yield self.k16[b, :, :n16].float(), self.v16[b, :, :n16].float()
        nq = self.policy.split(self.n[b])[1]
        for t0 in range(0, nq, chunk):
            t1 = min(nq, t0 + chunk)
            yield self.k_pool.read(b, t0, t1), self.v_pool.read(b, t0, t1)

    def tiers(self, b: int) -> dict[str, Tensor]:
        """Sequence ``b``'s stored rows by tier, float32 ``[Hkv, n, d]`` copies: sink, quantized (dequantized),
        recent. For tests and inspection."""
        s, q, r = self.policy.split(self.n[b])
        S = self.policy.sink
        empty = torch.zeros(self.H, 0, self.d)
        out = {"k_sink": self.k16[b, :, :s].float(), "v_sink": self.v16[b, :, :s].float(),
               "k_recent": self.k16[b, :, S: S + r].float(), "v_recent": self.v16[b, :, S: S + r].float()}
        out["k_quantized"] = self.k_pool.read(b, 0, q) if q else empty
        out["v_quantized"] = self.v_pool.read(b, 0, q) if q else empty
        return {k: v.clone() for k, v in out.items()}

    # ------------------------------------------------------------------------------------------ bytes
    def nbytes(self) -> Bytes:
        es = self.k16.element_size()
        n16 = int(self.len16.sum())
        tokens = sum(self.n)
        pools = [p for p in (self.k_pool, self.v_pool) if p is not None]
        own = [self.k16, self.v16, self.len16]
        return Bytes(
            tokens=tokens,
            quantized_tokens=tokens - n16,
            used_16bit=2 * n16 * self.H * self.d * es,
            used_quantized=sum(p.used_bytes() for p in pools),
            allocated=sum(t.numel() * t.element_size() for t in own) + sum(p.allocated_bytes() for p in pools),
            bf16_equivalent=2 * tokens * self.H * self.d * 2,
            elements=2 * tokens * self.H * self.d,
        )


__all__ = ["Bytes", "LayerStore"]
