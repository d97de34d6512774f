"""Sampling parameters and batched sampling (greedy, temperature, top-k, top-p)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    ``temperature=0`` is greedy. ``top_k=0`` and ``top_p=1`` disable those filters. Generation stops at
    ``max_tokens``, at an end-of-sequence token (unless ``ignore_eos``), at any of ``stop_token_ids``, or
    when the text contains one of ``stop`` (the stop string is not returned). ``seed`` makes sampling of
    this request reproducible regardless of batching.
    """

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not _real(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _real(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop must be a string or a list of non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", stop)
        ids = tuple(self.stop_token_ids)
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
            raise ValueError(f"stop_token_ids must be token ids (ints >= 0), got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", ids)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")

    @classmethod
    def from_dict(cls, data: dict) -> "SamplingParams":
        """Build from a mapping; unknown keys are an error that lists the valid ones."""
        valid = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - valid)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s) {unknown}; valid: {sorted(valid)}")
        return cls(**data)


def _real(x) -> bool:
    return not isinstance(x, bool) and isinstance(x, (int, float)) and math.isfinite(x)


def sample(logits: Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> Tensor:
    """One token per row of ``logits`` ``[B, V]`` (float32): int64 ``[B]`` on the logits' device, computed there
    without waiting for the device (the caller reads it when it needs it). Greedy rows take the argmax (lowest
    index on ties)."""
    out = logits.argmax(dim=-1)
    hot = [i for i, p in enumerate(params) if p.temperature > 0]
    if hot:
        dev = logits.device
        rows = torch.tensor(hot).to(dev, non_blocking=True)
        temps = torch.tensor([params[i].temperature for i in hot]).to(dev, non_blocking=True)
        x = logits[rows] / temps[:, None]
        x = _filter(x, [params[i].top_k for i in hot], [params[i].top_p for i in hot])
        probs = x.softmax(dim=-1)
        picks = []
        for j, i in enumerate(hot):  # exponential race: argmax p / E, one generator per seeded request
            e = torch.empty_like(probs[j]).exponential_(generator=generators[i])
            picks.append((probs[j] / e).argmax())
        out[rows] = torch.stack(picks)
    return out


def _filter(x: Tensor, top_k: list[int], top_p: list[float]) -> Tensor:
    """Mask logits outside each row's top-k and top-p (nucleus) sets with -inf; the best token always stays."""
    if all(k == 0 for k in top_k) and all(p >= 1.0 for p in top_p):
        return x
    sorted_x, order = x.sort(dim=-1, descending=True)
    V = x.shape[-1]
    ks = torch.tensor([k if k > 0 else V for k in top_k]).to(x.device, non_blocking=True)[:, None]
    drop = torch.arange(V, device=x.device)[None] >= ks
    probs = sorted_x.masked_fill(drop, float("-inf")).softmax(-1)
    before = probs.cumsum(-1) - probs  # mass strictly above each token
    drop |= before >= torch.tensor(top_p).to(x.device, non_blocking=True)[:, None]
    drop[:, 0] = False
    return x.scatter(-1, order, sorted_x.masked_fill(drop, float("-inf")))


__all__ = ["SamplingParams", "sample"]
