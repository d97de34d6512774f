"""Thread-safe counters of the engine's serving loop (requests, tokens, preemptions); :mod:`oscarkv.serve`
exposes them with the quantization monitor (:mod:`oscarkv.cache.monitor`) in Prometheus's format."""

from __future__ import annotations

import threading
import time


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


__all__ = ["Metrics"]
