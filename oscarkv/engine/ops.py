"""Small fused ops of the decoder (norms, QK preparation, SiLU-gating) and a paged 16-bit decode attention.

Each op has a PyTorch implementation (CPU, and the specification) and a Triton kernel used on CUDA, so a
CUDA-graph decode step launches about a dozen kernels per layer instead of fifty. ``use_triton(x)`` decides;
tests compare both (``tests/engine/test_engine_ops.py``, interpreter on CPU, and the GPU run).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

_FORCE_TORCH = False  # tests flip this to compare paths; never changes numerics of a given path
_FORCE_TRITON = False  # tests run the Triton path on CPU tensors under TRITON_INTERPRET=1


def use_triton(x: Tensor) -> bool:
    return (x.is_cuda or _FORCE_TRITON) and not _FORCE_TORCH


def pdl_available(x: Tensor) -> bool:
    """Whether the Triton kernels on ``x``'s device run as programmatic dependent launches when asked
    (``pdl=True`` of the ops below): CUDA sm_90+ with a Triton that has grid dependency control. Elsewhere
    (CPU, the interpreter) ``pdl`` is a no-op."""
    if not use_triton(x):
        return False
    from . import triton_ops

    return triton_ops.pdl_available(x)


class KVDest(NamedTuple):
    """Where a decode step's new K/V rows go in a pool: element ``i`` of head ``h`` of token ``t`` of side
    ``which`` (0 = K, 1 = V) is ``dst``'s element at offset ``which * s_which + off[t] + h * s_head + i``
    (``off`` int64 ``[N]``, computed once per step by ``DecodeCtx.fill``)."""

    dst: Tensor
    off: Tensor
    s_which: int
    s_head: int


# ----------------------------------------------------------------------------------------- PyTorch
def rmsnorm_torch(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """HF's RMSNorm: normalise in float32, cast back, then scale. x ``[..., D]``."""
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rope_torch(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x ``[N, H, d]``, cos/sin ``[N, d]`` (rotate-half convention)."""
    h = x.shape[-1] // 2
    return x * cos[:, None] + torch.cat((-x[..., h:], x[..., :h]), dim=-1) * sin[:, None]


def qk_prep_torch(qkv: Tensor, hq: int, hkv: int, d: int, cos: Tensor, sin: Tensor, qn: Tensor | None,
                  kn: Tensor | None, eps: float, r_k: Tensor | None, mu_k: Tensor | None) -> tuple[Tensor, Tensor]:
    """Split fused QKV ``[N, (hq + 2 hkv) d]``, QK-norm (if weights given), RoPE, and with ``r_k``
    ``[hkv, d, d]`` center keys by ``mu_k`` ``[hkv, d]`` and rotate queries and keys (float64 math here,
    float32 in the kernel).
    Returns q ``[N, hq, d]`` and kv ``[2, N, hkv, d]`` in the input dtype."""
    N = qkv.shape[0]
    q, k, v = qkv.split((hq * d, hkv * d, hkv * d), dim=-1)
    q, k, v = q.view(N, hq, d), k.view(N, hkv, d), v.view(N, hkv, d)
    if qn is not None:
        q, k = rmsnorm_torch(q, qn, eps), rmsnorm_torch(k, kn, eps)
    q, k = rope_torch(q, cos, sin), rope_torch(k, cos, sin)
    if r_k is not None:  # float64 like oscarkv.hf, so both produce the same stored rows
        r = r_k.double()
        k = torch.einsum("nhd,hde->nhe", k.double() - mu_k.double(), r).float().to(qkv.dtype)
        qg = q.double().view(N, hkv, hq // hkv, d)
        q = torch.einsum("nhgd,hde->nhge", qg, r).reshape(N, hq, d).float().to(qkv.dtype)
    return q, torch.stack((k, v))


def paged_decode_torch(q: Tensor, kv: Tensor, block_table: Tensor, lens: Tensor, sm_scale: float) -> Tensor:
    """One query per sequence over 16-bit pages. q ``[B, Hq, d]``, kv ``[2, pages, Hkv, P, d]``, block_table
    int32 ``[B, max_pages]``, lens ``[B]``. Returns ``[B, Hq, d]`` (zeros for empty sequences)."""
    B, Hq, d = q.shape
    P, Hkv = kv.shape[3], kv.shape[2]
    out = torch.zeros_like(q)
    for b in range(B):
        n = int(lens[b])
        if n == 0:
            continue
        pages = block_table[b, : (n + P - 1) // P].long()
        k, v = (kv[i, pages].transpose(0, 1).reshape(Hkv, -1, d)[:, :n] for i in range(2))
        g = Hq // Hkv
        s = torch.einsum("hgd,hnd->hgn", q[b].float().view(Hkv, g, d), k.float()) * sm_scale
        out[b] = torch.einsum("hgn,hnd->hgd", s.softmax(-1), v.float()).reshape(Hq, d).to(q.dtype)
    return out


def gemv_torch(x: Tensor, w: Tensor, b: Tensor | None = None, residual: Tensor | None = None,
               norm: Tensor | None = None, eps: float = 1e-6, act: str | None = None,
               out_dtype: torch.dtype | None = None) -> Tensor:
    """Specification of the fused decode GEMV: ``linear(pro(x), w, b)``, rounded to x's dtype, then
    ``+ residual`` (then converted to ``out_dtype`` if given). ``pro``: ``rmsnorm_torch(x, norm)`` with
    ``norm``, ``silu(x[:, :K]) * x[:, K:]`` with ``act="silu"``, else identity (the unfused ops of a block, in
    the same order)."""
    if norm is not None:
        x = rmsnorm_torch(x, norm, eps)
    elif act == "silu":
        gate, up = x.chunk(2, dim=-1)
        x = F.silu(gate) * up
    y = F.linear(x, w, b)
    y = y if residual is None else y + residual
    return y if out_dtype is None else y.to(out_dtype)


def embed_rope_torch(tokens: Tensor, positions: Tensor, emb: Tensor, inv_freq2: Tensor,
                     scaling: float = 1.0) -> tuple[Tensor, Tensor, Tensor]:
    """A step's embedding rows and RoPE ``cos/sin [N, d]`` (``inv_freq2``: both halves of the frequencies)."""
    x = F.embedding(tokens, emb)
    e = positions[:, None] * inv_freq2.float()  # one launch: cat((f, f)) of positions.float() * inv_freq
    cos, sin = e.cos(), e.sin()
    if scaling != 1.0:
        cos, sin = cos * scaling, sin * scaling
    return x, cos.to(x.dtype), sin.to(x.dtype)


# --------------------------------------------------------------------------------------- dispatchers
def rmsnorm(x: Tensor, w: Tensor, eps: float, residual: Tensor | None = None,
            pdl: bool = False) -> tuple[Tensor, Tensor]:
    """``(rmsnorm(x + residual), x + residual)``; with ``residual=None`` the second output is ``x``. ``pdl``
    here and below: the Triton kernels as programmatic dependent launches where available (``pdl_available``)."""
    if use_triton(x):
        from . import triton_ops

        return triton_ops.rmsnorm(x, w, eps, residual, pdl=pdl)
    h = x if residual is None else x + residual
    return rmsnorm_torch(h, w, eps), h


def silu_mul(gu: Tensor, pdl: bool = False) -> Tensor:
    """``silu(gate) * up`` for ``gu = [gate | up]`` ``[N, 2I]``."""
    if use_triton(gu):
        from . import triton_ops

        return triton_ops.silu_mul(gu, pdl=pdl)
    gate, up = gu.chunk(2, dim=-1)
    return F.silu(gate) * up


def qk_prep(qkv: Tensor, hq: int, hkv: int, d: int, cos: Tensor, sin: Tensor, qn: Tensor | None, kn: Tensor | None,
            eps: float, r_k: Tensor | None = None, mu_k: Tensor | None = None,
            out: KVDest | None = None, pdl: bool = False) -> tuple[Tensor, Tensor | None]:
    """``(q, kv)``; with ``out`` the Triton kernel stores k/v into the pool itself and returns ``kv=None``
    (the PyTorch path ignores ``out`` and returns kv for the caller's reference write)."""
    if use_triton(qkv):
        from . import triton_ops

        return triton_ops.qk_prep(qkv, hq, hkv, d, cos, sin, qn, kn, eps, r_k, mu_k, out, pdl=pdl)
    return qk_prep_torch(qkv, hq, hkv, d, cos, sin, qn, kn, eps, r_k, mu_k)


def gemv(x: Tensor, w: Tensor, b: Tensor | None = None, residual: Tensor | None = None, norm: Tensor | None = None,
         eps: float = 1e-6, act: str | None = None, out_dtype: torch.dtype | None = None,
         pdl: bool = False) -> Tensor:
    """The fused decode GEMV (:func:`gemv_torch`): Triton on CUDA, the specification elsewhere."""
    if use_triton(x):
        from . import triton_ops

        return triton_ops.gemv(x, w, b, residual, norm, eps, act, out_dtype=out_dtype, pdl=pdl)
    return gemv_torch(x, w, b, residual, norm, eps, act, out_dtype)


def embed_rope(tokens: Tensor, positions: Tensor, emb: Tensor, inv_freq2: Tensor, scaling: float = 1.0,
               pdl: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`embed_rope_torch` in one Triton launch on CUDA (libdevice cosf/sinf, as torch's kernels)."""
    if use_triton(emb):
        from . import triton_ops

        return triton_ops.embed_rope(tokens, positions, emb, inv_freq2, scaling, pdl=pdl)
    return embed_rope_torch(tokens, positions, emb, inv_freq2, scaling)


def paged_decode(q: Tensor, kv: Tensor, block_table: Tensor, lens: Tensor, sm_scale: float,
                 max_len: int | None = None, pdl: bool = False) -> Tensor:
    """Graph-safe on CUDA (fixed grid sized from ``max_len``); a per-sequence loop on CPU."""
    if use_triton(q):
        from . import triton_ops

        return triton_ops.paged_decode(q, kv, block_table, lens, sm_scale, max_len, pdl=pdl)
    return paged_decode_torch(q, kv, block_table, lens, sm_scale)


__all__ = ["rmsnorm", "silu_mul", "qk_prep", "paged_decode", "gemv", "embed_rope", "KVDest", "pdl_available",
           "rmsnorm_torch", "rope_torch", "qk_prep_torch", "paged_decode_torch", "gemv_torch", "embed_rope_torch"]
