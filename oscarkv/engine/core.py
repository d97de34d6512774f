"""The engine: one ``step()`` schedules, runs the model and samples, and never lets one request take it down.

A step: admit waiting requests (:mod:`.scheduler`), run this step's prompt chunks one sequence at a time, launch
one decode step for every sequence whose prompt is done (:mod:`.model_runner`), sample it on the device, and only
then read the previous step's tokens. Decoding runs one step ahead of the host: sampling writes each sequence's
next input token on the device, so step N+1 is launched before step N's tokens reach the host, and the host's
work (scheduling, stop checks, callbacks, the next step's metadata) overlaps the device's. A request therefore
learns of its token one step later, and a sequence that ends on a token (end of sequence, stop) decodes one token
that is thrown away; one that ends by length is not decoded past it. Tokens are the ones a synchronous loop
gives: the inputs of every step are the same.

Fault isolation. An exception while running one sequence's prompt chunk, sampling its token or calling its
``on_token`` fails that sequence only (``finish_reason == "error"``, ``error`` says why; its pages are freed; a
token of it still in flight is dropped).
An exception in a decode batch is retried on halves of the batch until the failing sequences are found: the
store is designed for that (a decode forward writes only each row's own 16-bit row, and the store counts the
token and demotes pages only after a forward succeeded), so a retried row computes exactly what it would have.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ..cache import Paged16Store, PagedStore
from .attention import KeyRotation
from .block_manager import BlockManager
from .model_runner import ModelRunner
from .sampling import sample
from .scheduler import Scheduler
from .sequence import Sequence

log = logging.getLogger(__name__)


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e)[:500]}"


@dataclass
class _InFlight:
    """A launched decode step whose tokens the host has not read: ``seqs[i]`` gets ``host[i]`` (int64, CPU) once
    ``ready`` (an event after the device-to-host copy; None on the CPU) has completed."""

    seqs: list[Sequence]
    host: Tensor
    ready: torch.cuda.Event | None


class Engine:
    """Scheduler + block manager + model runner over one model and one store. Not thread-safe: drive it from
    one thread."""

    def __init__(self, model: torch.nn.Module, store: PagedStore | Paged16Store, *, rotation: KeyRotation | None,
                 eos_ids: tuple[int, ...] = (), max_model_len: int, max_num_seqs: int, prefill_chunk: int = 2048,
                 cuda_graphs: bool = True):
        self.model, self.store = model, store
        self.eos_ids, self.max_model_len = set(eos_ids), max_model_len
        self.blocks = BlockManager(store)
        self.runner = ModelRunner(model, store, rotation=rotation, cuda_graphs=cuda_graphs, max_num_seqs=max_num_seqs)
        self.scheduler = Scheduler(store, self.blocks, max_num_seqs, prefill_chunk, on_move=self.runner.move_slot)
        self.in_flight: _InFlight | None = None
        self.stats = {"prompt_tokens": 0, "generated_tokens": 0, "steps": 0, "errors": 0}
        self.detok: Callable[[Sequence], bool] | None = None  # stop-string check, set by the LLM wrapper

    @property
    def waiting(self):
        return self.scheduler.waiting

    @property
    def running(self) -> list[Sequence]:
        return self.scheduler.running

    @property
    def graphs(self) -> dict:
        return self.runner.graphs

    # ------------------------------------------------------------------------------------- requests
    def add(self, seq: Sequence) -> None:
        """Queue a request; raises ``ValueError`` for one that can never run (the caller validated the ids)."""
        n = len(seq.prompt)
        if n == 0:
            raise ValueError("the prompt is empty")
        if n >= self.max_model_len:
            raise ValueError(f"the prompt has {n} tokens; this engine's max_model_len is {self.max_model_len}")
        total = min(n + seq.params.max_tokens, self.max_model_len)
        need, cap = self.blocks.pages_for(total), self.blocks.capacity
        if need > cap:
            raise ValueError(f"request needs {need} KV pages for {total} tokens but the whole pool holds {cap}; "
                             "raise kv_budget_gb or lower max_tokens")
        if seq.params.seed is not None:
            seq.generator = torch.Generator(device=self.store.device).manual_seed(seq.params.seed)
        self.scheduler.add(seq)

    def abort(self, seq_id: int) -> bool:
        for seq in list(self.waiting):
            if seq.id == seq_id:
                self._finish(seq, "abort")
                return True
        for seq in self.running:
            if seq.id == seq_id:
                self._finish(seq, "abort")
                return True
        return False

    def has_work(self) -> bool:
        """Requests wait or run, or a token in flight still belongs to a request that has not ended."""
        if self.scheduler.has_work():
            return True
        return self.in_flight is not None and any(not s.finished for s in self.in_flight.seqs)

    @property
    def preemptions(self) -> int:
        return self.scheduler.preemptions

    # ------------------------------------------------------------------------------------------ step
    @torch.inference_mode()
    def step(self) -> list[Sequence]:
        """One scheduling step; returns the sequences that finished in it (``finish_reason`` set)."""
        done: list[Sequence] = []
        launched: list[tuple[list[Sequence], Tensor]] = []
        try:
            self.scheduler.admit()
            for seq, n0, n1 in self.scheduler.prefills():
                if seq.slot >= 0 and not seq.finished:
                    self._prefill(seq, n0, n1, done)
            ready = self.scheduler.decodes(self._wants_token)
            if ready:
                launched = self._decode(ready, done)
        except Exception as e:  # a fault outside any one request: fail the running ones, live on
            log.exception("engine step failed outside the per-request paths; failing %d running requests",
                          len(self.running))
            self._fail(list(self.running), e, done)
        previous, self.in_flight = self.in_flight, self._send(launched)
        if previous is not None:
            self._receive(previous, done)
        self.stats["steps"] += 1
        return done

    def _wants_token(self, seq: Sequence) -> bool:
        """False for a sequence whose token in flight ends it by length: it decodes no further."""
        n_out = len(seq.out) + seq.in_flight
        return n_out < seq.params.max_tokens and len(seq.prompt) + n_out < self.max_model_len

    def _prefill(self, seq: Sequence, n0: int, n1: int, done: list[Sequence]) -> None:
        try:
            logits = self.runner.prefill(seq, n0, n1)
        except Exception as e:  # isolated: this sequence only
            log.exception("prefill of request %d failed", seq.id)
            self._fail([seq], e, done)
            return
        self.store.commit(seq.slot, n1 - n0)
        seq.n_cached = n1
        self.stats["prompt_tokens"] += n1 - n0
        if n1 == seq.num_tokens:
            seq.in_prefill = False
            self._sample_first(seq, logits[None], done)

    def _sample_first(self, seq: Sequence, logits: Tensor, done: list[Sequence]) -> None:
        """The token after a prompt, read at once (the first token is the one a user waits for)."""
        try:
            tok = int(sample(logits, [seq.params], [seq.generator])[0])
            self.runner.set_next_token(seq.slot, tok)
        except Exception as e:  # noqa: BLE001 - this request's sampling only
            self._fail([seq], e, done)
            return
        self._append(seq, tok, done)

    def _decode(self, ready: list[Sequence], done: list[Sequence]) -> list[tuple[list[Sequence], Tensor]]:
        """Launch the decode of ``ready`` and sample it on the device; on a failure, the same on each half of it
        (the failing sequences end in errors). Returns ``(sequences, tokens on the device)`` per launched part."""
        try:
            logits = self.runner.decode(ready, self.runner.batch_size(len(self.running)))
            rows = logits[self._slot_index(ready, logits.device)]
            self.store.commit_decode([s.slot for s in ready])
        except Exception as e:  # find and fail the sequences involved, retry the others
            if len(ready) == 1:
                log.exception("decode of request %d failed", ready[0].id)
                self._fail(ready, e, done)
                return []
            half, parts = len(ready) // 2, []
            for part in (ready[:half], ready[half:]):
                part = [s for s in part if s.slot >= 0 and not s.finished]
                if part:
                    parts += self._decode(part, done)
            return parts
        for seq in ready:
            seq.n_cached += 1
        return self._sample_next(ready, rows, done)

    @staticmethod
    def _slot_index(seqs: list[Sequence], device: torch.device) -> slice | Tensor:
        """Index of ``seqs``' slots into per-slot device tensors: a slice when they are the first slots (views,
        no copy), else an index tensor that travels without waiting for the device."""
        slots = [s.slot for s in seqs]
        if slots == list(range(len(slots))):
            return slice(0, len(slots))
        return torch.tensor(slots).to(device, non_blocking=True)

    def _sample_next(self, seqs: list[Sequence], logits: Tensor, done: list[Sequence]
                     ) -> list[tuple[list[Sequence], Tensor]]:
        """Sample ``seqs``' next tokens into the next-token buffer, on the device; a request whose sampling fails
        fails alone."""
        try:
            toks = sample(logits, [s.params for s in seqs], [s.generator for s in seqs])
        except Exception as e:  # noqa: BLE001 - sampling is per request: find the one that fails
            if len(seqs) == 1:
                self._fail(seqs, e, done)
                return []
            return [part for i, seq in enumerate(seqs) for part in self._sample_next([seq], logits[i:i + 1], done)]
        nt = self.runner.next_tokens
        nt[self._slot_index(seqs, nt.device)] = toks
        for seq in seqs:
            seq.in_flight += 1
        return [(seqs, toks)]

    def _send(self, launched: list[tuple[list[Sequence], Tensor]]) -> _InFlight | None:
        """Start copying a launched step's tokens to the host (returns at once)."""
        if not launched:
            return None
        seqs = [s for part, _ in launched for s in part]
        toks = torch.cat([t for _, t in launched]) if len(launched) > 1 else launched[0][1]
        if toks.device.type != "cuda":
            return _InFlight(seqs, toks, None)
        host = torch.empty(toks.shape, dtype=toks.dtype, pin_memory=True)
        host.copy_(toks, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return _InFlight(seqs, host, ready)

    def _receive(self, flight: _InFlight, done: list[Sequence]) -> None:
        """Hand a finished step's tokens to their requests (a request that ended meanwhile drops its token)."""
        if flight.ready is not None:
            flight.ready.synchronize()
        for seq, tok in zip(flight.seqs, flight.host.tolist()):
            seq.in_flight -= 1
            if not seq.finished:
                self._append(seq, tok, done)

    def _append(self, seq: Sequence, tok: int, done: list[Sequence]) -> None:
        seq.out.append(tok)
        self.stats["generated_tokens"] += 1
        p = seq.params
        reason = None
        try:
            stop_token = (tok in self.eos_ids and not p.ignore_eos) or tok in p.stop_token_ids
            if stop_token or (self.detok is not None and p.stop and self.detok(seq)):
                reason = "stop"
            elif len(seq.out) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
                reason = "length"
            if seq.on_token is not None:
                seq.on_token(seq, tok)
        except Exception as e:  # a caller's callback or detokenizer failed for this request
            log.exception("finishing token of request %d failed", seq.id)
            self._fail([seq], e, done)
            return
        if reason:
            self._finish(seq, reason)
            done.append(seq)

    # --------------------------------------------------------------------------------------- finishing
    def _finish(self, seq: Sequence, reason: str) -> None:
        """End ``seq``: a running one gives back its slot and pages; a waiting one (not yet admitted, or preempted
        while its last token was in flight) leaves the queue."""
        seq.finish_reason = reason
        if seq.slot >= 0:
            self.scheduler.release(seq)
        else:
            self.scheduler.remove_waiting(seq)

    def _fail(self, seqs: list[Sequence], e: BaseException, done: list[Sequence]) -> None:
        for seq in seqs:
            if seq.finished:
                continue
            seq.error = _describe(e)
            self.stats["errors"] += 1
            self._finish(seq, "error")
            done.append(seq)


__all__ = ["Engine", "Sequence"]
