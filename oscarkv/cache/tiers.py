"""The demotion rule: which tokens of a sequence sit in which tier. Pure functions.

This is the only definition of the tier rule: the transformers cache, the teacher-forced simulation, the engine and
the vLLM plugin all read it from here. A sequence of ``n`` tokens holds, in order:

* the **sink**: tokens ``[0, min(n, S))`` in 16-bit;
* the **quantized tier**: tokens ``[S, S + q(n))``;
* the **recent window**: the rest, in 16-bit.

``q(n) = U * max(0, floor((n - S - W) / U))`` with ``U`` the demotion unit (a page for OSCAR). Read
incrementally: new tokens enter the recent window, and when it reaches ``W + U`` tokens its oldest ``U`` are
quantized (so it holds ``W .. W + U - 1`` tokens once the sink is full). The count depends only on ``n``, never
on how the tokens arrived (one prefill, chunks, or one at a time), and nothing is ever re-quantized. ``U = 1``
with ``S = W = 0`` quantizes every token when it is written.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class TierPolicy:
    """Sink ``S``, recent window ``W`` and demotion unit ``U`` (tokens)."""

    sink: int
    window: int
    unit: int

    def __post_init__(self) -> None:
        for name in ("sink", "window"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an int >= 0, got {v!r}")
        if not isinstance(self.unit, int) or self.unit < 1:
            raise ValueError(f"unit must be an int >= 1, got {self.unit!r}")

    def quantized(self, n: int) -> int:
        """Tokens in the quantized tier of a sequence of ``n`` tokens."""
        return self.unit * max(0, (n - self.sink - self.window) // self.unit)

    def split(self, n: int) -> tuple[int, int, int]:
        """``(sink, quantized, recent)`` token counts for a sequence of ``n`` tokens (they sum to ``n``)."""
        s = min(n, self.sink)
        q = self.quantized(n)
        return s, q, n - s - q

    def quantized_t(self, n: Tensor) -> Tensor:
        """:meth:`quantized` elementwise on an integer tensor."""
        return self.unit * torch.clamp((n - self.sink - self.window) // self.unit, min=0)

    def quantized_positions(self, n: int) -> range:
        """Positions of the tokens in the quantized tier of a sequence of ``n`` tokens."""
        return range(self.sink, self.sink + self.quantized(n))

    @property
    def max_16bit(self) -> int:
        """Most tokens the 16-bit tiers ever hold for one sequence between appends."""
        return self.sink + self.window + self.unit - 1

    @property
    def capacity16(self) -> int:
        """16-bit rows a sequence needs when a step's token is stored before the step's demotion (a decode
        step writes its token into the recent window first, then demotes after the forward)."""
        return self.sink + self.window + self.unit

    @property
    def ring(self) -> int:
        """Rows of a ring that holds the recent window at every step (``window + unit``)."""
        return self.window + self.unit

    @property
    def windows(self) -> bool:
        """True when some tokens stay 16-bit (a sink or a recent window); False: every token is quantized."""
        return self.sink > 0 or self.window > 0


__all__ = ["TierPolicy"]
