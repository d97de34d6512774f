"""A load test of the server on the CPU: 200 requests, 32 at a time, half streaming, a fifth cancelled midway,
bad requests mixed in, a KV pool small enough to force preemption. Afterwards: every valid request answered
in full, identical requests with identical outputs, no page leaked, the server healthy."""

from __future__ import annotations

import random
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from serve_helpers import (
    assert_no_pages_held,
    metric,
    serving,
    sse,
    stream_tokens,
    tiny_llm,
    wait_idle,
)
from test_serve_api import BAD_REQUESTS

N_REQUESTS, CONCURRENCY = 200, 32


def _plan(rng: random.Random) -> list[dict]:
    """Request specs: ``body``, ``cancel`` (stream: after this many events; else: a read timeout) or None."""
    prompts = [[rng.randrange(1, 512) for _ in range(rng.randint(1, 40))] for _ in range(10)]
    plan = []
    for i in range(N_REQUESTS):
        if i % 10 == 9:
            plan.append({"body": dict(rng.choice(BAD_REQUESTS)), "cancel": None, "bad": True})
            continue
        body = {"prompt": rng.choice(prompts), "max_tokens": rng.choice([8, 16, 24]), "ignore_eos": True,
                "stream": i % 2 == 0}
        if rng.random() < 0.25:  # seeded sampling is reproducible whatever the batch
            body.update(temperature=0.8, top_p=0.9, seed=rng.randrange(3))
        else:
            body["temperature"] = 0.0
        cancel = None
        if i % 5 == 1:
            cancel = rng.randint(2, 6) if body["stream"] else 0.02
        plan.append({"body": body, "cancel": cancel, "bad": False})
    return plan


def _send(url: str, spec: dict) -> tuple[str, object]:
    body, cancel = spec["body"], spec["cancel"]
    timeout = httpx.Timeout(60.0, read=cancel) if isinstance(cancel, float) else 60.0
    with httpx.Client(base_url=url, timeout=timeout) as c:
        if not body.get("stream"):
            try:
                r = c.post("/v1/completions", json=body)
            except httpx.ReadTimeout:
                return "cancelled", None
            return r.status_code, r.json()
        with c.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return r.status_code, r.read()
            if cancel is None:
                return 200, sse(r)
            events = []
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    events.append(line)
                if len(events) >= cancel:
                    return "cancelled", None  # leaving the block closes the connection mid-stream
            return 200, None


@pytest.mark.parametrize("kv", ["oscar"])
def test_load_with_cancellations_preemption_and_bad_requests(kv):
    llm = tiny_llm(kv, pages=90 if kv == "oscar" else 6, max_num_seqs=16)
    plan = _plan(random.Random(0))
    t0 = time.monotonic()
    with serving(llm) as srv:
        with ThreadPoolExecutor(CONCURRENCY) as pool:
            results = list(pool.map(lambda spec: _send(srv.url, spec), plan))
        elapsed = time.monotonic() - t0
        outputs = defaultdict(set)
        for spec, (status, data) in zip(plan, results):
            body = spec["body"]
            if spec["bad"]:
                assert status == 400, (body, status, data)
                continue
            if status == "cancelled":
                continue
            assert status == 200, (body, status, data)
            if data is None:  # a stream that ended before its cancellation point
                continue
            if body["stream"]:
                tokens = stream_tokens(data)[0]
                assert data[-1]["choices"][0]["finish_reason"] == "length"
            else:
                tokens = data["choices"][0]["token_ids"]
                assert data["usage"]["completion_tokens"] == body["max_tokens"]
            assert len(tokens) == body["max_tokens"]
            key = (tuple(body["prompt"]), body["max_tokens"], body["temperature"], body.get("seed"))
            outputs[key].add(tuple(tokens))
        repeated = [k for k, v in outputs.items() if v]
        assert len(repeated) >= 10
        for key, variants in outputs.items():
            assert len(variants) == 1, f"identical requests gave different outputs: {key}"
        wait_idle(llm)
        assert not llm.engine.has_work()
        assert_no_pages_held(llm)  # no leaked pages
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            assert c.get("/health").status_code == 200
            text = c.get("/metrics").text
            assert c.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}).status_code == 200
        assert metric(text, "oscarkv_preemptions_total") > 0  # the small pool forced preemption
        assert metric(text, "oscarkv_requests_rejected_total") == sum(s["bad"] for s in plan)
        assert metric(text, "oscarkv_requests_aborted_total") >= 1
        assert metric(text, "oscarkv_requests_failed_total") == 0
    print(f"{kv}: {N_REQUESTS} requests in {elapsed:.1f} s, {llm.gauges()['preemptions']} preemptions")
