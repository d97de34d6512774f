"""The HTTP API against a live server on a tiny engine: validation, status codes, chat, streaming, metrics,
isolation of bad requests, disconnects, limits on bodies and connections."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
from serve_helpers import (
    assert_no_pages_held,
    chat_llm,
    metric,
    raw_request,
    serving,
    sse,
    status_of,
    stream_tokens,
    tiny_llm,
    wait_idle,
)

from oscarkv.serve import ServeConfig


@pytest.fixture(scope="module")
def server():
    llm = tiny_llm("bf16")
    with serving(llm) as srv:
        yield srv


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


def complete(client, **body):
    return client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0, **body})


def assert_error(r, status, *words):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and "\n" not in err["message"]
    for w in words:
        assert w in err["message"], err["message"]
    return err


# ------------------------------------------------------------------------------------------- surface
def test_models_health_and_usage(client):
    assert client.get("/health").json()["status"] == "ok"
    models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny"] and models["data"][0]["max_model_len"] == 256
    r = complete(client, max_tokens=5, ignore_eos=True)
    body = r.json()
    assert r.status_code == 200 and body["object"] == "text_completion"
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
    assert len(body["choices"][0]["token_ids"]) == 5 and body["choices"][0]["finish_reason"] == "length"
    assert_error(complete(client, model="other"), 404, "'other' does not exist")


def test_n_choices_are_generated_not_ignored(client):
    r = complete(client, n=3, max_tokens=6, temperature=1.0, seed=7, ignore_eos=True)
    body = r.json()
    assert r.status_code == 200 and [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert body["usage"]["completion_tokens"] == 18
    ids = [tuple(c["token_ids"]) for c in body["choices"]]
    assert len(set(ids)) > 1  # seeds seed, seed+1, seed+2: different samples
    again = complete(client, n=3, max_tokens=6, temperature=1.0, seed=7, ignore_eos=True).json()
    assert [tuple(c["token_ids"]) for c in again["choices"]] == ids  # seeded: reproducible
    assert_error(complete(client, n=17), 400, "n:")


@pytest.mark.parametrize("field, value, words", [
    ("logprobs", 1, ["logprobs", "not supported"]),
    ("echo", True, ["echo", "not supported"]),
    ("max_tokens", True, ["max_tokens", "integer"]),
    ("max_tokens", 2.0, ["max_tokens", "integer"]),
    ("stop", "", ["stop", "non-empty"]),
    ("stop", [""], ["stop", "non-empty"]),
    ("stop", [1, 2], ["stop"]),
    ("top_k", 1e30, ["top_k", "integer"]),
    ("seed", "abc", ["seed", "integer"]),
    ("seed", -1, ["seed"]),
    ("temperature", "0.5", ["temperature"]),
    ("temperature", 2.5, ["temperature"]),
    ("top_p", 0, ["top_p"]),
    ("n", 0, ["n:"]),
    ("stream", "yes", ["stream"]),
    ("presence_penalty", 0.5, ["unknown field 'presence_penalty'"]),
    ("max_token", 3, ["unknown field 'max_token'"]),
])
def test_invalid_fields_are_rejected(client, field, value, words):
    err = assert_error(complete(client, **{field: value}), 400, *words)
    assert err["param"] == field


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_numbers_are_rejected(client, literal):
    for field in ("temperature", "top_p"):
        body = f'{{"prompt": [1, 2], "{field}": {literal}}}'
        r = client.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
        assert_error(r, 400, field, "finite")


@pytest.mark.parametrize("prompt, words", [
    (5, ["prompt", "string or a non-empty list"]), (None, ["prompt"]), (1.5, ["prompt"]),
    ([[1, 2]], ["batched prompts"]), ([], ["prompt"]), ([1, True], ["prompt"]),
    ([1000000000], ["token id 1000000000", "vocabulary [0, 512)"]), ([-5, 1, 2], ["token id -5"]),
    ([1] * 256, ["256 tokens", "context is 256"]), ("hello", ["no tokenizer"]),
    ([1] * 250, ["max_tokens is 16", "context of 256"]),
])
def test_invalid_prompts_are_rejected(client, prompt, words):
    assert_error(client.post("/v1/completions", json={"prompt": prompt}), 400, *words)


def test_stop_strings_without_a_tokenizer_are_rejected(client):
    assert_error(complete(client, stop=["x"]), 400, "stop strings need a tokenizer")


@pytest.mark.parametrize("body, status, words", [
    (b"[1, 2, 3]", 400, ["JSON object", "list"]), (b'"hello"', 400, ["JSON object", "str"]),
    (b"{not json", 400, ["not valid JSON"]), (b"\xff\xfe", 400, ["not valid JSON"]),
    (b'{"messages": [{"role": "user"}]}', 400, ["messages.0.content", "required"]),
    (b'{"messages": []}', 400, ["messages"]),
    (b'{"messages": [{"role": "robot", "content": "x"}]}', 400, ["messages.0.role"]),
])
def test_malformed_chat_bodies_get_an_answer(client, body, status, words):
    r = client.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
    assert_error(r, status, *words)


def test_chat_without_a_template_is_a_clear_400(client):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert_error(r, 400, "no chat template")


def test_other_methods_and_routes_get_json_errors(client):
    r = client.put("/v1/completions", json={})
    assert_error(r, 405, "PUT") and r.headers["allow"] == "POST"
    assert_error(client.get("/v1/completions"), 405, "GET")
    assert_error(client.delete("/health"), 405)
    assert_error(client.get("/v2/nothing"), 404, "no route")


# ---------------------------------------------------------------------------------------------- chat
def test_chat_through_the_template_transformers_5():
    """``apply_chat_template(tokenize=True)`` returns a mapping in transformers 5: the ids are taken from it."""
    llm = chat_llm()
    messages = [{"role": "system", "content": "w1 w2"}, {"role": "user", "content": [{"type": "text", "text": "w3"}]}]
    flat = [{"role": "system", "content": "w1 w2"}, {"role": "user", "content": "w3"}]  # text parts joined
    expected = llm.tokenizer.apply_chat_template(flat, add_generation_prompt=True, tokenize=True)["input_ids"]
    with serving(llm) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        r = c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 5, "temperature": 0,
                                                 "ignore_eos": True})
        body = r.json()
        assert r.status_code == 200, r.text
        assert body["object"] == "chat.completion" and body["usage"]["prompt_tokens"] == len(expected)
        msg = body["choices"][0]["message"]
        assert msg["role"] == "assistant" and msg["content"] == llm.decode(body["choices"][0]["token_ids"])
        assert msg["content"].strip() and body["usage"]["completion_tokens"] == 5
        with c.stream("POST", "/v1/chat/completions", json={"messages": messages, "max_tokens": 5, "temperature": 0,
                                                            "ignore_eos": True, "stream": True}) as s:
            events = sse(s)
        assert s.status_code == 200 and events[0]["choices"][0]["delta"]["role"] == "assistant"
        text = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
        assert text == msg["content"] and stream_tokens(events)[0] == body["choices"][0]["token_ids"]
        assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_chat_template_errors_and_text_prompts():
    llm = chat_llm()
    llm.tokenizer.chat_template = "{{ raise_exception('roles must alternate') }}"
    with serving(llm) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "w1"}]})
        assert_error(r, 400, "chat template rejected", "roles must alternate")
        r = c.post("/v1/completions", json={"prompt": "w1 w2 w3", "max_tokens": 3, "temperature": 0,
                                            "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 4  # <s> w1 w2 w3


def test_stop_strings_cut_the_text_and_never_stream_past_it():
    llm = chat_llm()
    with serving(llm) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        free = c.post("/v1/completions", json={"prompt": "w1 w2", "max_tokens": 8, "temperature": 0,
                                               "ignore_eos": True}).json()["choices"][0]["text"]
        words = free.split()
        assert len(words) >= 3
        stop = words[2]
        body = {"prompt": "w1 w2", "max_tokens": 8, "temperature": 0, "ignore_eos": True, "stop": [stop]}
        cut = c.post("/v1/completions", json=body).json()["choices"][0]
        assert cut["finish_reason"] == "stop" and stop not in cut["text"] and free.startswith(cut["text"])
        with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
            streamed = "".join(e["choices"][0]["text"] for e in sse(s))
        assert streamed == cut["text"]


# ------------------------------------------------------------------------------------------ streaming
def test_streaming_rejections_get_a_real_status(client):
    with client.stream("POST", "/v1/completions", json={"prompt": [1000000000], "stream": True}) as r:
        assert r.status_code == 400 and "vocabulary" in json.loads(r.read())["error"]["message"]


def test_stream_usage_and_done(client):
    with client.stream("POST", "/v1/completions", json={"prompt": [1, 2], "max_tokens": 3, "ignore_eos": True,
                                                        "stream": True, "n": 2,
                                                        "stream_options": {"include_usage": True}}) as r:
        events = sse(r)
    assert r.headers["content-type"].startswith("text/event-stream")
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 6
    assert {i: len(t) for i, t in stream_tokens(events).items()} == {0: 3, 1: 3}


# ------------------------------------------------------------------------------------------ isolation
BAD_REQUESTS = [
    {"prompt": 5}, {"prompt": None}, {"prompt": 1.5}, {"prompt": [[1, 2]]}, {"prompt": [1000000000]},
    {"prompt": [-5, 1, 2]}, {"prompt": [1, 2], "stop": [1, 2]}, {"prompt": [1, 2], "top_k": 1e30},
    {"prompt": [1, 2], "seed": "abc"}, {"prompt": [1, 2], "max_tokens": 10**6},
    {"prompt": [1, 2], "temperature": -1}, {"prompt": [1, 2], "max_tokens": True},
]


def test_bad_requests_never_kill_the_engine_nor_touch_an_innocent_stream():
    llm = tiny_llm("oscar", pages=400)
    innocent = {"prompt": list(range(1, 40)), "max_tokens": 60, "temperature": 0, "ignore_eos": True,
                "stream": True}
    with serving(llm) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=innocent) as r:
            alone = stream_tokens(sse(r))[0]
        assert len(alone) == 60
        statuses = []

        def attack():
            with httpx.Client(base_url=srv.url, timeout=60) as a:
                for _ in range(3):
                    for bad in BAD_REQUESTS:
                        statuses.append(a.post("/v1/completions", json=bad).status_code)

        with c.stream("POST", "/v1/completions", json=innocent) as r:
            t = threading.Thread(target=attack)
            t.start()
            during = stream_tokens(sse(r))[0]
            t.join()
        assert during == alone
        assert statuses and set(statuses) == {400}
        assert c.get("/health").status_code == 200
        assert complete(c).status_code == 200
        wait_idle(llm)
        assert_no_pages_held(llm)


def test_a_failing_step_fails_its_requests_with_500_and_the_loop_keeps_serving():
    llm = tiny_llm("bf16")
    real_step, calls = llm.step, []

    def flaky_step():
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected fault")
        return real_step()

    llm.step = flaky_step
    with serving(llm) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        r = complete(c, max_tokens=20, ignore_eos=True)
        assert_error(r, 500, "injected fault", "keeps serving")
        with c.stream("POST", "/v1/completions", json={"prompt": [1, 2], "max_tokens": 5, "stream": True,
                                                       "ignore_eos": True}) as s:
            events = sse(s)
        assert s.status_code == 200 and len(stream_tokens(events)[0]) == 5
        assert c.get("/health").status_code == 200
        text = c.get("/metrics").text
        assert metric(text, "oscarkv_engine_step_errors_total") == 1
        assert metric(text, "oscarkv_requests_failed_total") == 1
        wait_idle(llm)
        assert_no_pages_held(llm)


def test_a_fault_mid_stream_ends_the_stream_with_an_error_event():
    llm = tiny_llm("bf16")
    real_step, calls = llm.step, []

    def flaky_step():
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("injected fault")
        return real_step()

    llm.step = flaky_step
    with serving(llm) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json={"prompt": [1, 2], "max_tokens": 20, "stream": True,
                                                       "ignore_eos": True}) as s:
            events = sse(s)
        assert "injected fault" in events[-1]["error"]["message"] and events[-1]["error"]["type"] == "server_error"


def test_health_reports_a_broken_engine_and_requests_get_503():
    llm = tiny_llm("bf16")
    with serving(llm) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        assert c.get("/health").status_code == 200

        def broken():
            raise RuntimeError("state lost")

        llm.engine.has_work = broken
        deadline = time.monotonic() + 10
        while c.get("/health").status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert_error(c.get("/health"), 503, "state lost")
        assert_error(complete(c), 503, "state lost")
        assert metric(c.get("/metrics").text, "oscarkv_engine_healthy") == 0


def test_health_reports_a_stalled_step_then_recovers():
    llm = tiny_llm("bf16")
    real_step, calls = llm.step, []

    def slow_step():
        calls.append(1)
        if len(calls) == 2:
            time.sleep(1.5)
        return real_step()

    llm.step = slow_step
    with serving(llm, ServeConfig(model_name="tiny", stall_timeout_s=0.5)) as srv, \
            httpx.Client(base_url=srv.url, timeout=30) as c:
        done = []
        t = threading.Thread(target=lambda: done.append(complete(c, max_tokens=4, ignore_eos=True).status_code))
        t.start()
        time.sleep(1.0)
        assert_error(c.get("/health"), 503, "inside one step for more than 0.5 s")
        t.join()
        assert done == [200] and c.get("/health").status_code == 200


# ---------------------------------------------------------------------------------------------- metrics
def test_metric_counters_count():
    llm = tiny_llm("oscar", pages=24)  # 96 tokens of 2-bit pages: 8 concurrent requests must preempt
    with serving(llm) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        before = c.get("/metrics").text
        assert metric(before, "oscarkv_generation_tokens_total") == 0
        bodies = [{"prompt": list(range(1, 30)), "max_tokens": 40, "temperature": 0, "ignore_eos": True}] * 8
        with httpx.Client(base_url=srv.url, timeout=60) as a:
            threads = [threading.Thread(target=a.post, args=("/v1/completions",), kwargs={"json": b}) for b in bodies]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        complete(c, prompt=[7])  # 4 more tokens
        assert_error(complete(c, prompt=[-1]), 400)
        text = c.get("/metrics").text
        assert metric(text, "oscarkv_generation_tokens_total") == 8 * 40 + 4
        assert metric(text, "oscarkv_requests_total") == 9
        assert metric(text, "oscarkv_prompt_tokens_total") == 8 * 29 + 1
        assert metric(text, "oscarkv_requests_rejected_total") == 1
        assert 'oscarkv_requests_finished_total{finish_reason="length"} 9.0' in text
        preempted = metric(text, "oscarkv_preemptions_total")
        assert preempted > 0 and preempted == llm.gauges()["preemptions"]
        assert metric(text, "oscarkv_time_to_first_token_seconds_count") == 9
        assert metric(text, "oscarkv_inter_token_latency_seconds_count") == 8 * 39 + 3
        assert 'oscarkv_quant_samples{kv="k",layer="0"}' in text and "oscarkv_kv_pages_total" in text


# -------------------------------------------------------------------------------------------- disconnects
@pytest.mark.parametrize("stream", [False, True])
def test_a_client_disconnect_aborts_its_request(stream):
    llm = tiny_llm("bf16")
    with serving(llm) as srv:
        body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 250, "ignore_eos": True, "stream": stream}).encode()
        s = socket.create_connection(("127.0.0.1", srv.port))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 10
        while not llm.engine.has_work() and time.monotonic() < deadline:
            time.sleep(0.005)
        assert llm.engine.has_work()
        s.close()
        wait_idle(llm, 10)
        assert not llm.engine.has_work()
        assert_no_pages_held(llm)
        with httpx.Client(base_url=srv.url) as c:
            text = c.get("/metrics").text
        assert metric(text, "oscarkv_requests_aborted_total") == 1
        assert metric(text, "oscarkv_generation_tokens_total") < 250


# ---------------------------------------------------------------------------------- bodies and connections
def test_bodies_are_bounded():
    llm = tiny_llm("bf16")
    with serving(llm, ServeConfig(max_body_bytes=64 * 1024, body_timeout_s=0.5)) as srv:
        big = json.dumps({"prompt": [1] * 30000}).encode()
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            assert_error(c.post("/v1/completions", content=big), 413, "accepts at most 65536")
            chunked = c.post("/v1/completions", content=iter([big[i:i + 8192] for i in range(0, len(big), 8192)]))
            assert_error(chunked, 413, "exceeds 65536 bytes")
        # a 100 MB Content-Length is refused before any of the body is read
        t0 = time.monotonic()
        raw = raw_request(srv.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100000000\r\n\r\n{")
        assert status_of(raw) == 413 and time.monotonic() - t0 < 5
        # a Content-Length larger than the body: 408 once the body timeout passes
        t0 = time.monotonic()
        raw = raw_request(srv.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{}")
        assert status_of(raw) == 408 and b"did not arrive within 0.5 s" in raw and time.monotonic() - t0 < 5
        raw = raw_request(srv.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n{}")
        assert status_of(raw) == 400


def test_connections_are_bounded_and_slow_heads_time_out():
    llm = tiny_llm("bf16")
    with serving(llm, max_connections=4, head_timeout_s=1.0) as srv:
        idle = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(4)]
        try:
            time.sleep(0.2)
            raw = raw_request(srv.port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert status_of(raw) == 503  # over the connection limit
            # idle and slow connections are closed once the head timeout passes, however they trickle
            t0 = time.monotonic()
            idle[0].sendall(b"GET /heal")
            for s in idle:
                s.settimeout(5)
                while s.recv(1024):
                    pass
            assert time.monotonic() - t0 < 4
        finally:
            for s in idle:
                s.close()
        raw = raw_request(srv.port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status_of(raw) == 200
