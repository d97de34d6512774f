"""Teacher-forced simulation of the quantized cache in one forward pass (see :func:`oscarkv.hf.simulate`).

For query ``i`` (prefix length ``i`` when it is decoded) each key ``j < i`` is used in the form the cache held
it then: quantized (from its 16-bit value) if ``S <= j < S + q(i)``, else 16-bit; the query's own key and value
are full precision (the chunk being attended, not yet stored). Per block of query rows the keys are laid out
once as ``[sink 16-bit | quantized band | 16-bit band]`` (the two bands overlap only where ``q(i)`` changes inside
the block) and a row mask picks each key's form, so the cost stays close to one dense causal attention.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..cache.attention import scores
from ..cache.build import build_store, policy_for
from ..cache.tiers import TierPolicy
from .prepare import LayerPlan

BLOCK = 128  # query rows per block: bounds the score matrix to [Hq, BLOCK, N]


def _check_causal(mask: Tensor | None, B: int, N: int) -> None:
    if mask is None:
        return
    allowed = mask[:, 0] if mask.dtype == torch.bool else mask[:, 0] > torch.finfo(mask.dtype).min / 2
    causal = torch.ones(N, N, dtype=torch.bool, device=mask.device).tril()
    if allowed.shape[-2:] != (N, N) or not bool((allowed == causal).all()):
        raise ValueError("oscarkv.hf.simulate needs unpadded sequences and a plain causal mask (pass no "
                         "attention_mask, or one of all ones)")


def simulate_attention(plan: LayerPlan, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None,
                       scaling: float, softcap: float | None = None) -> Tensor:
    """``query`` ``[B, Hq, N, d]``, ``key``/``value`` ``[B, Hkv, N, d]`` (values already folded) ->
    ``[B, N, Hq, d]`` in the rotated value basis."""
    B, Hq, N, d = query.shape
    if key.shape[2] != N:
        raise ValueError(f"oscarkv.hf.simulate needs one forward pass over the whole text (no past tokens); got "
                         f"{N} queries and {key.shape[2]} keys. Call model(ids, use_cache=False).")
    _check_causal(mask, B, N)
    H, g = plan.num_kv_heads, plan.groups
    q = plan.rotate_queries(query)
    kf, vf = plan.rotate_keys(key), value.to(torch.float32)
    dt16 = plan.window_dtype
    k16, v16 = kf.to(dt16).float(), vf.to(dt16).float()
    policy = policy_for(plan.recipe)
    S, P0 = policy.sink, min(plan.prompt_len, N)
    qmax = policy.quantized(N - 1) if N > P0 else 0
    pools = build_store(plan.recipe, plan.layer, 1, H, d, dt16, query.device) if qmax else None
    out = torch.empty(B, H, g, N, d, dtype=torch.float32, device=query.device)
    for b in range(B):
        kq = pools.k_pool.roundtrip(k16[b, :, S: S + qmax]) if qmax else k16[b, :, :0]
        vq = pools.v_pool.roundtrip(v16[b, :, S: S + qmax]) if qmax else v16[b, :, :0]
        bounds = list(range(0, P0, BLOCK)) + list(range(P0, N, BLOCK)) + [N]
        for i0, i1 in zip(bounds[:-1], bounds[1:]):
            if i1 <= P0:
                out[b, :, :, i0:i1] = _prompt_block(q[b, :, :, i0:i1], kf[b, :, :i1], vf[b, :, :i1], i0, scaling,
                                                    softcap)
            else:
                out[b, :, :, i0:i1] = _stored_block(q[b, :, :, i0:i1], i0, i1, policy, (k16[b], v16[b]),
                                                    (kq, vq), (kf[b], vf[b]), scaling, softcap)
    return out.reshape(B, Hq, N, d).transpose(1, 2).to(query.dtype)


def _prompt_block(qb: Tensor, k: Tensor, v: Tensor, i0: int, scaling: float, softcap: float | None) -> Tensor:
    """Rows ``[i0, i0 + nb)`` of a prompt prefilled in one pass: causal, full precision."""
    H, g, nb, d = qb.shape
    n = k.shape[1]
    rows = torch.arange(i0, i0 + nb, device=qb.device)
    valid = torch.arange(n, device=qb.device)[None] <= rows[:, None]
    s = scores(qb.reshape(H, g * nb, d), k, scaling, softcap).view(H, g, nb, n).masked_fill(~valid, float("-inf"))
    return torch.bmm(torch.softmax(s, -1).view(H, g * nb, n), v).view(H, g, nb, d)


def _stored_block(qb: Tensor, i0: int, i1: int, policy: TierPolicy, t16: tuple[Tensor, Tensor],
                  tq: tuple[Tensor, Tensor], tf: tuple[Tensor, Tensor], scaling: float,
                  softcap: float | None) -> Tensor:
    """Rows ``[i0, i1)`` decoded one at a time against the stored prefix (see the module docstring)."""
    H, g, nb, d = qb.shape
    dev = qb.device
    S = policy.sink
    qmin, qmx = policy.quantized(i0), policy.quantized(i1 - 1)
    a_end = min(S, i1)
    r0 = max(S + qmin, a_end)
    k16, v16 = t16
    K = torch.cat([k16[:, :a_end], tq[0][:, :qmx], k16[:, r0:i1]], 1)
    V = torch.cat([v16[:, :a_end], tq[1][:, :qmx], v16[:, r0:i1]], 1)
    pos = torch.cat([torch.arange(a_end, device=dev), torch.arange(S, S + qmx, device=dev),
                     torch.arange(r0, i1, device=dev)])
    is_q = torch.zeros_like(pos, dtype=torch.bool)
    is_q[a_end: a_end + qmx] = True
    rows = torch.arange(i0, i1, device=dev)
    qi = (S + policy.quantized_t(rows))[:, None]
    p, r = pos[None], rows[:, None]
    valid = (p <= r) & torch.where(is_q[None], p < qi, (p < S) | (p >= qi))
    nc = K.shape[1]
    s = scores(qb.reshape(H, g * nb, d), K, scaling, softcap).view(H, g, nb, nc).masked_fill(~valid, float("-inf"))
    kf, vf = tf
    sd = (qb * kf[:, i0:i1].unsqueeze(1)).sum(-1) * scaling
    if softcap:
        sd = torch.tanh(sd / softcap) * softcap
    dc = torch.where(rows < S, rows, a_end + qmx + (rows - r0)).view(1, 1, nb, 1).expand(H, g, nb, 1)
    s.scatter_(-1, dc, sd.unsqueeze(-1))
    w = torch.softmax(s, -1)
    o = torch.bmm(w.view(H, g * nb, nc), V).view(H, g, nb, d)
    return o + w.gather(-1, dc) * (vf[:, i0:i1] - v16[:, i0:i1]).unsqueeze(1)


__all__ = ["simulate_attention"]
