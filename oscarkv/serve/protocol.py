"""Request models of the OpenAI-compatible API and its error shape.

Every field has an exact type (``"max_tokens": true`` is not an int, ``"1.5"`` is not a number), numbers are
finite and in range, unknown fields are rejected. Fields the server does not implement with non-default values
(``logprobs``, ``echo``, ``top_logprobs``) are rejected with a message saying so, never ignored. Limits that need
the model (vocabulary, context length, tokenizer) are checked in :mod:`oscarkv.serve.app`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

MAX_N = 16  # choices per request: each is one engine sequence
MAX_STOP = 8  # stop strings per request
SEED_MAX = 2**63 - 1
INT32_MAX = 2**31 - 1

Temperature = Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)]
TopP = Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)]


_ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
                408: "timeout_error", 413: "invalid_request_error", 500: "server_error", 503: "service_unavailable"}


class APIError(Exception):
    """An HTTP error in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = _ERROR_TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def as_template_input(self) -> dict[str, str]:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": self.role, "content": text}


class _Sampling(_Strict):
    """Fields shared by both endpoints."""

    model: str | None = None
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: Annotated[int, Field(ge=-1, le=INT32_MAX)] = 0  # 0 or -1: off
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Annotated[int, Field(ge=0, le=SEED_MAX)] | None = None
    ignore_eos: bool = False
    user: str | None = None  # an end-user identifier; informational

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, v: Any) -> Any:
        items = [v] if isinstance(v, str) else v
        if v is None or not isinstance(items, list):
            return v
        if len(items) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings, got {len(items)}")
        if not all(isinstance(s, str) and s for s in items):
            raise ValueError("must be a non-empty string or a list of non-empty strings")
        return v

    def stop_strings(self) -> tuple[str, ...]:
        return () if self.stop is None else ((self.stop,) if isinstance(self.stop, str) else tuple(self.stop))


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: ``prompt`` is a string or a non-empty list of token ids."""

    prompt: str | list[int]
    max_tokens: Annotated[int, Field(ge=1, le=INT32_MAX)] | None = 16
    logprobs: int | None = None
    echo: bool = False

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        if isinstance(v, str):
            return v
        if isinstance(v, list) and v and all(type(t) is int for t in v):
            return v
        if isinstance(v, list) and v and all(isinstance(p, (str, list)) for p in v):
            raise ValueError("batched prompts are not supported: send one request per prompt")
        raise ValueError("must be a string or a non-empty list of token ids (integers)")

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, v: int | None) -> int | None:
        if v is not None:
            raise ValueError("not supported by this server; leave it out")
        return v

    @field_validator("echo")
    @classmethod
    def _echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("not supported by this server; leave it out")
        return v


class ChatRequest(_Sampling):
    """``POST /v1/chat/completions``: the messages are rendered with the model's chat template."""

    messages: Annotated[list[Message], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1, le=INT32_MAX)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, le=INT32_MAX)] | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, v: bool) -> bool:
        if v:
            raise ValueError("not supported by this server; leave it out")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, v: int | None) -> int | None:
        if v is not None:
            raise ValueError("not supported by this server; leave it out")
        return v

    def token_limit(self) -> int | None:
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise APIError(400, "give max_tokens or max_completion_tokens, not both", "max_completion_tokens")
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def parse(model: type[_Strict], body: Any) -> Any:
    """Validate a decoded JSON body; raises :class:`APIError` 400 naming the first offending field."""
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise validation_error(e) from None


def validation_error(e: ValidationError) -> APIError:
    err = e.errors(include_url=False)[0]
    loc = [str(p) for p in err["loc"]]
    # a union reports one error per member (``prompt.str``, ``prompt.list[int]``): name the field itself
    loc = [p for p in loc if not any(c in p for c in "[]") and p not in ("str", "int", "float", "bool", "list")]
    param = ".".join(loc) or None
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        return APIError(400, f"unknown field {param!r}", param, "unknown_field")
    if err["type"] == "missing":
        return APIError(400, f"{param!r} is required", param, "missing_field")
    return APIError(400, f"{param}: {msg}" if param else msg, param, "invalid_value")


__all__ = ["MAX_N", "APIError", "ChatRequest", "CompletionRequest", "Message", "StreamOptions", "parse"]
