"""A request as the engine tracks it."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .sampling import SamplingParams

_ids = itertools.count()

FINISH_REASONS = ("stop", "length", "abort", "error")


@dataclass(eq=False)
class Sequence:
    """One request. ``finish_reason``: None while running, else "stop", "length", "abort" (cancelled) or "error"
    (the engine failed on this request; ``error`` says why: a server reports it as a 5xx)."""

    prompt: list[int]
    params: SamplingParams
    on_token: Callable[[Sequence, int], None] | None = None
    id: int = field(default_factory=lambda: next(_ids))
    out: list[int] = field(default_factory=list)
    slot: int = -1
    n_cached: int = 0  # tokens whose K/V are in the store
    in_prefill: bool = False
    finish_reason: str | None = None
    error: str | None = None
    preemptions: int = 0
    arrival: float = field(default_factory=time.monotonic)
    generator: torch.Generator | None = None
    in_flight: int = 0  # decode steps launched for this request whose token the host has not read yet

    @property
    def tokens(self) -> list[int]:
        """Prompt and output tokens (a new list: O(length); :attr:`num_tokens` for the count)."""
        return self.prompt + self.out

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.out)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


__all__ = ["FINISH_REASONS", "Sequence"]
