"""Sequences, the continuous-batching scheduler and the model runner (CUDA graphs for decode).

One ``Engine.step()``: admit waiting requests while slots and pages allow (a request is admitted only when
pages for its whole prompt are free), run up to ``prefill_chunk`` prompt tokens (chunked prefill), then one
decode step for every sequence whose prompt is done. When a decode step needs a page and none is free, the
newest running sequence is preempted (its pages freed, its tokens re-prefilled when it is resumed).
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

from .attention import DecodeCtx, PrefillCtx
from .kv import KVPool, OscarPool
from .sampling import SamplingParams, sample

_ids = itertools.count()


@dataclass
class Sequence:
    prompt: list[int]
    params: SamplingParams
    on_token: Callable[["Sequence", int], None] | None = None
    id: int = field(default_factory=lambda: next(_ids))
    out: list[int] = field(default_factory=list)
    slot: int = -1
    pages: list[int] = field(default_factory=list)
    n_cached: int = 0  # tokens whose K/V are in the pool
    in_prefill: bool = False
    finish_reason: str | None = None
    preemptions: int = 0
    arrival: float = field(default_factory=time.monotonic)
    generator: torch.Generator | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.out



class Engine:
    """Scheduler + runner over one model and one pool. Not thread-safe: drive it from one thread."""

    def __init__(self, model: torch.nn.Module, pool: KVPool, *, eos_ids: tuple[int, ...] = (),
                 max_model_len: int, prefill_chunk: int = 2048, cuda_graphs: bool = True,
                 graph_sizes: tuple[int, ...] | None = None):
        self.model, self.pool = model, pool
        self.eos_ids, self.max_model_len, self.prefill_chunk = set(eos_ids), max_model_len, prefill_chunk
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # index == slot
        self.sm_scale = model.cfg.head_dim ** -0.5
        self.stats = {"preemptions": 0, "prompt_tokens": 0, "generated_tokens": 0, "steps": 0}
        self.detok: Callable[[Sequence], bool] | None = None  # stop-string check, set by the LLM wrapper
        self.graphs: dict[int, tuple] = {}
        self.ctxs: dict[int, DecodeCtx] = {}
        self._cuda_graphs = cuda_graphs and pool.device.type == "cuda" and self._graph_safe()
        sizes = graph_sizes or tuple(s for s in (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
                                     if s <= pool.max_slots)
        self.graph_sizes = sorted(set(sizes) | {pool.max_slots})

    # ------------------------------------------------------------------------------------- requests
    def add(self, seq: Sequence) -> None:
        """Queue a request; raises ``ValueError`` for one that can never fit."""
        n = len(seq.prompt)
        if n == 0:
            raise ValueError("the prompt is empty")
        if n >= self.max_model_len:
            raise ValueError(f"the prompt has {n} tokens; this engine's max_model_len is {self.max_model_len}")
        total = min(n + seq.params.max_tokens, self.max_model_len)
        need, cap = self.pool.cfg.pages_for(total), self.pool.alloc.capacity
        if need > cap:
            raise ValueError(f"request needs {need} KV pages for {total} tokens but the whole pool holds {cap}; "
                             "raise kv_budget_gb or lower max_tokens")
        if seq.params.seed is not None:
            seq.generator = torch.Generator(device=self.pool.device).manual_seed(seq.params.seed)
        self.waiting.append(seq)

    def abort(self, seq_id: int) -> bool:
        for seq in list(self.waiting):
            if seq.id == seq_id:
                self.waiting.remove(seq)
                seq.finish_reason = "abort"
                return True
        for seq in self.running:
            if seq.id == seq_id:
                self._finish(seq, "abort")
                return True
        return False

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------------------------ scheduling
    def _admit(self) -> None:
        pool = self.pool
        while self.waiting and len(self.running) < pool.max_slots:
            seq = self.waiting[0]
            need = pool.cfg.pages_for(len(seq.tokens))
            if need > pool.alloc.num_free:
                break
            self.waiting.popleft()
            seq.slot, seq.n_cached, seq.in_prefill = len(self.running), 0, True
            seq.pages = pool.alloc.allocate(need)
            pool.set_pages(seq.slot, 0, seq.pages)
            self.running.append(seq)

    def _release(self, seq: Sequence) -> None:
        """Free a running sequence's pages and slot, moving the top slot down to keep slots compact."""
        pool, s = self.pool, seq.slot
        pool.alloc.free(seq.pages)
        seq.pages, seq.slot, seq.n_cached = [], -1, 0
        last = self.running.pop()
        if last is not seq:
            self.running[s] = last
            pool.move_slot(last.slot, s)
            last.slot = s
        else:
            pool.clear_slot(s)

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        self._release(seq)

    def _preempt_for(self, seq: Sequence, pages: int) -> bool:
        """Free pages by preempting the newest sequences; False if ``seq`` itself was preempted."""
        while self.pool.alloc.num_free < pages:
            victim = self.running[-1]
            self._release(victim)
            victim.preemptions += 1
            self.stats["preemptions"] += 1
            self.waiting.appendleft(victim)
            if victim is seq:
                return False
        return True

    def _grow(self, seq: Sequence, n: int) -> bool:
        """Make sure ``seq`` has pages for ``n`` tokens (preempting others if needed)."""
        extra = self.pool.cfg.pages_for(n) - len(seq.pages)
        if extra <= 0:
            return True
        if not self._preempt_for(seq, extra):
            return False
        new = self.pool.alloc.allocate(extra)
        self.pool.set_pages(seq.slot, len(seq.pages), new)
        seq.pages += new
        return True

    # ------------------------------------------------------------------------------------------ step
    @torch.inference_mode()
    def step(self) -> list[Sequence]:
        """One scheduling step; returns the sequences that finished in it."""
        self._admit()
        done: list[Sequence] = []
        budget = self.prefill_chunk
        for seq in list(self.running):
            if budget <= 0 or seq.slot < 0 or not seq.in_prefill:
                continue
            n_all = len(seq.tokens)
            n1 = min(n_all, seq.n_cached + budget)
            budget -= n1 - seq.n_cached
            logits = self._prefill(seq, seq.n_cached, n1)
            if n1 == n_all:
                seq.in_prefill = False
                self._emit(seq, logits, done)
        ready = [s for s in self.running if not s.in_prefill]
        if ready:
            self._decode(ready, done)
        self.stats["steps"] += 1
        return done

    def _emit(self, seq: Sequence, logits: Tensor, done: list[Sequence]) -> None:
        tok = sample(logits[None], [seq.params], [seq.generator])[0]
        self._append(seq, tok, done)

    def _append(self, seq: Sequence, tok: int, done: list[Sequence]) -> None:
        seq.out.append(tok)
        self.stats["generated_tokens"] += 1
        p = seq.params
        reason = None
        if (tok in self.eos_ids and not p.ignore_eos) or tok in p.stop_token_ids:
            reason = "stop"
        elif self.detok is not None and p.stop and self.detok(seq):
            reason = "stop"
        elif len(seq.out) >= p.max_tokens or len(seq.tokens) >= self.max_model_len:
            reason = "length"
        if seq.on_token is not None:
            seq.on_token(seq, tok)
        if reason:
            self._finish(seq, reason)
            done.append(seq)

    def _prefill(self, seq: Sequence, n0: int, n1: int) -> Tensor:
        pool = self.pool
        if isinstance(pool, OscarPool):  # pages for this chunk's demotions were allocated at admission
            q0, q1 = pool.qlens[seq.slot], pool.cfg.qlen(n1)
            P = pool.cfg.page_size
            new_pages = seq.pages[q0 // P: q1 // P]
        else:
            new_pages = []
        ctx = PrefillCtx(pool, seq.slot, n0, n1, self.sm_scale, new_pages)
        dev = pool.device
        tokens = torch.tensor(seq.tokens[n0:n1], device=dev)
        positions = torch.arange(n0, n1, device=dev)
        last = torch.tensor([n1 - n0 - 1], device=dev)
        logits = self.model(tokens, positions, ctx, last)[0]
        pool.lens[seq.slot] = n1
        if isinstance(pool, OscarPool):
            pool.qlens[seq.slot] = ctx.q1
        seq.n_cached = n1
        self.stats["prompt_tokens"] += n1 - n0
        return logits

    def _decode(self, ready: list[Sequence], done: list[Sequence]) -> None:
        pool = self.pool
        for seq in list(ready):  # capacity for one more token each, preempting the newest if needed
            if seq.slot >= 0:
                self._grow(seq, seq.n_cached + 1)
        ready = [s for s in ready if s.slot >= 0]
        if not ready:
            return
        bs = next(s for s in self.graph_sizes if s >= len(self.running))
        ctx = self._ctx(bs)
        rows = self._rows(ready, bs)
        ctx.fill(*rows)
        logits = self._run_decode(ctx, bs)
        for seq in ready:
            pool.lens[seq.slot] = seq.n_cached + 1
            seq.n_cached += 1
        if isinstance(pool, OscarPool):
            self._demote(ready)
        toks = sample(logits[[s.slot for s in ready]], [s.params for s in ready], [s.generator for s in ready])
        for seq, tok in zip(ready, toks):
            self._append(seq, tok, done)

    def _demote(self, ready: list[Sequence]) -> None:
        pool = self.pool
        P = pool.cfg.page_size
        slots, pages = [], []
        for seq in ready:
            q0, q1 = pool.qlens[seq.slot], pool.cfg.qlen(seq.n_cached)
            if q1 > q0:
                slots.append(seq.slot)
                pages.append(seq.pages[q0 // P: q1 // P])
        if slots:
            pool.demote(slots, pages)

    def _rows(self, ready: list[Sequence], bs: int) -> tuple[list[int], ...]:
        """Host metadata for slots ``[0, bs)``; rows that do not decode write to scratch and attend to nothing."""
        pool = self.pool
        P = pool.cfg.page_size
        scratch = pool.cfg.c16 if isinstance(pool, OscarPool) else 0
        tokens, pos, widx, lens, qlen = [0] * bs, [0] * bs, [scratch] * bs, [0] * bs, [0] * bs
        for seq in ready:
            s, n = seq.slot, seq.n_cached
            tokens[s], pos[s] = seq.tokens[n], n
            if isinstance(pool, OscarPool):
                qlen[s] = pool.qlens[s]
                widx[s] = n - qlen[s]
                lens[s] = widx[s] + 1
            else:
                widx[s] = seq.pages[n // P] * P + n % P
                lens[s] = n + 1
        return tokens, pos, widx, lens, qlen

    # ------------------------------------------------------------------------------------ CUDA graphs
    def _graph_safe(self) -> bool:
        if not isinstance(self.pool, OscarPool):
            return True
        from .attention import _triton_decode  # noqa: PLC0415

        return _triton_decode() is not None

    def _ctx(self, bs: int) -> DecodeCtx:
        if bs not in self.ctxs:
            self.ctxs[bs] = DecodeCtx(self.pool, bs, self.sm_scale)
        return self.ctxs[bs]

    def _forward(self, ctx: DecodeCtx) -> Tensor:
        return self.model(ctx.tokens, ctx.positions, ctx)

    def _run_decode(self, ctx: DecodeCtx, bs: int) -> Tensor:
        if not self._cuda_graphs:
            return self._forward(ctx)
        if bs not in self.graphs:
            self.capture(bs)
        graph, out = self.graphs[bs]
        graph.replay()
        return out

    def capture(self, bs: int) -> None:
        """Capture the decode step for batch size ``bs`` (inputs are the static tensors of its context)."""
        ctx = self._ctx(bs)
        pool_mem = next(iter(self.graphs.values()))[0].pool() if self.graphs else None
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                self._forward(ctx)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool_mem):
            out = self._forward(ctx)
        self.graphs[bs] = (graph, out)


__all__ = ["Engine", "Sequence"]
