"""Fold the value rotation and centering into an attention layer's ``v_proj`` and ``o_proj`` (and undo it).

For KV head ``h`` with rotation ``R = R_V[h]`` and mean ``mu = mu_V[h]`` the folded ``v_proj`` emits
``(v - mu) @ R``: weight rows of head ``h`` become ``R^T W_h`` and the bias ``(b_h - mu) @ R``. Attention over
such values returns ``(o - mu) @ R`` per query head ``j`` (softmax weights sum to one), so ``o_proj``'s input
columns of head ``j`` become ``W_o[:, j] @ R_V[j // g]`` and its bias gains ``W_o @ concat_j mu_V[j // g]``.
Computed in float64, stored in the weights' dtype. Restoration puts the original Parameter objects back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn


@dataclass
class _Saved:
    module: nn.Module
    weight: nn.Parameter
    bias: nn.Parameter | None


def _linear(attn: nn.Module, name: str) -> nn.Linear:
    lin = getattr(attn, name, None)
    if not isinstance(lin, nn.Linear):
        raise TypeError(f"{type(attn).__name__} has no nn.Linear {name!r}; cannot fold the value rotation into it")
    return lin


def _set(lin: nn.Linear, weight: Tensor, bias: Tensor | None) -> None:
    lin.weight = nn.Parameter(weight, requires_grad=False)
    lin.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)


def fold_values(attn: nn.Module, r_v: Tensor | None, mu_v: Tensor | None, num_q_heads: int, num_kv_heads: int,
                head_dim: int) -> list[_Saved]:
    """Fold ``r_v`` ``[Hkv, d, d]`` (or ``None``: identity) and ``mu_v`` ``[Hkv, d]`` (or ``None``) into
    ``attn.v_proj`` / ``attn.o_proj`` in place. Returns what :func:`unfold` needs to restore them exactly."""
    if r_v is None and mu_v is None:
        return []
    v, o = _linear(attn, "v_proj"), _linear(attn, "o_proj")
    saved = [_Saved(v, v.weight, v.bias), _Saved(o, o.weight, o.bias)]
    H, d, g = num_kv_heads, head_dim, num_q_heads // num_kv_heads
    f64 = dict(dtype=torch.float64)
    r = (torch.eye(d, device=v.weight.device, **f64).expand(H, d, d) if r_v is None else r_v.to(v.weight.device, **f64))
    mu = torch.zeros(H, d, device=v.weight.device, **f64) if mu_v is None else mu_v.to(v.weight.device, **f64)
    if tuple(r.shape) != (H, d, d) or tuple(mu.shape) != (H, d):
        raise ValueError(f"value rotation {tuple(r.shape)} / mean {tuple(mu.shape)} do not fit {H} KV heads of "
                         f"dim {d}")
    if v.weight.shape[0] != H * d or o.weight.shape[1] != num_q_heads * d:
        raise ValueError(f"v_proj {tuple(v.weight.shape)} / o_proj {tuple(o.weight.shape)} do not match "
                         f"{num_q_heads}/{H} heads of dim {d}")
    wv = v.weight.to(**f64).view(H, d, -1)
    bv = v.bias.to(**f64).view(H, d) if v.bias is not None else torch.zeros_like(mu)
    new_wv = torch.einsum("hde,hdk->hek", r, wv).reshape(H * d, -1)
    new_bv = torch.einsum("hd,hde->he", bv - mu, r).reshape(-1)
    keep_v_bias = v.bias is not None or mu_v is not None
    wo = o.weight.to(**f64).view(o.weight.shape[0], num_q_heads, d)
    r_rep, mu_rep = r.repeat_interleave(g, 0), mu.repeat_interleave(g, 0)
    new_wo = torch.einsum("kjd,jde->kje", wo, r_rep).reshape(o.weight.shape[0], -1)
    bo = o.bias.to(**f64) if o.bias is not None else torch.zeros(o.weight.shape[0], device=o.weight.device, **f64)
    new_bo = bo + torch.einsum("kjd,jd->k", wo, mu_rep)
    keep_o_bias = o.bias is not None or mu_v is not None
    _set(v, new_wv.to(v.weight.dtype), new_bv.to(v.weight.dtype) if keep_v_bias else None)
    _set(o, new_wo.to(o.weight.dtype), new_bo.to(o.weight.dtype) if keep_o_bias else None)
    return saved


def unfold(saved: list[_Saved]) -> None:
    """Put back the original Parameters recorded by :func:`fold_values`."""
    for s in saved:
        s.module.weight = s.weight
        s.module.bias = s.bias


__all__ = ["fold_values", "unfold"]
