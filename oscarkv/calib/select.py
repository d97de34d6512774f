"""Per-layer format selection under a bit budget (``oscar-auto``; docs/recipe.md).

For every layer and for K and V separately, each candidate :class:`~oscarkv.artifact.TensorFormat` (rotation
calibrated / Hadamard / none; token rows with a fitted clip or, for keys, channel pages; 2 or 4 bits) is scored
by the relative error of the layer's attention output on held-out calibration tokens, with only that tensor
quantized and the cache's tier rule (16-bit sink and window, demotion by pages). An exact multiple-choice
knapsack then picks one format per tensor minimising the sum of squared relative errors under the average
bit budget. The sum of squares is used because the per-layer errors enter the logits as roughly independent
perturbations whose variances add; it also makes one catastrophic layer dominate, which is the failure mode
this selection exists to catch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from ..artifact import Calibration, TensorFormat
from ..cache.tiers import TierPolicy
from ..config import QuantSpec
from ..quant import clip_rows_grid, dequantize, dequantize_per_channel, quantize, quantize_per_channel
from ..rotation import hadamard
from .fit import fit_windows
from .stats import HeldOut, causal_mask

KEY_CANDIDATES = tuple(TensorFormat(layout, bits, rot) for bits in (2, 4)
                       for layout, rot in (("token", "calibrated"), ("token", "hadamard"), ("token", "none"),
                                           ("channel", "none"), ("channel", "calibrated")))
VALUE_CANDIDATES = tuple(TensorFormat("token", bits, rot) for bits in (2, 4)
                         for rot in ("calibrated", "hadamard", "none"))
UNIT = 64  # cost resolution of the knapsack: 1/64 bit per element


@dataclass
class Scored:
    """A candidate format (its fitted clip filled in) with its held-out error: ``error`` over the layer,
    ``head_error`` ``[Hkv]`` per KV head (relative attention-output error, only this tensor quantized)."""

    format: TensorFormat
    bits: float
    error: float
    head_error: list[float]


def default_budget(head_dim: int) -> float:
    """KIVI-2's nominal bits per element at ``head_dim`` (per-channel keys in 32-token groups, per-token values)."""
    from ..methods import get

    return get("kivi-2").bits_per_element(head_dim)


def resolve_budget(budget: float | str | None, head_dim: int) -> float:
    """A number, or "kivi"/None for :func:`default_budget`."""
    if budget is None or budget == "kivi":
        return default_budget(head_dim)
    return float(budget)


# ------------------------------------------------------------------------------------------ round trips
def check_budget(budget: float | str | None, head_dim: int, spec: QuantSpec) -> float:
    """The budget :func:`resolve_budget` gives, or ``ValueError`` (one line, with the lowest budget that can be
    met) where it is below the mean bits of the cheapest key and value candidates at ``head_dim``: checked before
    any statistics are gathered, so an impossible budget costs no forward pass."""
    bits = resolve_budget(budget, head_dim)
    cheapest = [min(f.bits_per_element(head_dim, spec.page_size, spec.group_size) for f in cands)
                for cands in (KEY_CANDIDATES, VALUE_CANDIDATES)]
    floor = sum(cheapest) / 2
    if bits < floor - 1e-9:
        raise ValueError(f"bit budget {bits:g} is below {floor:.3f} bits/element, the cheapest per-layer formats at "
                         f"head_dim {head_dim} (2-bit codes plus their 16-bit scales and offsets): give --bit-budget "
                         f"{floor:g} or more")
    return bits


def _rotation(fmt: TensorFormat, calibrated: Tensor, d: int) -> Tensor | None:
    if fmt.rotation == "calibrated":
        return calibrated
    return hadamard(d).expand(calibrated.shape).to(calibrated) if fmt.rotation == "hadamard" else None


def roundtrips(x: Tensor, fmt: TensorFormat, r: Tensor | None, mu: Tensor, spec: QuantSpec, page: int,
               clips: Sequence[float]) -> Tensor:
    """``x`` ``[H, n, d]`` (model basis, ``n`` a multiple of ``page`` for the channel layout) as the cache
    returns it in ``fmt`` (centered by ``mu`` ``[H, d]``, rotated by ``r`` ``[H, d, d]`` or not): ``[C, H, n, d]``,
    one result per clip ratio in ``clips`` (token layout; the channel layout ignores them: ``C = 1``). The rows of
    every ratio are quantized in one call (quantization is per row, so this equals one call per ratio)."""
    stored = x - mu.unsqueeze(1)
    if r is not None:
        stored = stored @ r
    meta = spec.meta_dtype
    if fmt.layout == "channel":
        H, n, d = stored.shape
        pages = stored.reshape(H, n // page, page, d).transpose(0, 1)
        q = quantize_per_channel(pages, bits=fmt.bits, group_size=page, meta_dtype=meta)
        outs = dequantize_per_channel(q).transpose(0, 1).reshape(1, H, n, d)
    else:
        ys = torch.stack(list(clip_rows_grid(stored, clips)))
        q = quantize(ys, bits=fmt.bits, group_size=spec.group_for(ys.shape[-1]), clip_ratio=0.0, meta_dtype=meta,
                     check_finite=False)
        outs = dequantize(q, torch.float32)
    return (outs @ r.transpose(-1, -2) if r is not None else outs) + mu.unsqueeze(1)


# ------------------------------------------------------------------------------------------------ errors
def chunk_policy(T: int, spec: QuantSpec) -> TierPolicy:
    """The tier rule used on a held-out chunk of ``T`` tokens (windows shrunk for short chunks, as clip fitting)."""
    sink, window = fit_windows(T, spec)
    return TierPolicy(sink=sink, window=window, unit=spec.page_size)


class _Chunk:
    """One held-out chunk of one layer, prepared once: the rows that see a quantized token, their reference
    output, and the part of each row's softmax that no candidate changes (the columns outside the quantized
    band), so a candidate costs one pass over the band only."""

    def __init__(self, h: HeldOut, policy: TierPolicy, max_queries: int):
        H, T, d = h.k.shape
        i = torch.arange(T)
        qn = policy.quantized_t(i)  # query i sees a stored prefix of i tokens (decode) and itself
        rows = (qn > 0).nonzero().squeeze(1)
        if rows.numel() > max_queries:
            rows = rows[torch.linspace(0, rows.numel() - 1, max_queries).round().long()]
        self.h, self.H, self.rows = h, H, rows
        self.n_q = policy.quantized(T - 1) if T else 0
        if not rows.numel() or not self.n_q:  # too short to hold a quantized token: not scored
            return
        self.S = policy.sink
        t = torch.arange(T)[None]
        valid = causal_mask(T, h.sliding_window)[rows]
        quant = (t >= self.S) & (t < self.S + qn[rows, None]) & valid
        self.q = h.q[:, rows].reshape(H, -1, rows.numel(), d)  # [H, g, R, d]
        s_base = self._scale(self.q @ h.k.unsqueeze(1).transpose(-1, -2)).masked_fill(~valid, float("-inf"))
        p = torch.softmax(s_base, dim=-1)
        self.ref = p @ h.v.unsqueeze(1)
        self.den = (self.ref * self.ref).sum(dim=(1, 2, 3)).double()
        self.quant_band = quant[:, self.S: self.S + self.n_q]  # [R, n_q]
        # the fixed columns of each row (valid, not quantized: sink, recent window, the row itself): their max,
        # sum of exponentials and weighted values, combined with a candidate's band by the online-softmax rule
        s_fixed = s_base.masked_fill(quant, float("-inf"))
        self.m_f = s_fixed.amax(-1, keepdim=True)
        e_f = torch.exp(s_fixed - self.m_f)
        self.l_f = e_f.sum(-1, keepdim=True)
        self.o_f = e_f @ h.v.unsqueeze(1)
        self.v_band = self.band(h.v).unsqueeze(1)  # [H, 1, n_q, d]
        self.p_band = p[..., self.S: self.S + self.n_q] * self.quant_band  # [H, g, R, n_q]

    def _scale(self, s: Tensor) -> Tensor:
        s = s * self.h.scaling
        if self.h.softcap is not None:
            s = torch.tanh(s / self.h.softcap) * self.h.softcap
        return s

    def band(self, x: Tensor) -> Tensor:
        return x[:, self.S: self.S + self.n_q]

    def key_error(self, k_band: Tensor) -> Tensor:
        """Per-head squared error ``[C, H]`` with the quantized band of keys replaced by each of ``k_band``
        ``[C, H, n_q, d]`` (a row's quantized columns take the candidate's keys, the others keep theirs)."""
        s_band = self._scale(self.q @ k_band.unsqueeze(2).transpose(-1, -2))  # [C, H, g, R, n_q]
        s_band = s_band.masked_fill(~self.quant_band, float("-inf"))
        m = torch.maximum(self.m_f, s_band.amax(-1, keepdim=True))
        a_f = torch.exp(self.m_f - m)
        e_b = torch.exp(s_band - m)
        out = (a_f * self.o_f + e_b @ self.v_band) / (a_f * self.l_f + e_b.sum(-1, keepdim=True))
        diff = out - self.ref
        return (diff * diff).sum(dim=(2, 3, 4)).double()

    def value_error(self, v_band: Tensor) -> Tensor:
        """Per-head squared error ``[C, H]`` with the quantized band of values replaced by each of ``v_band``
        ``[C, H, n_q, d]`` (attention weights unchanged: values enter the output linearly)."""
        diff = self.p_band @ (v_band.unsqueeze(2) - self.v_band)
        return (diff * diff).sum(dim=(2, 3, 4)).double()


def score_layer(held: Sequence[HeldOut], layer: dict[str, Tensor], spec: QuantSpec, which: str,
                candidates: Sequence[TensorFormat] | None = None, max_queries: int = 256) -> list[Scored]:
    """Held-out error of every candidate format for the keys (``which="k"``) or values (``"v"``) of one layer.

    ``held``: the layer's held-out chunks; ``layer``: ``r_k``/``r_v`` ``[H, d, d]`` and ``mu_k``/``mu_v`` ``[H, d]``
    (float32, the calibration's). 2-bit token-layout candidates get the clip ratio of ``spec.clip_grid`` with the
    smallest error (ties to the least clipping); the others are scored unclipped."""
    cands = list(candidates or (KEY_CANDIDATES if which == "k" else VALUE_CANDIDATES))
    grid = list(spec.clip_grid)
    chunks = [_Chunk(h, chunk_policy(h.k.shape[1], spec), max_queries) for h in held]
    chunks = [c for c in chunks if c.rows.numel() and c.n_q]
    if not chunks:
        raise ValueError("no held-out chunk is long enough to have quantized tokens (need more than sink + "
                         "window + page tokens per chunk): calibrate with more --tokens, or with --bit-budget none "
                         "(one format for all layers)")
    H, d = layer["mu_k"].shape
    den = sum(c.den for c in chunks)
    out = []
    for fmt in cands:
        if which == "v" and fmt.layout != "token":
            raise ValueError(f"values are stored token-wise only; got candidate {fmt.label}")
        r = _rotation(fmt, layer[f"r_{which}"], d)
        # the clip grid for 2-bit token rows; 4-bit rows and channel pages are not clipped (at 4 bits the grid's
        # gain is small and the cost is most of the selection's)
        clips = grid if fmt.layout == "token" and fmt.bits == 2 else [0.0]
        num = torch.zeros(len(clips), H, dtype=torch.float64)
        for c in chunks:
            x = c.band(c.h.k if which == "k" else c.h.v)
            xh = roundtrips(x, fmt, r, layer[f"mu_{which}"], spec, spec.page_size, clips)
            num += c.key_error(xh) if which == "k" else c.value_error(xh)
        errs = (num.sum(1) / den.sum()).sqrt()
        best = float(errs.min())
        j = min((i for i, e in enumerate(errs.tolist()) if e <= best * (1 + 1e-9) + 1e-12), key=lambda i: -clips[i])
        clip = clips[j] if 0.0 < clips[j] < 1.0 else 0.0
        chosen = TensorFormat(fmt.layout, fmt.bits, fmt.rotation, clip)
        out.append(Scored(chosen, chosen.bits_per_element(d, spec.page_size, spec.group_size), float(errs[j]),
                          (num[j] / den).sqrt().tolist()))
    return out


# -------------------------------------------------------------------------------------------- allocation
def allocate(scores: Sequence[Sequence[Scored]], budget: float) -> list[int]:
    """Exact multiple-choice knapsack: one candidate index per tensor minimising ``sum error^2`` with the mean
    of the chosen ``bits`` at most ``budget`` (costs rounded to 1/64 bit). Ties go to fewer bits.
    Raises ``ValueError`` when even the cheapest candidates exceed the budget."""
    n = len(scores)
    cost = [[int(round(c.bits * UNIT)) for c in cands] for cands in scores]
    cap = int(budget * n * UNIT + 1e-6)
    floor = sum(min(c) for c in cost)
    if floor > cap:
        raise ValueError(f"bit budget {budget:g} is below the cheapest formats' {floor / n / UNIT:.3f} bits/element")
    inf = float("inf")
    dp = torch.full((cap + 1,), inf, dtype=torch.float64)
    dp[0] = 0.0
    choice = torch.zeros(n, cap + 1, dtype=torch.int64)
    for t, cands in enumerate(scores):
        new = torch.full_like(dp, inf)
        for j, c in enumerate(cands):
            w = cost[t][j]
            if w > cap:
                continue
            cand = torch.full_like(dp, inf)
            cand[w:] = dp[: cap + 1 - w] + c.error ** 2
            better = cand < new
            new = torch.where(better, cand, new)
            choice[t] = torch.where(better, torch.full_like(choice[t], j), choice[t])
        dp = new
    best = float(dp.min())
    c = int(((dp <= best * (1 + 1e-12) + 1e-15) & torch.isfinite(dp)).nonzero()[0])  # cheapest optimum
    picks = [0] * n
    for t in range(n - 1, -1, -1):
        picks[t] = int(choice[t, c])
        c -= cost[t][picks[t]]
    return picks


def select_formats(held: Sequence[Sequence[HeldOut]], calib: Calibration, budget: float | str | None = None,
                   progress: bool = False, key_candidates: Sequence[TensorFormat] | None = None,
                   value_candidates: Sequence[TensorFormat] | None = None,
                   quantized_layers: Sequence[bool] | None = None) -> tuple[list[dict], dict]:
    """``(layer_formats, record)``: per layer the selected key and value formats with their predicted held-out
    errors, under the mean ``budget`` bits per element (default KIVI-2's). ``held[i]`` are layer ``i``'s held-out
    chunks; the rotations, means and spec come from ``calib``. ``record`` holds every candidate's error.
    Candidates default to :data:`KEY_CANDIDATES` / :data:`VALUE_CANDIDATES`.

    ``quantized_layers[i]`` False marks a layer the cache keeps in 16-bit (a sliding-window layer): it is not
    scored, the budget is spent over the quantized layers only (their mean is at most ``budget``), and its entry
    carries ``"quantized": false`` with the base format (token rows, the spec's bits, the calibrated rotation)."""
    from tqdm.auto import tqdm

    spec, d = calib.spec, calib.model.head_dim
    bits = resolve_budget(budget, d)
    L = calib.model.num_layers
    quantized = [True] * L if quantized_layers is None else [bool(q) for q in quantized_layers]
    if len(quantized) != L or not any(quantized):
        raise ValueError(f"quantized_layers must give {L} flags with at least one True, got {quantized_layers!r}")
    scores: list[list[Scored]] = []
    layers = [i for i in range(L) if quantized[i]]
    for i in tqdm(layers, desc="scoring formats", unit="layer", disable=not progress):
        t = calib.layer(i)
        layer = {n: t[n].float().contiguous() for n in ("r_k", "r_v", "mu_k", "mu_v")}
        if not spec.centering:
            layer["mu_k"], layer["mu_v"] = torch.zeros_like(layer["mu_k"]), torch.zeros_like(layer["mu_v"])
        scores.append(score_layer(held[i], layer, spec, "k", key_candidates))
        scores.append(score_layer(held[i], layer, spec, "v", value_candidates))
    picks = allocate(scores, bits)
    formats = []
    base = TensorFormat("token", spec.bits, "calibrated").to_dict()
    for i in range(L):
        if not quantized[i]:
            formats.append({"k": base, "v": base, "quantized": False})
            continue
        j = layers.index(i)
        k, v = scores[2 * j][picks[2 * j]], scores[2 * j + 1][picks[2 * j + 1]]
        formats.append({"k": k.format.to_dict(), "v": v.format.to_dict(), "k_error": round(k.error, 6),
                        "v_error": round(v.error, 6), "k_bits_per_element": k.bits,
                        "v_bits_per_element": v.bits})
    chosen = [scores[t][p] for t, p in enumerate(picks)]
    record = {
        "budget": bits, "bits_per_element": sum(c.bits for c in chosen) / len(chosen),
        "quantized_layers": len(layers), "layers": L,
        "objective": "sum of squared relative attention-output errors (K and V of every quantized layer)",
        "predicted_sum_sq": sum(c.error ** 2 for c in chosen),
        "candidates": [[{"format": c.format.label, "bits": c.bits, "error": round(c.error, 6),
                         "head_error": [round(e, 6) for e in c.head_error]} for c in cands] for cands in scores],
        "candidate_layers": [i for i in layers for _ in "kv"],
    }
    return formats, record


__all__ = ["KEY_CANDIDATES", "VALUE_CANDIDATES", "Scored", "score_layer", "allocate",
           "select_formats",
           "default_budget", "resolve_budget", "check_budget", "roundtrips", "chunk_policy"]
