"""Attention of a chunk of new queries over a stored prefix (in pieces) and over the chunk itself, merged
exactly by log-sum-exp (online softmax). The CPU path of the transformers integration; the semantics are those
of :func:`oscarkv.kernels.reference.extend_attention_ref` plus a mask on the chunk (padding, causality).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import Tensor


class OnlineSoftmax:
    """Running ``softmax(s) @ v`` over key pieces for queries ``[Hkv, R, d]`` (R = query rows per KV head)."""

    def __init__(self, rows: tuple[int, int], head_dim: int, device: torch.device | str):
        H, R = rows
        self.m = torch.full((H, R), float("-inf"), device=device)
        self.l = torch.zeros(H, R, device=device)
        self.acc = torch.zeros(H, R, head_dim, device=device)

    def add(self, s: Tensor, v: Tensor) -> None:
        """Scores ``s`` ``[Hkv, R, n]`` (``-inf`` where masked) and values ``v`` ``[Hkv, n, d]``."""
        if s.shape[-1] == 0:
            return
        m_new = torch.maximum(self.m, s.amax(-1))
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        p = torch.exp(s - m_safe.unsqueeze(-1))
        alpha = torch.exp(self.m - m_safe)
        self.l = self.l * alpha + p.sum(-1)
        self.acc = self.acc * alpha.unsqueeze(-1) + torch.bmm(p, v)
        self.m = m_new

    def result(self) -> Tensor:
        """``[Hkv, R, d]``; rows that saw no key at all give zeros."""
        l = self.l.unsqueeze(-1)
        return torch.where(l > 0, self.acc / l.clamp_min(torch.finfo(l.dtype).tiny), torch.zeros_like(self.acc))


def scores(q: Tensor, k: Tensor, scaling: float, softcap: float | None = None) -> Tensor:
    """``q`` ``[Hkv, R, d]`` x ``k`` ``[Hkv, n, d]`` -> ``[Hkv, R, n]`` scaled (and soft-capped) logits."""
    s = torch.bmm(q, k.transpose(1, 2)) * scaling
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    return s


def sdpa(q: Tensor, k: Tensor, v: Tensor, **kw) -> Tensor:
    """``F.scaled_dot_product_attention`` on ``[H, T, d]`` tensors, given a batch dimension: torch's fused
    backends (FlashAttention, memory-efficient, cuDNN) take 4-D inputs only; 3-D ones fall back to the math
    backend, which materialises the ``[H, T, T]`` scores (61 GiB for one 32K chunk of 16 heads)."""
    return F.scaled_dot_product_attention(q[None], k[None], v[None], **kw)[0]


def chunk_attention(
    q: Tensor,
    prefix: Callable[[], Iterable[tuple[Tensor, Tensor]]],
    k_new: Tensor,
    v_new: Tensor,
    self_mask: Tensor | None,
    scaling: float,
    softcap: float | None = None,
    block: int = 512,
) -> Tensor:
    """One sequence: queries ``q`` ``[Hkv, g, T, d]`` (float32, rotated) attend to every stored prefix piece
    ``(k, v)`` ``[Hkv, n, d]`` yielded by ``prefix()`` and to the chunk's own ``k_new``/``v_new``
    ``[Hkv, T, d]`` under ``self_mask`` ``[T, T]`` bool (True = attend; ``None`` = causal). Queries go
    ``block`` rows at a time, so scores stay bounded; ``prefix()`` is called once per block. Returns
    ``[Hkv, g, T, d]`` float32."""
    H, g, T, d = q.shape
    out = torch.empty(H, g, T, d, dtype=torch.float32, device=q.device)
    for t0 in range(0, T, block):
        t1 = min(T, t0 + block)
        nb = t1 - t0
        qr = q[:, :, t0:t1].reshape(H, g * nb, d)
        acc = OnlineSoftmax((H, g * nb), d, q.device)
        for k, v in prefix():
            acc.add(scores(qr, k, scaling, softcap), v)
        if self_mask is None:
            m = torch.arange(t1, device=q.device)[None] <= torch.arange(t0, t1, device=q.device)[:, None]
        else:
            m = self_mask[t0:t1, :t1]
        s = scores(qr, k_new[:, :t1], scaling, softcap).view(H, g, nb, t1)
        acc.add(s.masked_fill(~m, float("-inf")).view(H, g * nb, t1), v_new[:, :t1])
        out[:, :, t0:t1] = acc.result().view(H, g, nb, d)
    return out


__all__ = ["OnlineSoftmax", "chunk_attention", "scores", "sdpa"]
