"""Engine counters and quantization-effectiveness monitors, rendered in the Prometheus text format.

The monitors sample demotions (every ``every``-th call of the pool's quantizer): per layer, the relative error
``||x - deq(q(x))|| / ||x||`` of the demoted rows (after centering and rotation, before clipping) and the
fraction of elements the clip changed. A calibration that no longer fits the traffic shows up as a rising
error or clipped fraction. Monitoring syncs the device on sampled demotions only.
"""

from __future__ import annotations

import threading
import time

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


class Metrics:
    """Thread-safe counters of the serving loop."""

    def __init__(self):
        self.lock = threading.Lock()
        self.counters = {"requests_total": 0.0, "requests_finished_total": 0.0, "requests_aborted_total": 0.0,
                         "requests_rejected_total": 0.0, "requests_failed_total": 0.0, "prompt_tokens_total": 0.0,
                         "generation_tokens_total": 0.0,
                         "preemptions_total": 0.0}
        self.start = time.monotonic()
        self._window: list[tuple[float, int]] = []  # (time, generated tokens) for the tokens/s gauge

    def inc(self, name: str, value: float = 1.0) -> None:
        with self.lock:
            self.counters[name] += value

    def tokens_per_s(self, generated: int, horizon: float = 10.0) -> float:
        now = time.monotonic()
        with self.lock:
            self._window.append((now, generated))
            self._window = [(t, g) for t, g in self._window if now - t <= horizon]
            (t0, g0), (t1, g1) = self._window[0], self._window[-1]
        return (g1 - g0) / (t1 - t0) if t1 > t0 else 0.0


def render(metrics: Metrics, gauges: dict[str, float], monitor: QuantMonitor | None) -> str:
    """Prometheus exposition text (version 0.0.4)."""
    lines = []
    with metrics.lock:
        counters = dict(metrics.counters)
    for name, value in counters.items():
        lines += [f"# TYPE oscarkv_{name} counter", f"oscarkv_{name} {value:g}"]
    for name, value in gauges.items():
        lines += [f"# TYPE oscarkv_{name} gauge", f"oscarkv_{name} {value:g}"]
    if monitor is not None:
        err, clipped, count = monitor.snapshot()
        for metric, table in (("quant_rel_error", err), ("quant_clipped_fraction", clipped),
                              ("quant_samples", count)):
            lines.append(f"# TYPE oscarkv_{metric} gauge")
            for which, kv in enumerate("kv"):
                for layer in range(table.shape[1]):
                    lines.append(f'oscarkv_{metric}{{kv="{kv}",layer="{layer}"}} {float(table[which, layer]):g}')
    return "\n".join(lines) + "\n"


__all__ = ["QuantMonitor", "Metrics", "render"]
