"""The plugin's KV-cache figures and quantization monitors, as vLLM Prometheus metrics (``/metrics``).

Per worker process, labelled with its tensor-parallel ``rank``:

* ``oscar_kv_bytes_per_token{layer}``: bytes one token's K and V take in the layer's pages (codes and scales,
  this rank's KV heads);
* ``oscar_kv_tier_tokens{tier}``: the 16-bit tiers of a sequence, ``tier`` = ``sink`` or ``window``;
* ``oscar_kv_window_slots`` and ``oscar_kv_window_bytes``: sequences that hold 16-bit windows at once, and the
  bytes of their rings (every layer, K and V);
* ``oscar_kv_window_misses_total``: sequence steps read from the 2-bit pages only, for want of a window slot;
* ``oscar_kv_quant_rel_error{kv,layer}`` and ``oscar_kv_quant_clipped_fraction{kv,layer}``: running means over
  sampled page writes (:class:`~oscarkv.cache.monitor.QuantMonitor`), with ``oscar_kv_quant_samples_total``.

Page writes are sampled on eager attention calls (prefill chunks, mixed steps, eager decode steps), on a layer's
first call and every ``oscar.monitor_every``-th after it; a decode step replayed from a CUDA graph is not
sampled. Keys in channel pages are written when a page completes, so they are not sampled.

vLLM's workers run in processes of their own. Their metrics reach the server's ``/metrics`` through
prometheus_client's multiprocess mode: start ``vllm serve`` with ``PROMETHEUS_MULTIPROC_DIR`` set to an empty
folder. Without it they stay in each worker's own registry.
"""

from __future__ import annotations

import functools
import threading

import torch
from torch import Tensor

from ...cache.monitor import QuantMonitor
from ...kernels.layout import QuantPages
from ...kernels.reference import dequantize_pages_ref, rotate_rows_ref
from .core import LayerParams

MAX_SAMPLED_ROWS = 4096  # rows of one sampled write that are compared (bounds the cost of a long prefill chunk)


@functools.cache
def _metrics():
    """The metric families, created once per process (prometheus_client refuses a name registered twice)."""
    from prometheus_client import Counter, Gauge

    return {
        "bytes": Gauge("oscar_kv_bytes_per_token", "Bytes of one token's K and V in the layer's OSCAR pages",
                       ["rank", "layer"], multiprocess_mode="max"),
        "tier": Gauge("oscar_kv_tier_tokens", "Tokens of a sequence's 16-bit tiers", ["rank", "tier"],
                      multiprocess_mode="max"),
        "slots": Gauge("oscar_kv_window_slots", "Sequences that can hold 16-bit windows at once", ["rank"],
                       multiprocess_mode="max"),
        "window_bytes": Gauge("oscar_kv_window_bytes", "Bytes of the 16-bit window rings (all layers, K and V)",
                              ["rank"], multiprocess_mode="max"),
        "misses": Counter("oscar_kv_window_misses", "Sequence steps read without their 16-bit window", ["rank"]),
        "err": Gauge("oscar_kv_quant_rel_error", "Mean relative error of sampled page writes",
                     ["rank", "kv", "layer"], multiprocess_mode="mostrecent"),
        "clipped": Gauge("oscar_kv_quant_clipped_fraction", "Mean fraction of elements the clip changed",
                         ["rank", "kv", "layer"], multiprocess_mode="mostrecent"),
        "samples": Counter("oscar_kv_quant_samples", "Sampled page writes", ["rank", "kv", "layer"]),
    }


class PluginMonitor:
    """One process's figures and quantization monitor (:func:`monitor` gives the process's instance)."""

    def __init__(self, rank: int, num_layers: int, every: int):
        self.rank, self.every = str(rank), every
        self.quant = QuantMonitor(num_layers, every=0)  # sampling is decided per layer here, not per call
        self.calls = [0] * num_layers
        self.window_bytes: dict[int, int] = {}  # layer -> bytes of its rings
        self.lock = threading.Lock()

    def set_layer(self, layer: int, bytes_per_token: float, window_bytes: int) -> None:
        m = _metrics()
        m["bytes"].labels(self.rank, str(layer)).set(bytes_per_token)
        with self.lock:
            self.window_bytes[layer] = window_bytes
            total = sum(self.window_bytes.values())
        m["window_bytes"].labels(self.rank).set(total)

    def set_tiers(self, sink: int, window: int, slots: int) -> None:
        m = _metrics()
        m["tier"].labels(self.rank, "sink").set(sink)
        m["tier"].labels(self.rank, "window").set(window)
        m["slots"].labels(self.rank).set(slots)

    def window_misses(self, n: int) -> None:
        if n > 0:
            _metrics()["misses"].labels(self.rank).inc(n)

    def due(self, layer: int) -> bool:
        """Whether this eager call of ``layer`` is sampled (its first, then every ``every``-th); counts it."""
        if self.every <= 0 or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
            return False
        self.calls[layer] += 1
        return self.calls[layer] % self.every == 1 % self.every

    def observe(self, layer: int, p: LayerParams, kv: tuple[QuantPages, QuantPages], key: Tensor, value: Tensor,
                slot_mapping: Tensor) -> None:
        """Compare the rows a step wrote into ``layer``'s pages with what the pages now hold. ``key``/``value``
        ``[T, Hkv, d]`` as the layer received them, ``slot_mapping`` int64 ``[T]`` (``page * page_size + row``,
        -1 for padding). Syncs the device."""
        keep = torch.nonzero(slot_mapping[: key.shape[0]] >= 0).flatten()[:MAX_SAMPLED_ROWS]
        if not keep.numel():
            return
        slots = slot_mapping[keep].long()
        m = _metrics()
        for which, (x, pages, r, mu, clip) in enumerate(((key, kv[0], p.r_k, p.mu_k, p.k_clip),
                                                         (value, kv[1], p.r_v, p.mu_v, p.v_clip))):
            if pages.fmt.channel:
                continue
            P = pages.fmt.page_size
            rows = rotate_rows_ref(x[keep], r, mu).to(p.dtype16).float()  # the 16-bit rows the write quantized
            ids, inverse = torch.unique(slots // P, return_inverse=True)
            deq = dequantize_pages_ref(pages, ids)[inverse, :, slots % P]  # [n, Hkv, d]
            self.quant.record(layer, which, rows, deq, clip)
            err, clipped, count = self.quant.snapshot()
            labels = (self.rank, "kv"[which], str(layer))
            m["err"].labels(*labels).set(float(err[which, layer]))
            m["clipped"].labels(*labels).set(float(clipped[which, layer]))
            m["samples"].labels(*labels).inc()


_MONITORS: dict[int, PluginMonitor] = {}


def monitor(rank: int, num_layers: int, every: int) -> PluginMonitor:
    """This process's monitor for tensor-parallel ``rank`` (created on first use)."""
    if rank not in _MONITORS:
        _MONITORS[rank] = PluginMonitor(rank, num_layers, every)
    return _MONITORS[rank]


__all__ = ["MAX_SAMPLED_ROWS", "PluginMonitor", "monitor"]
