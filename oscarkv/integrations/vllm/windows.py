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

from .options import Tiering


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


def step_indices(
    tiers: Tiering, slots: np.ndarray, seq_lens: np.ndarray, query_lens: np.ndarray, num_slots: int,
    decode: np.ndarray,
) -> StepIndices:
    """Index arrays for one step, with the transformers integration's order (attend, then demote): every row
    reads its prefix as stored before this step (``qlen`` of ``n0 = seq_lens - query_lens``). A decode row
    (``decode[b]``) reads its new token from the ring, so its 16-bit tier is gathered after the write and counts
    that token; a prefill chunk attends to itself separately, so its gather (done before the write) stops at
    ``n0``. ``seq_lens[b]`` counts tokens after this step. Without windows (``tiers.enabled`` false) or without a
    slot, everything stored is read from the 2-bit pages (a degraded decode row then reads its own token there).

    Flat pool rows are ``slot * rows16 + row``; the trash row is ``num_slots * rows16``.
    """
    R, S, ring = tiers.rows16, tiers.sink, tiers.ring
    trash = num_slots * R
    B = len(seq_lens)
    n0 = seq_lens - query_lens
    qlen = np.array([tiers.qlen(int(n)) for n in n0], dtype=np.int32)
    len16 = np.zeros(B, dtype=np.int32)
    gather = np.full((B, max(R, 1)), trash, dtype=np.int64)[:, :R]
    ring_rows = np.full(int(query_lens.sum()), trash, dtype=np.int64)
    skip = np.full(B, tiers.first_block_tokens, dtype=np.int32)
    start = 0
    for b in range(B):
        n, t, s = int(seq_lens[b]), int(query_lens[b]), int(slots[b])
        if s < 0 or not tiers.enabled:
            qlen[b] = n if (decode[b] and tiers.enabled) else n0[b]
            skip[b] = 0
            start += t
            continue
        pos = np.arange(n - t, n)
        rows = np.where(pos < S, pos, S + (pos - S) % ring)
        keep = (pos < S) | (pos >= n - ring)
        ring_rows[start:start + t] = np.where(keep, s * R + rows, trash)
        start += t
        end = n if decode[b] else int(n0[b])
        ns = min(S, end)
        nrec = max(0, end - S - int(qlen[b]))
        gather[b, :ns] = s * R + np.arange(ns)
        gather[b, ns:ns + nrec] = s * R + S + (int(qlen[b]) + np.arange(nrec)) % ring
        len16[b] = ns + nrec
    return StepIndices(ring_rows=ring_rows, gather=gather, len16=len16, qlen=qlen, skip=skip)


__all__ = ["WindowSlots", "StepIndices", "step_indices"]
