"""Rotations from the calibration statistics, and clip ratios fitted on held-out calibration tokens."""

from __future__ import annotations

from typing import Iterator, Sequence

import torch
from torch import Tensor

from ..config import QuantSpec
from ..quant import clip_rows_grid, dequantize, quantize, quantize_lloyd_max
from ..rotation import compose, sorted_eigh
from .stats import CalibrationStats, HeldOut, causal_mask


def targets(stats: CalibrationStats, spec: QuantSpec) -> tuple[Tensor, Tensor]:
    """Key and value target matrices ``[L, H, d, d]`` (float64) for ``spec.target``."""
    if spec.target == "gram":
        return stats.gram_k, stats.gram_v
    return stats.c_q, stats.c_s


def rotations(stats: CalibrationStats, spec: QuantSpec) -> dict[str, Tensor]:
    """``r_k, r_v`` (float32, ``[L, d, d]`` or ``[L, H, d, d]``) and ``eig_k, eig_v`` (descending eigenvalues of
    the targets). Per-layer granularity averages the head matrices of a layer before the eigendecomposition."""
    out = {}
    for name, target in zip(("k", "v"), targets(stats, spec)):
        if spec.granularity == "layer":
            target = target.mean(dim=1)
        evals, evecs = sorted_eigh(target)
        out[f"r_{name}"] = compose(evecs, target.shape[-1], spec.composition)
        if out[f"r_{name}"].shape != target.shape:  # "h"/"none" return one matrix: broadcast it
            out[f"r_{name}"] = out[f"r_{name}"].expand(target.shape).clone()
        out[f"eig_{name}"] = evals.to(torch.float32)
    return out


# ------------------------------------------------------------------------------------------- clipping
def _fake_quant(x: Tensor, ratio: float, spec: QuantSpec) -> Tensor:
    """Quantize-dequantize rows of ``x`` (float32, already clipped) with ``spec``'s format."""
    g = spec.group_for(x.shape[-1])
    if spec.quantizer == "lloyd-max":
        q = quantize_lloyd_max(x, group_size=g, clip_ratio=0.0, meta_dtype=spec.meta_dtype)
    else:
        q = quantize(x, bits=spec.bits, group_size=g, clip_ratio=0.0, meta_dtype=spec.meta_dtype,
                     check_finite=False)  # activations were checked when captured
    return dequantize(q, torch.float32)


def _roundtrips(x: Tensor, r: Tensor, mu: Tensor, grid: Sequence[float], spec: QuantSpec) -> Iterator[Tensor]:
    """For each clip ratio: ``x [H, T, d]`` -> stored form ``(x - mu) @ R`` -> clipped as
    :func:`oscarkv.quant.clip_rows` does (one sort serves every ratio) -> fake-quantized -> model basis."""
    stored = (x - mu.unsqueeze(1)) @ r
    for ratio, clipped in zip(grid, clip_rows_grid(stored, grid)):
        yield _fake_quant(clipped, ratio, spec) @ r.transpose(-1, -2) + mu.unsqueeze(1)


def tier_mask(T: int, sink: int, window: int) -> Tensor:
    """``[T, T]`` bool: key ``t`` is in the 2-bit tier for query ``i`` (``sink <= t <= i - window``)."""
    i = torch.arange(T).unsqueeze(1)
    t = torch.arange(T).unsqueeze(0)
    return (t >= sink) & (t <= i - window)


def fit_windows(T: int, spec: QuantSpec) -> tuple[int, int]:
    """Sink and window used when fitting on a chunk of ``T`` tokens: the spec's, shrunk for short chunks so
    that most keys are still quantized (``sink <= T/8``, ``window <= T/4``)."""
    return min(spec.sink, T // 8), min(spec.window, T // 4)


def clip_errors(
    held: Sequence[HeldOut], layer: dict[str, Tensor], spec: QuantSpec, grid: Sequence[float], which: str,
    max_queries: int = 128,
) -> list[float]:
    """Relative attention-output error ``||O^ - O|| / ||O||`` of one layer for each ratio in ``grid``, with only
    keys (``which="k"``) or only values (``"v"``) quantized, over (at most ``max_queries`` evenly spaced, per
    chunk) queries that see at least one 2-bit token under the cache's tier rule (:func:`tier_mask`).

    ``layer`` holds ``r_k``/``r_v`` ``[H, d, d]`` and ``mu_k``/``mu_v`` ``[H, d]`` (float32).
    """
    num = torch.zeros(len(grid), dtype=torch.float64)
    den = torch.zeros((), dtype=torch.float64)
    for h in held:
        H, T, d = h.k.shape
        sink, window = fit_windows(T, spec)
        valid = causal_mask(T, h.sliding_window)
        quant = tier_mask(T, sink, window) & valid
        rows = quant.any(dim=1).nonzero().squeeze(1)
        if rows.numel() == 0:
            continue
        if rows.numel() > max_queries:  # evenly spaced queries: the error estimate needs no more
            rows = rows[torch.linspace(0, rows.numel() - 1, max_queries).round().long()]
        q = h.q[:, rows].reshape(H, -1, rows.numel(), d)  # [H, g, R, d]: a group's query heads are contiguous
        valid, quant = valid[rows], quant[rows]  # [R, T], broadcast over heads
        k, v = h.k.unsqueeze(1), h.v.unsqueeze(1)  # [H, 1, T, d]
        s_full = q @ k.transpose(-1, -2)
        p = _probs_from_scores(s_full, h, valid)
        ref = p @ v
        den += float((ref * ref).sum())
        if which == "k":
            for j, k_hat in enumerate(_roundtrips(h.k, layer["r_k"], layer["mu_k"], grid, spec)):
                s_mix = torch.where(quant, q @ k_hat.unsqueeze(1).transpose(-1, -2), s_full)
                diff = _probs_from_scores(s_mix, h, valid) @ v - ref
                num[j] += float((diff * diff).sum())
        else:
            pq = p * quant
            for j, v_hat in enumerate(_roundtrips(h.v, layer["r_v"], layer["mu_v"], grid, spec)):
                diff = pq @ (v_hat - h.v).unsqueeze(1)
                num[j] += float((diff * diff).sum())
    if den == 0:
        return [0.0] * len(grid)
    return (num / den).sqrt().tolist()


def _probs_from_scores(s: Tensor, h: HeldOut, valid: Tensor) -> Tensor:
    """Causal (or sliding-window) softmax of raw dot products ``s`` with the layer's scaling and softcap."""
    s = s * h.scaling
    if h.softcap is not None:
        s = torch.tanh(s / h.softcap) * h.softcap
    return torch.softmax(s.masked_fill(~valid, float("-inf")), dim=-1)


def choose_ratio(grid: Sequence[float], errors: Sequence[float]) -> float:
    """The grid ratio with the smallest error; ties go to the least clipping (largest ratio)."""
    best = min(errors)
    return max(r for r, e in zip(grid, errors) if e <= best * (1 + 1e-9))


__all__ = ["targets", "rotations", "clip_errors", "choose_ratio", "tier_mask", "fit_windows"]
