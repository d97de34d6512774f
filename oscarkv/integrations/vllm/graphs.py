"""CUDA graphs for the backend's decode-only steps (no vLLM import).

An eager vLLM step issues each layer's attention op by op; on the H200 machine that host work (~1.2-1.4 ms per
layer for the 7 launches of :func:`.core.quant_step`'s decode path, Python dominated) exceeds the GPU's 0.34 ms
(a layer probe, git 3106180). So a decode-only step is padded to a bucket of batch sizes, its metadata copied
into persistent buffers (:class:`StaticDecode`, once per step), and each layer replays a graph captured for that
bucket (:class:`LayerGraphs`): per layer the host then copies q/k/v in, replays, and copies the output out.

Padded rows are inert: no 2-bit slot (``slot_mapping = -1`` and, for channel-page layers, page slots ``-1``: the
quantize kernel skips them), ring writes and 16-bit reads on the pool's trash row, no 2-bit tokens (``qlen = 0``),
so they write nothing a real row reads.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch
from torch import Tensor

from ...kernels.plan import DecodePlan
from .core import StepMeta

logger = logging.getLogger("vllm.oscarkv")
BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 64, 80, 96, 128, 160, 192, 256, 320, 384, 448, 512)


def bucket_for(batch: int, max_seqs: int) -> int:
    """The smallest bucket holding ``batch`` rows (at most ``max_seqs``, itself the last bucket)."""
    return min([b for b in BUCKETS if batch <= b < max_seqs] + [max_seqs])


class StaticDecode:
    """Persistent metadata of decode-only steps, sized for ``max_seqs`` rows; :meth:`fill` pads one step."""

    def __init__(self, max_seqs: int, width: int, rows16: int, trash_row: int, plan: DecodePlan,
                 device: torch.device, page_size: int = 0):
        self.max_seqs, self.width, self.trash, self.plan = max_seqs, width, trash_row, plan
        self.P = page_size  # > 0: each decode row may complete one page (channel-page layers write it whole)
        M = max_seqs * page_size
        self.page_slots = torch.full((M,), -1, dtype=torch.int64, device=device)
        self.page_new = torch.zeros(M, dtype=torch.int64, device=device)
        self.page_ring = torch.full((M,), trash_row, dtype=torch.int64, device=device)
        self.page_from_new = torch.zeros(M, dtype=torch.bool, device=device)
        self.slot_mapping = torch.full((max_seqs,), -1, dtype=torch.int64, device=device)
        self.qlen = torch.zeros(max_seqs, dtype=torch.int32, device=device)
        self.len16 = torch.zeros(max_seqs, dtype=torch.int32, device=device)
        self.gather = torch.full((max_seqs, rows16), trash_row, dtype=torch.int64, device=device)
        self.ring_rows = torch.full((max_seqs,), trash_row, dtype=torch.int64, device=device)
        self.bt2 = torch.zeros((max_seqs, width), dtype=torch.int32, device=device)

    def fill(self, m: StepMeta, rows: int | None = None) -> StepMeta:
        """``m`` (decode rows only, windows on) padded to ``rows`` (vLLM's full-graph capture size) or else its
        bucket, in the persistent buffers."""
        B = m.num_tokens
        n = bucket_for(B, self.max_seqs) if rows is None else rows
        w = m.bt2.shape[1]
        if not B <= n <= self.max_seqs or w > self.width or m.ring_rows is None:
            raise ValueError(f"step of {B} rows / {w} pages does not fit the graph buffers "
                             f"({self.max_seqs} rows / {self.width} pages) or has no windows")
        for buf, src, pad in ((self.slot_mapping, m.slot_mapping, -1), (self.qlen, m.qlen, 0),
                              (self.len16, m.len16, 0), (self.ring_rows, m.ring_rows, self.trash),
                              (self.gather, m.gather, self.trash)):
            buf[:B].copy_(src[:B])
            if n > B:
                buf[B:n].fill_(pad)
        self.bt2[:B, :w].copy_(m.bt2[:B])
        if n > B:
            self.bt2[B:n].zero_()
        pages = {}
        if self.P:
            for buf, src, pad in ((self.page_slots, m.page_slots, -1), (self.page_new, m.page_new, 0),
                                  (self.page_ring, m.page_ring, self.trash), (self.page_from_new, m.page_from_new, 0)):
                buf[:B * self.P].copy_(src[:B * self.P])
                buf[B * self.P:n * self.P].fill_(pad)
            pages = dict(page_slots=self.page_slots[:n * self.P], page_new=self.page_new[:n * self.P],
                         page_ring=self.page_ring[:n * self.P], page_from_new=self.page_from_new[:n * self.P])
        # the split geometry depends only on the bucket (the table's capacity, not this step's longest row), so
        # a graph captured for the bucket stays valid at every step
        plan = self.plan.update(n)
        return replace(m, num_tokens=n, num_decodes=n, slot_mapping=self.slot_mapping[:n], qlen=self.qlen[:n],
                       len16=self.len16[:n], gather=self.gather[:n], ring_rows=self.ring_rows[:n],
                       bt2=self.bt2[:n], plan=plan, graph_rows=B, **pages)


class SharedInputs:
    """Static q/k/v/output buffers per bucket, shared by every layer's graphs (layers replay one after another),
    and one memory pool for all of their captures."""

    def __init__(self):
        self.pool = None
        self.bufs: dict[tuple, tuple[Tensor, Tensor, Tensor, Tensor]] = {}
        self.failed = False

    def get(self, n: int, q: Tensor, k: Tensor, v: Tensor, out: Tensor):
        key = (n, q.shape[1:], k.shape[1:], q.dtype, k.dtype, out.dtype, q.device)
        if key not in self.bufs:
            self.bufs[key] = (q.new_zeros((n, *q.shape[1:])), k.new_zeros((n, *k.shape[1:])),
                              v.new_zeros((n, *v.shape[1:])), out.new_zeros((n, *out.shape[1:])))
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        return self.bufs[key]


class LayerGraphs:
    """One layer's captured decode steps, by bucket. ``run`` falls back to eager (and stops trying, process-wide)
    if a capture fails, with a warning: graphs are a speed-up, never a reason to fail a request."""

    def __init__(self, shared: SharedInputs):
        self.shared = shared
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}

    def run(self, m: StepMeta, q: Tensor, k: Tensor, v: Tensor, out: Tensor, step) -> Tensor:
        """``step(q, k, v, m, out)`` for the padded step ``m`` (``m.graph_rows`` real rows first); ``q/k/v/out``
        hold the real rows. Returns ``out``."""
        B, n = m.graph_rows, m.num_tokens
        if self.shared.failed:
            return step(q, k, v, replace(m, **_unpadded(m, B)), out)
        qs, ks, vs, os_ = self.shared.get(n, q, k, v, out)
        qs[:B].copy_(q)
        ks[:B].copy_(k)
        vs[:B].copy_(v)
        key = (n, q.dtype, out.dtype)
        g = self.graphs.get(key)
        if g is None:
            step(qs, ks, vs, m, os_)  # eager first: loads kernels, and writes this step (the replay rewrites it)
            try:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self.shared.pool, capture_error_mode="thread_local"):
                    step(qs, ks, vs, m, os_)
            except Exception as e:  # noqa: BLE001 - logged; eager from now on
                self.shared.failed = True
                logger.warning("OSCAR: CUDA-graph capture of the decode step failed (%s: %s); running eagerly",
                               type(e).__name__, str(e)[:300])
                out.copy_(os_[:B])
                return out
            self.graphs[key] = g
        g.replay()
        out.copy_(os_[:B])
        return out


def _unpadded(m: StepMeta, B: int) -> dict:
    out = dict(num_tokens=B, num_decodes=B, slot_mapping=m.slot_mapping[:B], qlen=m.qlen[:B], len16=m.len16[:B],
               gather=m.gather[:B], ring_rows=m.ring_rows[:B], bt2=m.bt2[:B], graph_rows=0,
               plan=None)  # the bucket's plan has another batch: the kernel plans this call itself
    if m.page_slots is not None:
        M = m.page_slots.shape[0] // m.num_tokens * B  # decode rows: the same number of page tokens each
        out.update(page_slots=m.page_slots[:M], page_new=m.page_new[:M], page_ring=m.page_ring[:M],
                   page_from_new=m.page_from_new[:M])
    return out


__all__ = ["BUCKETS", "LayerGraphs", "SharedInputs", "StaticDecode", "bucket_for"]
