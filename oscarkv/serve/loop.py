"""The engine loop: one thread owns the :class:`~oscarkv.engine.LLM` and runs its steps; HTTP handlers hand it
work through a queue and receive events back through a callback.

Isolation contract: a request is validated in full before it gets here (:mod:`oscarkv.serve.app`). The loop
itself never dies: an exception while adding a request fails that request alone (400 for a ``ValueError``, 500
otherwise); an exception during a step fails the requests the engine was running (500) and the loop goes on
serving. Only if the engine still holds work after all its requests were aborted is it marked broken: then
``/health`` answers 503 and new requests get 503.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..engine import LLM, Completion, SamplingParams

log = logging.getLogger(__name__)

# Finish reasons of a choice that completed normally; any other reason the engine reports fails the request.
NORMAL_FINISH = ("stop", "length")


@dataclass(frozen=True)
class Accepted:
    """The engine queued every choice of the request."""


@dataclass(frozen=True)
class Token:
    """Choice ``index`` produced ``token``; ``text`` (streaming requests with a tokenizer) is the choice's text so
    far that can no longer change: stop strings cut, a possible stop-string prefix and an incomplete character at
    the end held back."""

    index: int
    token: int
    text: str | None


@dataclass(frozen=True)
class Done:
    index: int
    completion: Completion


@dataclass(frozen=True)
class Failed:
    """The whole request failed; no event follows."""

    status: int
    message: str


Event = Accepted | Token | Done | Failed


@dataclass(eq=False)
class Submission:
    """One HTTP request: a prompt and one :class:`SamplingParams` per choice. ``emit`` receives its events on the
    engine thread: it must be thread-safe and must not block."""

    prompt: list[int]
    params: list[SamplingParams]
    emit: Callable[[Event], None]
    stream: bool = False  # Token events are sent only for streaming requests
    stream_text: bool = False
    created: float = field(default_factory=time.monotonic)
    seqs: list[Any] = field(default_factory=list)
    first_token_at: float | None = None
    last_token_at: list[float | None] = field(default_factory=list)


class _NullMetrics:
    def __getattr__(self, name: str) -> Callable[..., None]:
        return lambda *args, **kwargs: None


class EngineLoop:
    """Runs ``llm.step()`` in a background thread. ``submit`` and ``abort`` are thread-safe and return at once.

    ``metrics``: an object with the hooks of :class:`oscarkv.serve.metrics.ServeMetrics` (optional).
    ``stall_timeout_s``: a single step running longer than this makes :meth:`health` report the engine stuck.
    """

    def __init__(self, llm: LLM, metrics: Any = None, *, stall_timeout_s: float = 300.0):
        self.llm = llm
        self.metrics = metrics or _NullMetrics()
        self.stall_timeout_s = stall_timeout_s
        self.broken: str | None = None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[int, tuple[Submission, int]] = {}  # id(sequence) -> (submission, choice index)
        self._lock = threading.Lock()  # held while the engine is touched; gauges() takes it briefly
        self._stopping = threading.Event()
        self._busy_since: float | None = None
        self._gauges: dict[str, float] = {}
        self._thread = threading.Thread(target=self._run, name="oscarkv-engine", daemon=True)

    # --------------------------------------------------------------------------------- other threads
    def start(self) -> None:
        self._thread.start()

    def submit(self, sub: Submission) -> None:
        reason = self.health()
        if reason is not None:
            sub.emit(Failed(503, reason))
            return
        self._inbox.put(("add", sub))

    def abort(self, sub: Submission) -> None:
        """Abort every unfinished choice of ``sub`` (a client went away); no further events are sent."""
        self._inbox.put(("abort", sub))

    def close(self, timeout: float = 30.0) -> None:
        """Stop the loop; requests still in flight get 503."""
        self._stopping.set()
        self._inbox.put(("wake", None))
        if self._thread.is_alive():
            self._thread.join(timeout)

    def health(self) -> str | None:
        """``None`` when the loop serves, else why not (one line)."""
        if self._stopping.is_set():
            return "the server is shutting down"
        if not self._thread.is_alive():
            return "the engine loop is not running"
        if self.broken:
            return self.broken
        busy = self._busy_since
        if busy is not None and time.monotonic() - busy > self.stall_timeout_s:
            return f"the engine has been inside one step for more than {self.stall_timeout_s:g} s"
        return None

    def gauges(self, wait_s: float = 2.0) -> dict[str, float]:
        """``llm.gauges()`` read between steps (the last reading if a step runs longer than ``wait_s``)."""
        if self._lock.acquire(timeout=wait_s):
            try:
                self._gauges = dict(self.llm.gauges())
            except Exception:
                log.exception("reading the engine gauges failed")
            finally:
                self._lock.release()
        return dict(self._gauges)

    @property
    def in_flight(self) -> int:
        return len({id(sub) for sub, _ in list(self._live.values())})

    # ---------------------------------------------------------------------------------- engine thread
    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                self._drain(block=not self._has_work())
                if self._has_work() and not self._stopping.is_set():
                    self._step()
        except BaseException as e:
            log.exception("the engine loop stopped")
            self.broken = f"the engine loop stopped: {type(e).__name__}: {e}"
        finally:
            self._fail_all(503, self.broken or "the server is shutting down")

    def _has_work(self) -> bool:
        if self.broken:
            return False
        try:
            return self.llm.engine.has_work()
        except Exception as e:  # noqa: BLE001
            self.broken = f"the engine cannot report its state ({type(e).__name__}: {e}); restart the server"
            return False

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=1.0) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, sub = item
            try:
                if kind == "add":
                    self._add(sub)
                elif kind == "abort":
                    self._abort(sub)
            except Exception:
                log.exception("handling %s failed", kind)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _add(self, sub: Submission) -> None:
        if self.broken or self._stopping.is_set():
            sub.emit(Failed(503, self.broken or "the server is shutting down"))
            return
        sub.last_token_at = [None] * len(sub.params)
        try:
            with self._lock:
                for index, params in enumerate(sub.params):
                    seq = self.llm.submit(sub.prompt, params, on_token=self._on_token)
                    sub.seqs.append(seq)
                    self._live[id(seq)] = (sub, index)
        except Exception as e:
            self._discard(sub)
            if isinstance(e, ValueError):
                sub.emit(Failed(400, str(e)))
            else:
                log.exception("adding a request failed")
                sub.emit(Failed(500, f"the engine could not queue this request: {type(e).__name__}: {e}"))
            return
        self.metrics.accepted(sub)
        sub.emit(Accepted())

    def _abort(self, sub: Submission) -> None:
        if self._discard(sub):
            self.metrics.aborted()

    def _discard(self, sub: Submission) -> bool:
        """Abort the engine sequences of ``sub`` still running; whether there were any."""
        found = False
        for seq in sub.seqs:
            if self._live.pop(id(seq), None) is None:
                continue
            found = True
            try:
                with self._lock:
                    self.llm.abort(seq.id)
            except Exception:
                log.exception("aborting a request failed")
        return found

    def _step(self) -> None:
        self._busy_since = time.monotonic()
        try:
            with self._lock:
                done = self.llm.step()
        except Exception as e:
            log.exception("an engine step failed")
            self.metrics.step_error()
            self._fail_all(500, f"the engine failed while running this request ({type(e).__name__}: {e}); "
                                "the server keeps serving")
            if self._has_work():
                self.broken = "the engine kept work after a failed step aborted all requests; restart the server"
            return
        finally:
            self._busy_since = None
        for seq in done:
            self._finished(seq)

    def _finished(self, seq: Any) -> None:
        entry = self._live.pop(id(seq), None)
        if entry is None:
            return
        sub, index = entry
        if seq.finish_reason not in NORMAL_FINISH:  # the engine failed this request alone ("error")
            self._discard(sub)
            why = getattr(seq, "error", None) or f"finish_reason {seq.finish_reason!r}"
            sub.emit(Failed(500, f"the engine failed on this request: {why}"))
            return
        try:
            completion = self.llm.completion(seq)
        except Exception as e:
            log.exception("building a completion failed")
            self._discard(sub)
            sub.emit(Failed(500, f"decoding the output failed: {type(e).__name__}: {e}"))
            return
        self.metrics.finished(sub, completion)
        sub.emit(Done(index, completion))

    def _on_token(self, seq: Any, token: int) -> None:
        """Called by the engine inside a step: must never raise."""
        try:
            entry = self._live.get(id(seq))
            if entry is None:
                return
            sub, index = entry
            self.metrics.token(sub, index)
            if sub.stream:
                text = self._stable_text(seq) if sub.stream_text else None
                sub.emit(Token(index, int(token), text))
        except Exception:
            log.exception("delivering a token failed")

    def _stable_text(self, seq: Any) -> str | None:
        text = self.llm.completion(seq).text
        if text is None:
            return None
        hold = max((len(s) for s in seq.params.stop), default=1) - 1
        text = text[: len(text) - hold] if hold else text
        return text.rstrip("\ufffd")  # an incomplete multi-byte character decodes to U+FFFD until it completes

    def _fail_all(self, status: int, message: str) -> None:
        subs = {id(sub): sub for sub, _ in list(self._live.values())}
        for sub in subs.values():
            self._discard(sub)
            sub.emit(Failed(status, message))


__all__ = ["Accepted", "Done", "EngineLoop", "Event", "Failed", "Submission", "Token"]
