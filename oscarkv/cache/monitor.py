"""Quantization-effectiveness monitor: how well the quantized pages hold the rows written into them.

Per (K/V, layer), running means over sampled writes of the relative error ``||x - deq(q(x))|| / ||x||`` (after
centering and rotation, before clipping) and of the fraction of elements the clip changed. A calibration that no
longer fits the traffic shows up as a rising error or clipped fraction. Used by the engine's store
(:mod:`oscarkv.cache.paged`) and by the vLLM plugin; recording syncs the device, so callers sample.
"""

from __future__ import annotations

import threading

import torch
from torch import Tensor

from ..quant import clip_rows


class QuantMonitor:
    """Running means per (K/V, layer) of the relative error and the clipped fraction of sampled demotions.

    The store asks :meth:`sample` once per demotion and, when it says yes, hands every layer's demoted rows to
    :meth:`record`."""

    def __init__(self, num_layers: int, every: int = 4):
        self.every, self.calls = every, 0
        self.err = torch.zeros(2, num_layers, dtype=torch.float64)
        self.clipped = torch.zeros(2, num_layers, dtype=torch.float64)
        self.count = torch.zeros(2, num_layers, dtype=torch.float64)
        self.lock = threading.Lock()

    def sample(self) -> bool:
        self.calls += 1
        return self.every > 0 and self.calls % self.every == 0

    def record(self, layer: int, which: int, x: Tensor, deq: Tensor, clip: float) -> None:
        """Rows ``x`` (float32, centered and rotated, before clipping) and what the pages now hold ``deq``."""
        err = float((x - deq).pow(2).sum() / x.pow(2).sum().clamp_min(1e-30)) ** 0.5
        clipped = float((clip_rows(x, clip) != x).float().mean()) if clip > 0 else 0.0
        with self.lock:
            self.err[which, layer] += err
            self.clipped[which, layer] += clipped
            self.count[which, layer] += 1

    def snapshot(self) -> tuple[Tensor, Tensor, Tensor]:
        with self.lock:
            n = self.count.clamp_min(1)
            return self.err / n, self.clipped / n, self.count.clone()


__all__ = ["QuantMonitor"]
