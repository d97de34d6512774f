"""The OpenAI-compatible HTTP API (FastAPI): ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with
``"stream": true`` as server-sent events), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus).

A request is checked in full before it reaches the engine: the body (size, time to arrive, JSON), the fields
(:mod:`oscarkv.serve.protocol`), then what needs the model: the served model's name, the tokenizer and chat
template, token ids inside the vocabulary, the prompt inside the context. Errors use OpenAI's shape with 4xx
for the client's faults, 5xx for the server's, 503 while the engine loop is unhealthy; a streaming request is
refused with a real status before its stream starts. A client that disconnects has its request aborted, streaming
or not.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine import LLM, Completion, SamplingParams
from .loop import Accepted, Done, EngineLoop, Failed, Submission, Token
from .metrics import ServeMetrics
from .protocol import SEED_MAX, APIError, ChatRequest, CompletionRequest, parse

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServeConfig:
    """Limits of one server.

    Attributes:
        model_name: the id in ``/v1/models``; a request naming another model gets 404.
        max_body_bytes: larger request bodies get 413 (checked on ``Content-Length`` before reading).
        body_timeout_s: a body that has not fully arrived this long after its headers gets 408.
        accept_timeout_s: the engine loop must queue a request within this, else 503.
        stall_timeout_s: one engine step running longer than this makes ``/health`` answer 503.
    """

    model_name: str = "oscarkv"
    max_body_bytes: int = 4 * 2**20
    body_timeout_s: float = 30.0
    accept_timeout_s: float = 60.0
    stall_timeout_s: float = 300.0


def build_app(llm: LLM, config: ServeConfig | None = None) -> FastAPI:
    """The ASGI app serving ``llm``. Its lifespan starts and stops the engine loop (``app.state.loop``)."""
    config = config or ServeConfig()
    metrics = ServeMetrics()
    loop = EngineLoop(llm, metrics, stall_timeout_s=config.stall_timeout_s)
    metrics.watch(loop)
    api = _Api(llm, loop, metrics, config)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loop.start()
        try:
            yield
        finally:
            await run_in_threadpool(loop.close)
            api.tokenizing.shutdown(wait=False)

    app = FastAPI(title="oscarkv", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.loop, app.state.metrics, app.state.config = loop, metrics, config

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        metrics.error(e.status)
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        if e.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        elif e.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        else:
            message = str(e.detail)
        metrics.error(e.status_code)
        return JSONResponse(APIError(e.status_code, message).body(), status_code=e.status_code, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        metrics.error(400)
        return JSONResponse(APIError(400, str(e)).body(), status_code=400)

    @app.exception_handler(Exception)
    async def _server_error(request: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        metrics.error(500)
        body = APIError(500, f"internal server error: {type(e).__name__}: {e}").body()
        return JSONResponse(body, status_code=500)

    @app.get("/health")
    async def health() -> JSONResponse:
        reason = loop.health()
        if reason is not None:
            return JSONResponse(APIError(503, reason).body(), status_code=503)
        return JSONResponse({"status": "ok", "in_flight": loop.in_flight})

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        card = {"id": config.model_name, "object": "model", "created": api.started, "owned_by": "oscarkv",
                "max_model_len": api.max_model_len, "device": api.device}
        return JSONResponse({"object": "list", "data": [card]})

    @app.get("/metrics")
    async def prometheus() -> Response:
        text = await run_in_threadpool(generate_latest, metrics.registry)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = parse(CompletionRequest, await api.read_json(request))
        api.check_ready(req.model)
        prompt = await api.prompt_ids(req.prompt)
        return await api.generate(request, req, prompt, req.max_tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = parse(ChatRequest, await api.read_json(request))
        api.check_ready(req.model)
        prompt = await api.chat_ids(req)
        return await api.generate(request, req, prompt, req.token_limit(), chat=True)

    return app


class _Api:
    """What the routes share: the limits of the model and the request lifecycle."""

    def __init__(self, llm: LLM, loop: EngineLoop, metrics: ServeMetrics, config: ServeConfig):
        self.loop, self.metrics, self.config, self.tokenizer = loop, metrics, config, llm.tokenizer
        self.vocab_size = llm.model.cfg.vocab_size
        self.max_model_len = llm.engine.max_model_len
        self.started = int(time.time())
        self.device = _device_name(next(llm.model.parameters()).device)
        # one thread: the tokenizer is used from one server thread at a time
        self.tokenizing = ThreadPoolExecutor(1, thread_name_prefix="oscarkv-tokenize")

    # ------------------------------------------------------------------------------------- request
    async def read_json(self, request: Request) -> Any:
        """The body as JSON: 413 past ``max_body_bytes``, 408 if it has not arrived within ``body_timeout_s``."""
        limit = self.config.max_body_bytes
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise APIError(413, f"the request body has {int(length)} bytes; this server accepts at most {limit}",
                           code="body_too_large")
        deadline = time.monotonic() + self.config.body_timeout_s
        chunks, size = [], 0
        stream = request.stream().__aiter__()
        while True:
            try:
                chunk = await asyncio.wait_for(stream.__anext__(), max(deadline - time.monotonic(), 0.0))
            except StopAsyncIteration:
                break
            except asyncio.TimeoutError:
                raise APIError(408, f"the request body did not arrive within {self.config.body_timeout_s:g} s",
                               code="body_timeout") from None
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"the request body exceeds {limit} bytes", code="body_too_large")
            chunks.append(chunk)
        try:
            return json.loads(b"".join(chunks))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None

    def check_ready(self, model: str | None) -> None:
        reason = self.loop.health()
        if reason is not None:
            raise APIError(503, reason)
        if model is not None and model != self.config.model_name:
            raise APIError(404, f"model {model!r} does not exist; this server serves {self.config.model_name!r}",
                           "model", "model_not_found")

    async def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise APIError(400, "this server's model has no tokenizer: send the prompt as a list of token ids",
                               "prompt")
            ids = await self._in_tokenizer_thread(lambda: list(self.tokenizer.encode(prompt)))
        else:
            ids = prompt
        return self._check_ids(ids, "prompt")

    async def chat_ids(self, req: ChatRequest) -> list[int]:
        tok = self.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise APIError(400, "this server's model has no chat template: use /v1/completions with a prompt",
                           "messages", "no_chat_template")
        messages = [m.as_template_input() for m in req.messages]

        def render() -> list[int]:
            out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if isinstance(out, Mapping):  # transformers 5 returns a BatchEncoding
                out = out["input_ids"]
            return [int(t) for t in out]

        try:
            ids = await self._in_tokenizer_thread(render)
        except Exception as e:  # noqa: BLE001 - jinja's TemplateError and what a template raises on purpose
            raise APIError(400, f"the chat template rejected these messages: {e}", "messages") from None
        return self._check_ids(ids, "messages")

    async def _in_tokenizer_thread(self, fn: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.tokenizing, fn)

    def _check_ids(self, ids: list[int], param: str) -> list[int]:
        if not ids:
            raise APIError(400, "the prompt is empty (no tokens)", param)
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary [0, {self.vocab_size})", param)
        if len(ids) >= self.max_model_len:
            raise APIError(400, f"the prompt has {len(ids)} tokens; this server's context is {self.max_model_len} "
                                "tokens, prompt plus output", param)
        return ids

    def sampling(self, req: Any, limit: int | None, n_prompt: int) -> list[SamplingParams]:
        """One :class:`SamplingParams` per choice (seeded choices get ``seed + index``)."""
        stop = req.stop_strings()
        if stop and self.tokenizer is None:
            raise APIError(400, "stop strings need a tokenizer, and this server's model has none", "stop")
        top_k = req.top_k if 0 < req.top_k < self.vocab_size else 0
        max_tokens = limit if limit is not None else self.max_model_len - n_prompt
        if n_prompt + max_tokens > self.max_model_len:
            raise APIError(400, f"the prompt has {n_prompt} tokens and max_tokens is {max_tokens}: more than this "
                                f"server's context of {self.max_model_len} tokens", "max_tokens")
        try:
            return [SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=top_k,
                                   stop=stop, ignore_eos=req.ignore_eos,
                                   seed=None if req.seed is None else (req.seed + i) % (SEED_MAX + 1))
                    for i in range(req.n)]
        except ValueError as e:
            raise APIError(400, str(e)) from None

    # ---------------------------------------------------------------------------------- lifecycle
    async def generate(self, request: Request, req: Any, prompt: list[int], limit: int | None,
                       chat: bool) -> Response:
        queue: asyncio.Queue = asyncio.Queue()
        sub = Submission(prompt, self.sampling(req, limit, len(prompt)), _emitter(queue), stream=req.stream,
                         stream_text=req.stream and self.tokenizer is not None)
        self.loop.submit(sub)
        try:
            first = await asyncio.wait_for(queue.get(), self.config.accept_timeout_s)
        except asyncio.TimeoutError:
            self.loop.abort(sub)
            raise APIError(503, f"the engine did not queue the request within {self.config.accept_timeout_s:g} s")
        except BaseException:
            self.loop.abort(sub)
            raise
        if isinstance(first, Failed):
            raise APIError(first.status, first.message)
        assert isinstance(first, Accepted), first
        reply = _Reply(req, chat, self.config.model_name, len(prompt))
        if req.stream:
            return _EventStream(self._stream(sub, queue, reply), on_close=lambda: self.loop.abort(sub))
        return await self._complete(request, sub, queue, reply)

    async def _complete(self, request: Request, sub: Submission, queue: asyncio.Queue, reply: _Reply) -> Response:
        collect = asyncio.ensure_future(_collect(queue, len(sub.params)))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait((collect, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            left = not collect.done()  # the client went away (or this handler was cancelled)
            if left:
                collect.cancel()
                self.loop.abort(sub)
        if left:
            return Response(status_code=499)  # nobody reads it
        result = collect.result()
        if isinstance(result, Failed):
            raise APIError(result.status, result.message)
        return JSONResponse(reply.body(result))

    async def _stream(self, sub: Submission, queue: asyncio.Queue, reply: _Reply) -> AsyncIterator[bytes]:
        finished = 0
        for index in range(len(sub.params)):
            if reply.chat:
                yield reply.sse(reply.chunk(index, "", None, [], role=True))
        while finished < len(sub.params):
            event = await queue.get()
            if isinstance(event, Failed):
                self.metrics.error(event.status)
                yield reply.sse(APIError(event.status, event.message).body())
                break
            if isinstance(event, Token):
                yield reply.sse(reply.chunk(event.index, reply.delta(event.index, event.text), None, [event.token]))
            elif isinstance(event, Done):
                finished += 1
                c = event.completion
                reply.finish(event.index, c)
                yield reply.sse(reply.chunk(event.index, reply.delta(event.index, c.text or ""), c.finish_reason, []))
        if finished == len(sub.params) and reply.include_usage:
            yield reply.sse(reply.usage_chunk())
        yield b"data: [DONE]\n\n"


class _EventStream(StreamingResponse):
    """Server-sent events; ``on_close`` runs however the response ends (finished, failed, client gone, even
    before the first event), so an unfinished request is always aborted."""

    def __init__(self, events: AsyncIterator[bytes], on_close: Any):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


class _Reply:
    """Builds the response bodies and stream chunks of one request."""

    def __init__(self, req: Any, chat: bool, model: str, n_prompt: int):
        self.chat, self.model, self.n_prompt = chat, model, n_prompt
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.include_usage = bool(req.stream_options and req.stream_options.include_usage)
        self.sent = [""] * req.n  # text streamed so far, per choice
        self.completion_tokens = 0

    def body(self, results: dict[int, Completion]) -> dict:
        choices = []
        for index in sorted(results):
            c = results[index]
            self.completion_tokens += len(c.token_ids)
            choice: dict[str, Any] = {"index": index, "finish_reason": c.finish_reason, "logprobs": None,
                                      "token_ids": c.token_ids}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": c.text or ""}
            else:
                choice["text"] = c.text or ""
            choices.append(choice)
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices, "usage": self.usage()}

    def usage(self) -> dict:
        return {"prompt_tokens": self.n_prompt, "completion_tokens": self.completion_tokens,
                "total_tokens": self.n_prompt + self.completion_tokens}

    def delta(self, index: int, text: str | None) -> str:
        """The part of ``text`` (a choice's stable text so far) not streamed yet."""
        sent = self.sent[index]
        if text is None or not text.startswith(sent):
            return ""
        self.sent[index] = text
        return text[len(sent):]

    def finish(self, index: int, completion: Completion) -> None:
        self.completion_tokens += len(completion.token_ids)

    def chunk(self, index: int, text: str, finish_reason: str | None, token_ids: list[int],
              role: bool = False) -> dict:
        choice: dict[str, Any] = {"index": index, "finish_reason": finish_reason, "logprobs": None,
                                  "token_ids": token_ids}
        if self.chat:
            choice["delta"] = {"role": "assistant", "content": text} if role else ({"content": text} if text else {})
        else:
            choice["text"] = text
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice]}

    def usage_chunk(self) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [], "usage": self.usage()}

    @staticmethod
    def sse(obj: dict) -> bytes:
        return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _device_name(device: Any) -> str:
    if device.type == "cuda":
        import torch

        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)


def _emitter(queue: asyncio.Queue) -> Any:
    """A thread-safe ``emit`` that puts events on ``queue`` in this event loop (dropped once the loop closed)."""
    aloop = asyncio.get_running_loop()

    def emit(event: Any) -> None:
        try:
            aloop.call_soon_threadsafe(queue.put_nowait, event)
        except RuntimeError:  # the event loop has closed: nobody is waiting
            pass

    return emit


async def _collect(queue: asyncio.Queue, n: int) -> dict[int, Completion] | Failed:
    results: dict[int, Completion] = {}
    while len(results) < n:
        event = await queue.get()
        if isinstance(event, Failed):
            return event
        if isinstance(event, Done):
            results[event.index] = event.completion
    return results


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read: only a disconnect can come)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


__all__ = ["ServeConfig", "build_app"]
