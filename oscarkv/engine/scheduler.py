"""Continuous batching: which requests run, which prompt tokens a step prefills, who is preempted.

Running sequences occupy slots ``[0, n)`` (``running[i].slot == i``): a finished one is replaced by the top slot,
so a decode batch is a prefix of the slots and a CUDA graph for batch size ``bs >= n`` serves it. A request is
admitted when a slot and pages for its whole current token list are free; up to ``prefill_chunk`` prompt tokens
run per step. When a decode step needs a page and none is free, the newest running sequence is preempted (pages
freed, re-prefilled from its prompt plus generated tokens when resumed).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from ..cache import Paged16Store, PagedStore
from .block_manager import BlockManager
from .sequence import Sequence


class Scheduler:
    def __init__(self, store: PagedStore | Paged16Store, blocks: BlockManager, max_num_seqs: int,
                 prefill_chunk: int, on_move: Callable[[int, int], None] | None = None):
        """``on_move(src, dst)``: called when a sequence moves from slot ``src`` to ``dst`` (after the store moved
        it), for per-slot state kept outside the store."""
        self.store, self.blocks, self.on_move = store, blocks, on_move
        self.max_num_seqs, self.prefill_chunk = max_num_seqs, prefill_chunk
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # index == slot
        self.preemptions = 0

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def admit(self) -> None:
        """Move waiting requests into free slots while pages for their whole token list are free."""
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            n = seq.num_tokens
            if self.blocks.pages_for(n) > self.blocks.num_free:
                break
            self.waiting.popleft()
            seq.slot, seq.n_cached, seq.in_prefill = len(self.running), 0, True
            self.running.append(seq)
            self.blocks.allocate(seq, n)

    def release(self, seq: Sequence) -> None:
        """Free a running sequence's pages and slot, moving the top slot down to keep slots compact."""
        s = seq.slot
        self.blocks.free(seq)
        seq.slot, seq.n_cached = -1, 0
        last = self.running.pop()
        if last is not seq:
            self.running[s] = last
            self.store.move(last.slot, s)
            if self.on_move is not None:
                self.on_move(last.slot, s)
            last.slot = s

    def remove_waiting(self, seq: Sequence) -> bool:
        if seq in self.waiting:
            self.waiting.remove(seq)
            return True
        return False

    def _preempt_for(self, seq: Sequence, pages: int) -> bool:
        """Free pages by preempting the newest sequences; False if ``seq`` itself was preempted."""
        while self.blocks.num_free < pages:
            victim = self.running[-1]
            self.release(victim)
            victim.preemptions += 1
            self.preemptions += 1
            self.waiting.appendleft(victim)
            if victim is seq:
                return False
        return True

    def grow(self, seq: Sequence, n: int) -> bool:
        """Make sure ``seq`` has pages for ``n`` tokens (preempting newer sequences if needed)."""
        need = self.blocks.missing(seq, n)
        if need and not self._preempt_for(seq, need):
            return False
        self.blocks.allocate(seq, n)
        return True

    def prefills(self) -> list[tuple[Sequence, int, int]]:
        """``(seq, n0, n1)``: the prompt chunks of this step, at most ``prefill_chunk`` tokens in all."""
        out, budget = [], self.prefill_chunk
        for seq in self.running:
            if budget <= 0:
                break
            if not seq.in_prefill:
                continue
            n1 = min(seq.num_tokens, seq.n_cached + budget)
            budget -= n1 - seq.n_cached
            out.append((seq, seq.n_cached, n1))
        return out

    def decodes(self, wants: Callable[[Sequence], bool] | None = None) -> list[Sequence]:
        """Sequences that decode this step (those past their prompt for which ``wants(seq)`` holds, if given), each
        with pages for one more token (newer ones may be preempted)."""
        ready = [s for s in self.running if not s.in_prefill and (wants is None or wants(s))]
        for seq in ready:
            if seq.slot >= 0:
                self.grow(seq, seq.n_cached + 1)
        return [s for s in ready if s.slot >= 0]


__all__ = ["Scheduler"]
