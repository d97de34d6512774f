"""Prometheus metrics of the server (``GET /metrics``), on a registry of their own per server.

Counters count what the server sees: requests accepted, rejected (4xx), failed (5xx), aborted by their client,
finished (by reason), prompt and generated tokens, engine step failures. Latency histograms: time to first token,
inter-token latency, end-to-end request time. The engine's own state is read at scrape time: its gauges
(``LLM.gauges()``: running/waiting requests, KV pool bytes and pages, bits per element, ...), its preemption
count (``oscarkv_preemptions_total``) and, for the OSCAR cache, the quantization monitor per layer.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

PREFIX = "oscarkv_"
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)
# Engine gauges that are running totals: exported as counters under these names.
_ENGINE_COUNTERS = {"preemptions": "preemptions"}


class ServeMetrics:
    """The server's counters and histograms plus a collector of the engine's state. The hooks ``accepted``,
    ``aborted``, ``step_error``, ``token`` and ``finished`` are called by :class:`~oscarkv.serve.loop.EngineLoop`
    (engine thread); ``error`` by the HTTP layer for every error response and failed stream."""

    def __init__(self):
        self.registry = CollectorRegistry(auto_describe=True)
        r, p = self.registry, PREFIX
        self.requests = Counter(p + "requests", "requests accepted by the engine", registry=r)
        self.rejected_requests = Counter(p + "requests_rejected", "requests refused as invalid (4xx)", registry=r)
        self.failed_requests = Counter(p + "requests_failed", "requests failed by a server fault (5xx)", registry=r)
        self.aborted_requests = Counter(p + "requests_aborted", "requests aborted because the client went away",
                                        registry=r)
        self.finished_choices = Counter(p + "requests_finished", "choices finished, by reason", ["finish_reason"],
                                        registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "prompt tokens of accepted requests", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "tokens generated", registry=r)
        self.step_errors = Counter(p + "engine_step_errors", "engine steps that raised", registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "arrival to first generated token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(p + "inter_token_latency_seconds", "between consecutive tokens of one choice",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(p + "request_latency_seconds", "arrival to last choice finished",
                             buckets=_LATENCY_BUCKETS, registry=r)

    def watch(self, loop: Any) -> None:
        """Export the engine state of ``loop`` (an :class:`EngineLoop`) at scrape time."""
        self.registry.register(_EngineCollector(loop.gauges, lambda: loop.llm.monitor, loop.health))

    # --------------------------------------------------------------------------------------- hooks
    def accepted(self, sub: Any) -> None:
        self.requests.inc()
        self.prompt_tokens.inc(len(sub.prompt) * len(sub.params))

    def error(self, status: int) -> None:
        (self.failed_requests if status >= 500 else self.rejected_requests).inc()

    def aborted(self) -> None:
        self.aborted_requests.inc()

    def step_error(self) -> None:
        self.step_errors.inc()

    def token(self, sub: Any, index: int) -> None:
        now = time.monotonic()
        self.generation_tokens.inc()
        if sub.first_token_at is None:
            sub.first_token_at = now
            self.ttft.observe(now - sub.created)
        last = sub.last_token_at[index]
        if last is not None:
            self.itl.observe(now - last)
        sub.last_token_at[index] = now

    def finished(self, sub: Any, completion: Any) -> None:
        self.finished_choices.labels(completion.finish_reason).inc()
        if all(seq.finish_reason is not None for seq in sub.seqs):
            self.e2e.observe(time.monotonic() - sub.created)


class _EngineCollector(Collector):
    def __init__(self, gauges: Callable[[], dict], monitor: Callable[[], Any], health: Callable[[], str | None]):
        self._gauges, self._monitor, self._health = gauges, monitor, health

    def describe(self) -> list[Metric]:
        return []  # the engine's gauges are known only at scrape time

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(PREFIX + "engine_healthy", "1 while the engine loop serves",
                                value=float(self._health() is None))
        for name, value in sorted(self._gauges().items()):
            if name in _ENGINE_COUNTERS:
                yield CounterMetricFamily(PREFIX + _ENGINE_COUNTERS[name], f"engine {name}", value=float(value))
            else:
                yield GaugeMetricFamily(PREFIX + name, f"engine gauge {name}", value=float(value))
        monitor = self._monitor()
        if monitor is None:
            return
        err, clipped, count = monitor.snapshot()
        for metric, table, doc in (("quant_rel_error", err, "relative error of sampled demotions"),
                                   ("quant_clipped_fraction", clipped, "fraction of elements the clip changed"),
                                   ("quant_samples", count, "demotions sampled")):
            family = GaugeMetricFamily(PREFIX + metric, doc, labels=["kv", "layer"])
            for which, kv in enumerate("kv"):
                for layer in range(table.shape[1]):
                    family.add_metric([kv, str(layer)], float(table[which, layer]))
            yield family


__all__ = ["PREFIX", "ServeMetrics"]
