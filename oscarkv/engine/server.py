"""OpenAI-compatible HTTP server on localhost (stdlib ``http.server``: no extra dependencies).

One engine thread owns the :class:`~oscarkv.engine.llm.LLM`; request threads hand it work through a queue and
read tokens back from per-request queues. Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``
(both with ``"stream": true`` as server-sent events), ``GET /v1/models``, ``GET /health``, ``GET /metrics``
(Prometheus text). A client that disconnects mid-stream has its request aborted and its pages freed.
"""

from __future__ import annotations

import json
import queue
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from .llm import LLM
from .metrics import render
from .sampling import SamplingParams

_SAMPLING_KEYS = {"max_tokens", "temperature", "top_p", "top_k", "stop", "seed", "ignore_eos"}
_IGNORED_KEYS = {"model", "stream", "prompt", "messages", "n", "user", "stream_options", "logprobs",
                 "presence_penalty", "frequency_penalty"}


class EngineLoop:
    """Runs ``llm.step()`` in a background thread; thread-safe ``submit`` / ``abort``."""

    def __init__(self, llm: LLM):
        self.llm = llm
        self.inbox: queue.Queue = queue.Queue()
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._run, name="oscarkv-engine", daemon=True)
        self.thread.start()

    def submit(self, prompt: Any, params: SamplingParams) -> queue.Queue:
        """Returns a queue receiving ``("token", id)``, then ``("done", reason)`` or ``("error", message)``."""
        out: queue.Queue = queue.Queue()
        self.inbox.put(("add", prompt, params, out))
        return out

    def abort(self, out: queue.Queue) -> None:
        self.inbox.put(("abort", out))

    def close(self) -> None:
        self.stop_event.set()
        self.inbox.put(("noop",))
        self.thread.join(timeout=10)

    def _run(self) -> None:
        llm, live = self.llm, {}
        while not self.stop_event.is_set():
            block = not llm.engine.has_work()
            try:
                while True:
                    self._handle(self.inbox.get(block=block, timeout=0.5 if block else None), live)
                    block = False
            except queue.Empty:
                pass
            if llm.engine.has_work():
                try:
                    done = llm.step()
                except Exception as e:  # fail the requests, keep serving
                    self._fail_all(live, f"engine error: {type(e).__name__}: {e}")
                    continue
                for seq in done:
                    out = live.pop(id(seq), None)
                    if out is not None:
                        out.put(("done", seq.finish_reason))

    def _fail_all(self, live: dict, message: str) -> None:
        for out in list(live.values()):
            seq = out.seq
            if seq.finish_reason is None:
                self.llm.engine.abort(seq.id)
            out.put(("error", message))
        live.clear()

    def _handle(self, item: tuple, live: dict) -> None:
        llm = self.llm
        if item[0] == "add":
            _, prompt, params, out = item
            try:
                seq = llm.submit(prompt, params, on_token=lambda s, t, o=out: o.put(("token", t)))
            except ValueError as e:
                out.put(("error", str(e)))
                return
            live[id(seq)] = out
            out.seq = seq
        elif item[0] == "abort":
            seq = getattr(item[1], "seq", None)
            if seq is not None and seq.finish_reason is None and llm.engine.abort(seq.id):
                live.pop(id(seq), None)
                llm.metrics.inc("requests_aborted_total")


class Handler(BaseHTTPRequestHandler):
    server: "Server"
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # quiet: metrics cover it
        pass

    def _send(self, code: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _json(self, code: int, obj: Any) -> None:
        self._send(code, json.dumps(obj).encode())

    def _error(self, code: int, msg: str) -> None:
        self._json(code, {"error": {"message": msg, "type": "invalid_request_error", "code": code}})

    def do_GET(self) -> None:
        llm = self.server.loop.llm
        if self.path == "/health":
            self._json(200, {"status": "ok"})
        elif self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": self.server.model_name, "object": "model"}]})
        elif self.path == "/metrics":
            text = render(llm.metrics, llm.gauges(), llm.monitor)
            self._send(200, text.encode(), "text/plain; version=0.0.4")
        else:
            self._error(404, f"no route {self.path}")

    def do_POST(self) -> None:
        if self.path not in ("/v1/completions", "/v1/chat/completions"):
            return self._error(404, f"no route {self.path}")
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            chat = self.path.endswith("chat/completions")
            prompt = self._prompt(body, chat)
            params = self._params(body)
        except (ValueError, KeyError, TypeError) as e:
            return self._error(400, str(e))
        out = self.server.loop.submit(prompt, params)
        if body.get("stream"):
            self._stream(out, chat, params)
        else:
            self._complete(out, chat, params)

    def _prompt(self, body: dict, chat: bool) -> Any:
        llm = self.server.loop.llm
        if not chat:
            if "prompt" not in body:
                raise ValueError("'prompt' is required")
            return body["prompt"]
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise ValueError("'messages' must be a non-empty list")
        tok = llm.tokenizer
        if tok is not None and getattr(tok, "chat_template", None):
            return list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True))
        return "\n".join(f"{m['role']}: {m['content']}" for m in msgs) + "\nassistant:"

    def _params(self, body: dict) -> SamplingParams:
        unknown = sorted(set(body) - _SAMPLING_KEYS - _IGNORED_KEYS)
        if unknown:
            raise ValueError(f"unknown field(s) {unknown}; supported: {sorted(_SAMPLING_KEYS | _IGNORED_KEYS)}")
        args = {k: body[k] for k in _SAMPLING_KEYS if k in body and body[k] is not None}
        if "temperature" not in args:
            args["temperature"] = 1.0  # OpenAI's default
        if isinstance(args.get("stop"), str):
            args["stop"] = (args["stop"],)
        return SamplingParams.from_dict(args)

    def _collect(self, out: queue.Queue):
        while True:
            kind, value = out.get()
            yield kind, value
            if kind != "token":
                return

    def _complete(self, out: queue.Queue, chat: bool, params: SamplingParams) -> None:
        tokens, reason = [], None
        for kind, value in self._collect(out):
            if kind == "token":
                tokens.append(value)
            elif kind == "error":
                return self._error(400, value)
            else:
                reason = value
        llm = self.server.loop.llm
        text = llm._text(out.seq)
        choice = {"index": 0, "finish_reason": reason}
        choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
        self._json(200, {"id": f"cmpl-{uuid.uuid4().hex}", "object": "chat.completion" if chat else "text_completion",
                         "created": int(time.time()), "model": self.server.model_name, "choices": [choice],
                         "usage": {"prompt_tokens": len(out.seq.prompt), "completion_tokens": len(tokens),
                                   "total_tokens": len(out.seq.prompt) + len(tokens)}})

    def _stream(self, out: queue.Queue, chat: bool, params: SamplingParams) -> None:
        llm, cid = self.server.loop.llm, f"cmpl-{uuid.uuid4().hex}"
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        sent_text, ids = "", []
        try:
            for kind, value in self._collect(out):
                if kind == "error":
                    self._event({"error": {"message": value}})
                    break
                if kind == "token":
                    ids.append(value)
                text = llm._text(out.seq) if llm.tokenizer is not None else ""
                delta, sent_text = text[len(sent_text):], text
                reason = value if kind == "done" else None
                choice = {"index": 0, "finish_reason": reason, "token_id": value if kind == "token" else None}
                choice.update({"delta": {"content": delta}} if chat else {"text": delta})
                self._event({"id": cid, "object": "chat.completion.chunk" if chat else "text_completion",
                             "model": self.server.model_name, "choices": [choice]})
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            self.server.loop.abort(out)

    def _event(self, obj: dict) -> None:
        self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
        self.wfile.flush()


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 512  # listen backlog: bursts of hundreds of clients must not be reset

    def __init__(self, llm: LLM, host: str = "127.0.0.1", port: int = 8000, model_name: str = "oscarkv"):
        super().__init__((host, port), Handler)
        self.loop = EngineLoop(llm)
        self.model_name = model_name

    def shutdown(self) -> None:
        super().shutdown()
        self.loop.close()


def serve(llm: LLM, host: str = "127.0.0.1", port: int = 8000, model_name: str = "oscarkv") -> Server:
    """Start serving in a background thread; returns the server (``server.shutdown()`` stops it)."""
    srv = Server(llm, host, port, model_name)
    threading.Thread(target=srv.serve_forever, name="oscarkv-http", daemon=True).start()
    return srv


__all__ = ["serve", "Server", "EngineLoop"]
