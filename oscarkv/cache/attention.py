"""Attention of a chunk of new queries over a stored prefix (in pieces) and over the chunk itself, merged
exactly by log-sum-exp (online softmax). The CPU path of the transformers integration; the semantics are those
of :func:`oscarkv.kernels.reference.extend_attention_ref` plus a mask on the chunk (padding, causality).
"""

from __future__ import annotations

from typing import Iterable

import torch
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


def chunk_attention(
    q: Tensor,
    prefix: Iterable[tuple[Tensor, Tensor]],
    k_new: Tensor,
    v_new: Tensor,
    self_mask: Tensor | None,
    scaling: float,
    softcap: float | None = None,
) -> Tensor:
    """One sequence: queries ``q`` ``[Hkv, g, T, d]`` (float32, rotated) attend to every stored prefix piece
    ``(k, v)`` ``[Hkv, n, d]`` and to the chunk's own ``k_new``/``v_new`` ``[Hkv, T, d]`` under ``self_mask``
    ``[T, T]`` bool (True = attend; ``None`` = causal). Returns ``[Hkv, g, T, d]`` float32."""
    H, g, T, d = q.shape
    qr = q.reshape(H, g * T, d)
    acc = OnlineSoftmax((H, g * T), d, q.device)
    for k, v in prefix:
        acc.add(scores(qr, k, scaling, softcap), v)
    if self_mask is None:
        self_mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    s = scores(qr, k_new, scaling, softcap).view(H, g, T, T)
    s = s.masked_fill(~self_mask, float("-inf")).view(H, g * T, T)
    acc.add(s, v_new)
    return acc.result().view(H, g, T, d)


__all__ = ["OnlineSoftmax", "chunk_attention", "scores"]
