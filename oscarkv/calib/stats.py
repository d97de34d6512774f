"""Streaming calibration statistics, captured through transformers' attention interface.

:func:`capture` registers an attention function (``"oscarkv_calib"``) that sees every layer's query, key and
value exactly as the attention kernel does (after RoPE and any QK-norm), hands them to a :class:`Recorder`
and then runs the ordinary SDPA attention, so the model's outputs are unchanged. Sums are kept in float64.

Memory bound: with the quadratic value weighting, ``C_S`` needs the *final* ``C_Q``, so each layer keeps its
post-RoPE keys and values of the statistics tokens in float32 (``8 * N * L * Hkv * d`` bytes for ``N`` tokens:
about 1 GB for Qwen2.5-1.5B at 17K tokens) instead of running the model twice. Held-out tokens for clip fitting
keep q, k and v per layer (``4 * N_hold * L * (Hq + 2 Hkv) * d`` bytes). Nothing else is stored.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch import Tensor

ATTN_NAME = "oscarkv_calib"


@dataclass
class HeldOut:
    """One held-out chunk of one layer: ``q [Hq, T, d]``, ``k``/``v [Hkv, T, d]`` (float32)."""

    q: Tensor
    k: Tensor
    v: Tensor
    scaling: float
    sliding_window: int | None = None
    softcap: float | None = None


@dataclass
class LayerAccumulator:
    """float64 running sums of one attention layer (``H`` KV heads, ``g`` query heads per KV head)."""

    num_kv_heads: int
    head_dim: int
    need_kv: bool = False  # keep k, v of statistics tokens (quadratic C_S needs the final C_Q)
    need_softmax: bool = False  # accumulate softmax-weighted value sums
    n: int = 0
    sum_k: Tensor | None = None
    sum_v: Tensor | None = None
    qq: Tensor | None = None
    kk: Tensor | None = None
    vv: Tensor | None = None
    w_sum: Tensor | None = None
    w_v: Tensor | None = None
    w_vv: Tensor | None = None
    k_buf: list[Tensor] = field(default_factory=list)
    v_buf: list[Tensor] = field(default_factory=list)
    held_out: list[HeldOut] = field(default_factory=list)

    def __post_init__(self) -> None:
        H, d = self.num_kv_heads, self.head_dim
        z = lambda *s: torch.zeros(*s, dtype=torch.float64)  # noqa: E731
        self.sum_k, self.sum_v = z(H, d), z(H, d)
        self.qq, self.kk, self.vv = z(H, d, d), z(H, d, d), z(H, d, d)
        self.w_sum, self.w_v, self.w_vv = z(H), z(H, d), z(H, d, d)

    def add(self, q: Tensor, k: Tensor, v: Tensor, weights: Tensor | None = None) -> None:
        """Add tokens: ``q [Hq, T, d]``, ``k``/``v [Hkv, T, d]``; ``weights [Hkv, T]`` for softmax C_S."""
        H = self.num_kv_heads
        g = q.shape[0] // H
        q64 = q.to(torch.float64).reshape(H, g * q.shape[1], -1)  # query heads of a group are contiguous
        k64, v64 = k.to(torch.float64), v.to(torch.float64)
        self.n += k.shape[1]
        self.sum_k += k64.sum(1)
        self.sum_v += v64.sum(1)
        self.qq += q64.transpose(1, 2) @ q64 / g
        self.kk += k64.transpose(1, 2) @ k64
        self.vv += v64.transpose(1, 2) @ v64
        if weights is not None:
            w = weights.to(torch.float64)
            self.w_sum += w.sum(1)
            self.w_v += (w.unsqueeze(-1) * v64).sum(1)
            self.w_vv += (v64 * w.unsqueeze(-1)).transpose(1, 2) @ v64
        if self.need_kv:
            self.k_buf.append(k.detach().to(torch.float32).clone())
            self.v_buf.append(v.detach().to(torch.float32).clone())


def softmax_weights(q: Tensor, k: Tensor, scaling: float, sliding_window: int | None = None,
                    softcap: float | None = None) -> Tensor:
    """``w[h, t] = sum_{j in group(h), i} S[j, i, t]^2`` for causal softmax scores ``S`` of one sequence.

    ``q [Hq, T, d]``, ``k [Hkv, T, d]``; returns float64 ``[Hkv, T]``.
    """
    H, T = k.shape[0], k.shape[1]
    g = q.shape[0] // H
    kk = k.to(torch.float64).repeat_interleave(g, dim=0)
    s = (q.to(torch.float64) @ kk.transpose(1, 2)) * scaling
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~causal_mask(T, sliding_window, s.device), float("-inf"))
    p = torch.softmax(s, dim=-1)
    return (p * p).sum(1).reshape(H, g, T).sum(1)


def causal_mask(T: int, sliding_window: int | None = None, device: Any = None) -> Tensor:
    """Boolean ``[T, T]``: query ``i`` may attend to key ``t`` (``t <= i``, and ``i - t < window`` if set)."""
    i = torch.arange(T, device=device).unsqueeze(1)
    t = torch.arange(T, device=device).unsqueeze(0)
    m = t <= i
    if sliding_window:
        m &= (i - t) < sliding_window
    return m


class Recorder:
    """Receives q/k/v from the attention function and routes them to per-layer accumulators.

    ``phase`` is "stats" (accumulate), "holdout" (keep q/k/v for clip fitting) or "off".
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, *, need_kv: bool, need_softmax: bool):
        self.layers = [
            LayerAccumulator(num_kv_heads, head_dim, need_kv=need_kv, need_softmax=need_softmax)
            for _ in range(num_layers)
        ]
        self.phase = "stats"

    def record(self, module: Any, query: Tensor, key: Tensor, value: Tensor, kwargs: dict) -> None:
        layer = getattr(module, "layer_idx", None)
        if layer is None or not 0 <= layer < len(self.layers):
            raise RuntimeError(f"attention module {type(module).__name__} has no valid layer_idx ({layer!r})")
        for name, t in (("query", query), ("key", key), ("value", value)):
            if not torch.isfinite(t.sum()) and not torch.isfinite(t).all():  # cheap test first
                raise ValueError(
                    f"layer {layer}: the post-RoPE {name} states contain NaN or Inf; calibration needs finite "
                    "activations (check the model weights and dtype; run in float32)"
                )
        if self.phase == "off":
            return
        scaling = kwargs.get("scaling") or getattr(module, "scaling", None) or query.shape[-1] ** -0.5
        window, softcap = kwargs.get("sliding_window"), kwargs.get("softcap")
        acc = self.layers[layer]
        for b in range(query.shape[0]):  # sequences are unpadded: each batch row is one chunk
            q, k, v = query[b].detach(), key[b].detach(), value[b].detach()
            if self.phase == "holdout":
                acc.held_out.append(HeldOut(q.float().clone(), k.float().clone(), v.float().clone(), float(scaling),
                                            window, softcap))
            else:
                w = softmax_weights(q, k, float(scaling), window, softcap) if acc.need_softmax else None
                acc.add(q, k, v, w)


def _attention_function(recorder: Recorder):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def attention(module, query, key, value, attention_mask, **kwargs):
        recorder.record(module, query, key, value, kwargs)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    return attention


@contextlib.contextmanager
def capture(model: Any, recorder: Recorder) -> Iterator[None]:
    """Within the block, every attention layer of ``model`` reports to ``recorder`` (then runs SDPA).

    Registers ``"oscarkv_calib"`` in transformers' attention and mask interfaces (the mask is SDPA's) and sets
    it as the model's attention implementation; the previous setting is restored on exit.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if ATTN_NAME in AttentionInterface._global_mapping:
        raise RuntimeError("a calibration capture is already active in this process; captures cannot be nested")
    AttentionInterface.register(ATTN_NAME, _attention_function(recorder))
    if ATTN_NAME not in AttentionMaskInterface._global_mapping:
        AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)
    configs = {id(c): c for c in [model.config] + [m.config for m in model.modules() if hasattr(m, "config")]}
    previous = {key: cfg._attn_implementation for key, cfg in configs.items()}
    try:
        for cfg in configs.values():
            cfg._attn_implementation = ATTN_NAME
        yield
    finally:
        for key, cfg in configs.items():
            cfg._attn_implementation = previous[key]
        AttentionInterface._global_mapping.pop(ATTN_NAME, None)  # the mask entry (SDPA's, stateless) stays


# ------------------------------------------------------------------------------------------ finalising
@dataclass
class CalibrationStats:
    """Raw statistics, float64, per layer and KV head (``[L, H, d, d]`` / ``[L, H, d]``).

    ``c_q``: ``mean over tokens and the group's query heads of q q^T`` (raw queries).
    ``c_s``: ``mean_t w_t v~ v~^T`` with ``w`` normalised to mean 1 per head; ``v~ = v - mu_v`` when centering.
    ``gram_k``/``gram_v``: ``mean k~ k~^T`` / ``mean v~ v~^T`` (centered when centering).
    ``mu_k``/``mu_v``: mean post-RoPE key / value over the same tokens. ``tokens``: statistics tokens.
    """

    c_q: Tensor
    c_s: Tensor
    gram_k: Tensor
    gram_v: Tensor
    mu_k: Tensor
    mu_v: Tensor
    tokens: int


def finalize(recorder: Recorder, *, centering: bool, value_weighting: str, need_c_s: bool = True) -> CalibrationStats:
    """Turn the accumulated sums into :class:`CalibrationStats` (see there for the definitions)."""
    out: dict[str, list[Tensor]] = {k: [] for k in ("c_q", "c_s", "gram_k", "gram_v", "mu_k", "mu_v")}
    n_tokens = recorder.layers[0].n
    for i, acc in enumerate(recorder.layers):
        if acc.n == 0 or acc.n != n_tokens:
            raise RuntimeError(f"layer {i} saw {acc.n} tokens, layer 0 saw {n_tokens}: was every layer captured?")
        n = acc.n
        mu_k, mu_v = acc.sum_k / n, acc.sum_v / n
        c_q = acc.qq / n
        ck, cv = (mu_k, mu_v) if centering else (torch.zeros_like(mu_k), torch.zeros_like(mu_v))
        gram_k = acc.kk / n - _outer(mu_k, mu_k) if centering else acc.kk / n
        gram_v = acc.vv / n - _outer(mu_v, mu_v) if centering else acc.vv / n
        if not need_c_s:
            c_s = torch.zeros_like(c_q)
        elif value_weighting == "softmax":
            c_s = (acc.w_vv - _outer(acc.w_v, cv) - _outer(cv, acc.w_v) + acc.w_sum[:, None, None] * _outer(cv, cv))
            c_s = c_s / acc.w_sum[:, None, None]
        else:
            c_s = _quadratic_c_s(acc, c_q, cv)
            acc.k_buf.clear()
            acc.v_buf.clear()
        for name, val in (("c_q", c_q), ("c_s", c_s), ("gram_k", gram_k), ("gram_v", gram_v), ("mu_k", mu_k),
                          ("mu_v", mu_v)):
            out[name].append(val)
    return CalibrationStats(**{k: torch.stack(v) for k, v in out.items()}, tokens=n_tokens)


def _outer(a: Tensor, b: Tensor) -> Tensor:
    return a.unsqueeze(-1) * b.unsqueeze(-2)


def _quadratic_c_s(acc: LayerAccumulator, c_q: Tensor, center_v: Tensor) -> Tensor:
    """``C_S[h] = sum_t w_t v~ v~^T / sum_t w_t`` with ``w_t = k_t^T C_Q[h] k_t`` (raw keys, as defined)."""
    if not acc.k_buf:
        raise RuntimeError("quadratic C_S needs the buffered keys and values; none were recorded")
    num = torch.zeros_like(c_q)
    den = torch.zeros(c_q.shape[0], dtype=torch.float64)
    for k, v in zip(acc.k_buf, acc.v_buf):
        k64 = k.to(torch.float64)
        w = torch.einsum("htd,hde,hte->ht", k64, c_q, k64)
        vc = v.to(torch.float64) - center_v.unsqueeze(1)
        num += (vc * w.unsqueeze(-1)).transpose(1, 2) @ vc
        den += w.sum(1)
    return num / den[:, None, None]


__all__ = ["Recorder", "LayerAccumulator", "HeldOut", "CalibrationStats", "capture", "finalize", "softmax_weights",
           "causal_mask", "ATTN_NAME"]
