"""The model runner: one prefill chunk or one decode batch through the model, CUDA graphs for decode.

A decode batch of ``bs`` rows covers slots ``[0, bs)``; rows whose slot does not decode in this call are padding
(they write to the 16-bit scratch column or page 0 and attend to nothing), so any subset of the running
sequences can run through the graph captured for ``bs``.

A decode reads each slot's input token from ``next_tokens`` (int64 ``[num_slots]``, on the device), which the
engine's sampling writes on the device: launching a step needs no token from the host, so the host can launch
step N+1 before it has read step N's tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..cache import Paged16Store, PagedStore
from .attention import DecodeCtx, KeyRotation, PrefillCtx
from .sequence import Sequence

GRAPH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, store: PagedStore | Paged16Store, *, rotation: KeyRotation | None,
                 cuda_graphs: bool, max_num_seqs: int):
        self.model, self.store, self.rotation = model, store, rotation
        self.sm_scale = model.cfg.head_dim ** -0.5
        self.oscar = isinstance(store, PagedStore)
        self.ctxs: dict[int, DecodeCtx] = {}
        self.next_tokens = torch.zeros(store.num_slots, dtype=torch.long, device=store.device)
        self.graphs: dict[int, tuple] = {}
        self.cuda_graphs = cuda_graphs and store.device.type == "cuda"
        sizes = tuple(s for s in GRAPH_SIZES if s <= max_num_seqs)
        self.graph_sizes = sorted(set(sizes) | {max_num_seqs})

    def batch_size(self, rows: int) -> int:
        """The decode batch (graph) size that covers slots ``[0, rows)``."""
        return next(s for s in self.graph_sizes if s >= rows)

    # ----------------------------------------------------------------------------------------- prefill
    def prefill(self, seq: Sequence, n0: int, n1: int) -> Tensor:
        """Run tokens ``[n0, n1)`` of ``seq`` (its pages already reserved) and write them into the store, every
        layer; returns the last token's logits ``[vocab]`` (float32). The caller commits the store."""
        dev = self.store.device
        ctx = PrefillCtx(self.store, seq.slot, n0, n1, self.sm_scale, self.rotation)
        tokens = torch.tensor(seq.tokens[n0:n1]).to(dev, non_blocking=True)
        positions = torch.arange(n0, n1, device=dev)
        last = torch.tensor([n1 - n0 - 1]).to(dev, non_blocking=True)
        return self.model(tokens, positions, ctx, last)[0]

    # ------------------------------------------------------------------------------------------ decode
    def set_next_token(self, slot: int, token: int) -> None:
        """The input token of ``slot``'s next decode, from the host (after a prefill sampled it there)."""
        self.next_tokens[slot: slot + 1].fill_(token)

    def move_slot(self, src: int, dst: int) -> None:
        """Follow the scheduler moving a sequence from slot ``src`` to ``dst``."""
        self.next_tokens[dst: dst + 1].copy_(self.next_tokens[src: src + 1])

    def decode(self, seqs: list[Sequence], bs: int) -> Tensor:
        """One token for each of ``seqs`` (slots below ``bs``; inputs from :attr:`next_tokens`): logits
        ``[bs, vocab]`` indexed by slot. Writes only each row's own new-token slot in the store; the caller commits
        (and demotes) after success. Does not wait for the device."""
        ctx = self._ctx(bs)
        ctx.fill(*self._rows(seqs, bs))
        if not self.cuda_graphs:
            return self._forward(ctx)
        if bs not in self.graphs:
            self.capture(bs)
        graph, out = self.graphs[bs]
        graph.replay()
        return out

    def _rows(self, seqs: list[Sequence], bs: int) -> tuple[list[int], ...]:
        """Host metadata for slots ``[0, bs)``; rows that do not decode write to scratch and attend to nothing."""
        st = self.store
        scratch = st.c16 if self.oscar else 0
        pos, widx, lens, qlen = [0] * bs, [scratch] * bs, [0] * bs, [0] * bs
        for seq in seqs:
            s, n = seq.slot, seq.n_cached
            pos[s] = n
            if self.oscar:
                qlen[s] = st.qlens[s]
                widx[s] = st.decode_row(s)
                lens[s] = widx[s] + 1
            else:
                P = st.page_size
                widx[s] = st.table.pages[s][n // P] * P + n % P
                lens[s] = n + 1
        return pos, widx, lens, qlen

    def _ctx(self, bs: int) -> DecodeCtx:
        if bs not in self.ctxs:
            self.ctxs[bs] = DecodeCtx(self.store, bs, self.sm_scale, self.rotation, self.model.cfg.num_heads,
                                      tokens=self.next_tokens)
        return self.ctxs[bs]

    def _forward(self, ctx: DecodeCtx) -> Tensor:
        return self.model(ctx.tokens, ctx.positions, ctx)

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


__all__ = ["GRAPH_SIZES", "ModelRunner"]
