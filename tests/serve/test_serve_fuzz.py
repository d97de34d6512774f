"""Property-based fuzzing of request fields and types (hypothesis): the request models alone, then a live server.
Every body gets 200 or a 4xx in OpenAI's error shape, never a 5xx; the engine stays healthy and leaks no page."""

from __future__ import annotations

import json
import math

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from serve_helpers import (
    assert_no_pages_held,
    serving,
    tiny_model,
    wait_idle,
    word_tokenizer,
)

from oscarkv.engine import LLM
from oscarkv.serve.protocol import (
    MAX_N,
    APIError,
    ChatRequest,
    CompletionRequest,
    parse,
)

FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "n",
          "stream", "stream_options", "stop", "seed", "ignore_eos", "user", "logprobs", "top_logprobs", "echo"]

SCALARS = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.integers(-3, 70)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12) | st.sampled_from(["w1 w2", "tiny"]))
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.sampled_from(["role", "content", "type", "text", "include_usage", "x"]),
                                      inner, max_size=3), max_leaves=8)
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                 "content": st.sampled_from(["w1", "w2 w3", ""])})
VALID = {  # values the server accepts (the prompt or messages come from PROMPTS)
    "max_tokens": st.integers(1, 8), "temperature": st.floats(0, 2), "top_p": st.floats(0, 1, exclude_min=True),
    "top_k": st.integers(-1, 200), "n": st.integers(1, 3), "seed": st.integers(0, 2**63 - 1),
    "stop": st.sampled_from(["w1", ["w7", "w3"]]), "stream": st.booleans(), "ignore_eos": st.booleans(),
    "stream_options": st.just({"include_usage": True}), "user": st.text(max_size=5), "model": st.just("tiny"),
}
PROMPTS = {"/v1/completions": ("prompt", st.lists(st.integers(0, 95), min_size=1, max_size=12)
                               | st.sampled_from(["w1 w2", "w5"])),
           "/v1/chat/completions": ("messages", st.lists(MESSAGE, min_size=1, max_size=3))}


def valid_body(route: str) -> st.SearchStrategy:
    key, prompt = PROMPTS[route]
    return st.fixed_dictionaries({key: prompt}, optional=VALID)


def fuzzed_body(route: str) -> st.SearchStrategy:
    """Valid bodies, valid bodies with one field replaced by (or added as) any JSON value, and any JSON."""
    mutated = st.tuples(valid_body(route), st.sampled_from(FIELDS) | st.text(max_size=6), JSON).map(
        lambda t: {**t[0], t[1]: t[2]})
    return valid_body(route) | mutated | JSON


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_request_models_accept_or_reject_with_a_400(data):
    route = data.draw(st.sampled_from(sorted(PROMPTS)))
    model = CompletionRequest if route == "/v1/completions" else ChatRequest
    body = data.draw(fuzzed_body(route))
    try:
        req = parse(model, body)
    except APIError as e:
        event(f"{model.__name__} 400")
        assert e.status == 400 and e.message and "\n" not in e.message
        assert e.param is None or isinstance(e.param, str)
        return
    event(f"{model.__name__} accepted")
    assert isinstance(body, dict)
    if "max_tokens" in body and body["max_tokens"] is not None:
        assert type(body["max_tokens"]) is int and body["max_tokens"] >= 1
    assert 0 <= req.temperature <= 2 and math.isfinite(req.temperature) and 0 < req.top_p <= 1
    assert type(req.n) is int and 1 <= req.n <= MAX_N
    assert all(isinstance(s, str) and s for s in req.stop_strings())
    if model is CompletionRequest:
        assert isinstance(req.prompt, str) or (req.prompt and all(type(t) is int for t in req.prompt))


@settings(max_examples=300, deadline=None)
@given(st.fixed_dictionaries({"prompt": st.lists(st.integers(0, 2**31), min_size=1, max_size=50)
                                        | st.text(max_size=30)},
                             optional={"max_tokens": st.integers(1, 2**31 - 1), "temperature": st.floats(0, 2),
                                       "top_p": st.floats(0, 1, exclude_min=True), "top_k": st.integers(-1, 2**31 - 1),
                                       "n": st.integers(1, MAX_N), "seed": st.integers(0, 2**63 - 1),
                                       "stop": st.text(min_size=1, max_size=4)
                                       | st.lists(st.text(min_size=1), max_size=8),
                                       "stream": st.booleans(), "ignore_eos": st.booleans()}))
def test_valid_requests_parse(body):
    req = parse(CompletionRequest, body)
    assert req.prompt == body["prompt"]


@pytest.fixture(scope="module")
def live():
    llm = LLM(tiny_model("llama"), None, kv="bf16", kv_budget_gb=0.01, tokenizer=word_tokenizer(chat=True),
              max_num_seqs=8, max_model_len=64)
    with serving(llm) as srv, httpx.Client(base_url=srv.url, timeout=60) as client:
        yield llm, client


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_live_server_answers_every_body_with_200_or_a_4xx(live, data):
    _, client = live
    route = data.draw(st.sampled_from(sorted(PROMPTS)))
    body = data.draw(fuzzed_body(route))
    content, headers = json.dumps(body), {"Content-Type": "application/json"}  # NaN and Infinity included
    if isinstance(body, dict) and body.get("stream") is True:
        with client.stream("POST", route, content=content, headers=headers) as r:
            text = r.read().decode()
    else:
        r = client.post(route, content=content, headers=headers)
        text = r.text
    event(f"{route} {r.status_code}")
    assert r.status_code in (200, 400, 404), (body, r.status_code, text)
    if r.status_code != 200:
        err = r.json()["error"]
        assert err["type"] in ("invalid_request_error", "not_found_error") and "\n" not in err["message"]
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert text.rstrip().endswith("data: [DONE]") and '"error"' not in text
    else:
        assert len(r.json()["choices"]) == body.get("n", 1)


def test_live_server_is_healthy_after_the_fuzz(live):
    llm, client = live
    wait_idle(llm)
    assert client.get("/health").status_code == 200
    assert_no_pages_held(llm)
    assert "oscarkv_requests_failed_total 0.0" in client.get("/metrics").text
