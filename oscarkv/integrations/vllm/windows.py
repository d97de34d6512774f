"""Per-step bookkeeping of the 16-bit windows (sink + recent ring) for the vLLM backend. No vLLM import.

vLLM gives an attention backend block tables, not request identities. A live sequence is identified by the
physical id of its first block (unique among live sequences while prefix caching is off). Each sequence owns
one *slot* of a per-layer 16-bit pool ``[num_slots + 1, rows16, Hkv, d]`` (the last slot is a trash row for
masked writes): rows ``[0, sink)`` hold positions ``[0, sink)``; row ``sink + (p - sink) % ring`` holds a recent
position ``p``. A sequence whose slot was lost (more live sequences than slots) is served from its 2-bit pages
only ("degraded"), never from another sequence's rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...cache import TierPolicy
from .options import OscarVllmError, windows_of


class WindowSlots:
    """Maps sequences (first-block ids) to pool slots; least recently used slots are recycled."""

    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self.key_of_slot = np.full(num_slots, -1, dtype=np.int64)
        self.slot_of_key: dict[int, int] = {}
        self.last_step = np.zeros(num_slots, dtype=np.int64)
        self.step = 0
        self.degraded = 0  # sequences served without windows because their slot was recycled

    def assign(self, keys: np.ndarray, fresh: np.ndarray) -> np.ndarray:
        """Slots (int64 ``[B]``, -1 = degraded) for sequences with first blocks ``keys``; ``fresh[b]`` is true
        for a sequence's first chunk (it gets a new slot; a stale owner of the same key is dead)."""
        self.step += 1
        out = np.full(len(keys), -1, dtype=np.int64)
        for key, new in zip(keys.tolist(), fresh.tolist()):  # this step's sequences first: never recycled below
            slot = self.slot_of_key.get(key)
            if slot is not None and not new:
                self.last_step[slot] = self.step
        for b, (key, new) in enumerate(zip(keys.tolist(), fresh.tolist())):
            slot = self.slot_of_key.get(key)
            if slot is None and new:
                slot = self._take()
                old = int(self.key_of_slot[slot])
                if old >= 0:
                    del self.slot_of_key[old]
                self.key_of_slot[slot] = key
                self.slot_of_key[key] = slot
            if slot is None:
                self.degraded += 1
                continue
            self.last_step[slot] = self.step
            out[b] = slot
        return out

    def _take(self) -> int:
        free = np.flatnonzero(self.key_of_slot < 0)
        if len(free):
            return int(free[0])
        candidates = np.flatnonzero(self.last_step < self.step)
        if not len(candidates):
            raise RuntimeError(f"more sequences in one batch than OSCAR window slots ({self.num_slots})")
        return int(candidates[np.argmin(self.last_step[candidates])])


@dataclass
class StepIndices:
    """CPU index arrays of one step (see :func:`step_indices`)."""

    ring_rows: np.ndarray  # int64 [T]: flat pool row written by each new token (trash row when masked)
    gather: np.ndarray  # int64 [B, rows16]: flat pool rows read as the 16-bit tier (valid first, then trash)
    len16: np.ndarray  # int32 [B]
    qlen: np.ndarray  # int32 [B]: tokens read from the 2-bit pages ...
    skip: np.ndarray  # int32 [B]: ... starting this many tokens into the page table (the sink, or 0)
    # pages completed in this step (channel-page layers write them whole from the 16-bit rows): per page token,
    # its batch row and position, and its source: a new token of this step (index into the step's tokens) or a
    # flat pool row. Decode rows come first with exactly one page each (unused: row -1), then prefill pages.
    page_row: np.ndarray | None = None  # int64 [M]
    page_pos: np.ndarray | None = None  # int64 [M]
    page_new: np.ndarray | None = None  # int64 [M]: token index, or -1 where the source is the pool
    page_ring: np.ndarray | None = None  # int64 [M]: flat pool row (trash where the source is a new token)


def step_indices(
    policy: TierPolicy, slots: np.ndarray, seq_lens: np.ndarray, query_lens: np.ndarray, num_slots: int,
    decode: np.ndarray, pages: int = 0,
) -> StepIndices:
    """Index arrays for one step, with the transformers integration's order (attend, then demote): every row
    reads its prefix as stored before this step (``qlen`` of ``n0 = seq_lens - query_lens``). A decode row
    (``decode[b]``) reads its new token from the ring, so its 16-bit tier is gathered after the write and counts
    that token; a prefill chunk attends to itself separately, so its gather (done before the write) stops at
    ``n0``. ``seq_lens[b]`` counts tokens after this step. Without windows (``policy.windows`` false) or without
    a slot, everything stored is read from the 2-bit pages (a degraded decode row then reads its own token there).
    ``pages``: the page size, to list the 2-bit-tier pages this step completes (0: none).

    Flat pool rows are ``slot * rows16 + row``; the trash row is ``num_slots * rows16``.
    """
    ring, R = windows_of(policy)
    S = policy.sink
    trash = num_slots * R
    B = len(seq_lens)
    n0 = seq_lens - query_lens
    qlen = np.array([policy.quantized(int(n)) for n in n0], dtype=np.int32)
    len16 = np.zeros(B, dtype=np.int32)
    gather = np.full((B, max(R, 1)), trash, dtype=np.int64)[:, :R]
    ring_rows = np.full(int(query_lens.sum()), trash, dtype=np.int64)
    skip = np.full(B, S if policy.windows else 0, dtype=np.int32)
    starts = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int64)
    for b in range(B):
        n, t, s = int(seq_lens[b]), int(query_lens[b]), int(slots[b])
        if s < 0 or not policy.windows:
            qlen[b] = n if (decode[b] and policy.windows) else n0[b]
            skip[b] = 0
            continue
        pos = np.arange(n - t, n)
        rows = np.where(pos < S, pos, S + (pos - S) % ring)
        keep = (pos < S) | (pos >= n - ring)
        ring_rows[starts[b]:starts[b] + t] = np.where(keep, s * R + rows, trash)
        end = n if decode[b] else int(n0[b])
        ns = min(S, end)
        nrec = max(0, end - S - int(qlen[b]))
        gather[b, :ns] = s * R + np.arange(ns)
        gather[b, ns:ns + nrec] = s * R + S + (int(qlen[b]) + np.arange(nrec)) % ring
        len16[b] = ns + nrec
    idx = StepIndices(ring_rows=ring_rows, gather=gather, len16=len16, qlen=qlen, skip=skip)
    if pages:
        _completed_pages(idx, policy, slots, seq_lens, n0, starts, decode, pages, R, trash)
    return idx


def _completed_pages(idx: StepIndices, policy: TierPolicy, slots: np.ndarray, seq_lens: np.ndarray, n0: np.ndarray,
                     starts: np.ndarray, decode: np.ndarray, P: int, R: int, trash: int) -> None:
    """Fill ``idx.page_*``: the 2-bit-tier pages (first position >= sink) whose last token arrives this step."""
    S, ring = policy.sink, R - policy.sink
    rows, pos, new, src = [], [], [], []
    for b in range(len(seq_lens)):
        n, a, s = int(seq_lens[b]), int(n0[b]), int(slots[b])
        first = [j * P for j in range(max(S, a - a % P) // P, n // P) if j * P >= S and (j + 1) * P > a]
        if first and s < 0:
            raise OscarVllmError("a sequence without a 16-bit window slot completed a channel page: its tokens "
                                 "are gone (raise oscar.max_seqs to max_num_seqs)")
        if decode[b] and not first:
            rows.append(np.full(P, -1))
            pos.append(np.zeros(P, dtype=np.int64))
            new.append(np.full(P, -1))
            src.append(np.full(P, trash))
        for j0 in first:
            p = np.arange(j0, j0 + P)
            fresh = p >= a
            rows.append(np.full(P, b))
            pos.append(p)
            new.append(np.where(fresh, starts[b] + p - a, -1))
            src.append(np.where(fresh, trash, s * R + S + (p - S) % max(ring, 1)))
    cat = (lambda x: np.concatenate(x).astype(np.int64)) if rows else (lambda x: np.zeros(0, dtype=np.int64))
    idx.page_row, idx.page_pos, idx.page_new, idx.page_ring = cat(rows), cat(pos), cat(new), cat(src)


__all__ = ["StepIndices", "WindowSlots", "step_indices"]
