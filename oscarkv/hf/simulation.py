"""Teacher-forced simulation of the quantized cache in one forward pass (see :func:`oscarkv.hf.simulate`).

Query ``i`` belongs to a chunk starting at ``n_i`` (``n_i = i`` when decoding token by token; a prompt
prefilled in one pass is one chunk). Each key ``j < n_i`` is used in the form the cache held it then: quantized
(from its 16-bit value) if ``S <= j < S + q(n_i)``, else 16-bit; keys ``n_i <= j <= i`` (the chunk being
attended, not yet stored) are full precision. Per block of query rows the keys are laid out once as
``[sink 16-bit | quantized band | 16-bit band | full-precision band]`` (bands overlap only where ``n_i`` changes
inside the block) and a row mask picks each key's form, so the cost stays close to one dense causal attention.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..cache.attention import scores
from ..cache.build import geometry_for, policy_for
from ..cache.paged import quantize_roundtrip
from ..cache.tiers import TierPolicy
from .plan import LayerPlan

BLOCK = 128  # query rows per block: bounds the score matrix to [Hq, BLOCK, N]


def _check_causal(mask: Tensor | None, B: int, N: int) -> None:
    if mask is None:
        return
    allowed = mask[:, 0] if mask.dtype == torch.bool else mask[:, 0] > torch.finfo(mask.dtype).min / 2
    causal = torch.ones(N, N, dtype=torch.bool, device=mask.device).tril()
    if allowed.shape[-2:] != (N, N) or not bool((allowed == causal).all()):
        raise ValueError("oscarkv.hf.simulate needs unpadded sequences and a plain causal mask (pass no "
                         "attention_mask, or one of all ones)")


def chunk_starts(N: int, prompt_len: int, chunk: int, device=None) -> Tensor:
    """Prefix length ``n_i`` each query ``i < N`` sees as stored: the start of its chunk, where a prompt of
    ``prompt_len`` tokens is one chunk and the rest come ``chunk`` tokens at a time (``chunk = 1``: decoding)."""
    i = torch.arange(N, device=device)
    later = prompt_len + ((i - prompt_len) // chunk) * chunk
    return torch.where(i < prompt_len, torch.zeros_like(i), later)


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
    starts = chunk_starts(N, plan.prompt_len, plan.chunk, query.device)
    S = policy.sink
    qmax = policy.quantized(int(starts[-1])) if N else 0
    fmt = plan.lr.format
    pages = geometry_for(plan.recipe, H, d).page_formats(fmt) if qmax else None

    def roundtrip(x: Tensor, which: int) -> Tensor:  # [H, n, d] through the store's quantized pages
        return quantize_roundtrip(pages[which], fmt[which].clip, x.transpose(0, 1)).transpose(0, 1)

    out = torch.empty(B, H, g, N, d, dtype=torch.float32, device=query.device)
    for b in range(B):
        kq = roundtrip(k16[b, :, S: S + qmax], 0) if qmax else k16[b, :, :0]
        vq = roundtrip(v16[b, :, S: S + qmax], 1) if qmax else v16[b, :, :0]
        for i0 in range(0, N, BLOCK):
            i1 = min(N, i0 + BLOCK)
            out[b, :, :, i0:i1] = _block(q[b, :, :, i0:i1], i0, starts[i0:i1], policy, (k16[b], v16[b]),
                                         (kq, vq), (kf[b], vf[b]), scaling, softcap)
    return out.reshape(B, Hq, N, d).transpose(1, 2).to(query.dtype)


def _block(qb: Tensor, i0: int, n: Tensor, policy: TierPolicy, t16: tuple[Tensor, Tensor],
           tq: tuple[Tensor, Tensor], tf: tuple[Tensor, Tensor], scaling: float, softcap: float | None) -> Tensor:
    """Query rows ``i0 + r`` with stored prefix lengths ``n[r]`` (see the module docstring)."""
    H, g, nb, d = qb.shape
    dev = qb.device
    S = policy.sink
    i1 = i0 + nb
    n_lo, n_hi = int(n[0]), int(n[-1])
    qmin, qmx = policy.quantized(n_lo), policy.quantized(n_hi)
    a_end = min(S, n_hi)
    r0 = max(S + qmin, a_end)
    (k16, v16), (kq, vq), (kf, vf) = t16, tq, tf
    K = torch.cat([k16[:, :a_end], kq[:, :qmx], k16[:, r0:n_hi], kf[:, n_lo:i1]], 1)
    V = torch.cat([v16[:, :a_end], vq[:, :qmx], v16[:, r0:n_hi], vf[:, n_lo:i1]], 1)
    ar = lambda a, b: torch.arange(a, max(a, b), device=dev)  # noqa: E731
    parts = [ar(0, a_end), ar(S, S + qmx), ar(r0, n_hi), ar(n_lo, i1)]
    kind = torch.cat([torch.full_like(p, k) for k, p in enumerate(parts)])
    pos = torch.cat(parts)[None]
    rows = torch.arange(i0, i1, device=dev)[:, None]
    ni = n[:, None]
    qi = S + policy.quantized_t(n)[:, None]
    valid = torch.where(kind == 0, pos < ni,
            torch.where(kind == 1, pos < qi,
            torch.where(kind == 2, (pos >= qi) & (pos < ni), (pos >= ni) & (pos <= rows))))  # noqa: E128
    nc = K.shape[1]
    s = scores(qb.reshape(H, g * nb, d), K, scaling, softcap).view(H, g, nb, nc).masked_fill(~valid, float("-inf"))
    return torch.bmm(torch.softmax(s, -1).view(H, g * nb, nc), V).view(H, g, nb, d)


__all__ = ["chunk_starts", "simulate_attention"]
