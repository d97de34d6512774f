"""Load test of the HTTP server on a tiny model: hundreds of concurrent requests, some cancelled mid-stream."""

import http.client
import json
import random
import threading
import time

import pytest
import torch

from oscarkv.artifact import Calibration
from oscarkv.config import QuantSpec
from oscarkv.engine import LLM, PRESETS, random_model
from oscarkv.engine.llm import identity_of
from oscarkv.engine.server import serve


def _tiny_llm(kv: str) -> LLM:
    model = random_model(PRESETS["tiny-llama"], dtype=torch.float32, seed=0)
    calib = None
    if kv == "oscar":
        spec = QuantSpec(sink=4, window=8, page_size=4, k_clip=0.9, v_clip=0.9, centering=False, composition="none")
        calib = Calibration.identity(identity_of(model.cfg), spec, clip=0.9)
    # a small pool (60 pages of 4 tokens besides the 16-bit slots): concurrent requests preempt each other
    slot_kib = 24 * 17 * 2 * 2 * 2 * 32 * 2 / 1024 if kv == "oscar" else 0  # slots x C16+1 x K/V x L x H x d x bf16
    page_kib = 0.375 if kv == "oscar" else 4.0
    budget_gb = (slot_kib + 1.0 + 60 * page_kib) / 2**20
    return LLM(model, calib, kv=kv, kv_budget_gb=budget_gb, max_num_seqs=24, max_model_len=512, monitor_every=1)


def _request(port, body, cancel_after=None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if not body.get("stream"):
        data = json.loads(resp.read())
        conn.close()
        return resp.status, data
    events = []
    while True:
        line = resp.fp.readline()
        if not line:
            break
        if line.startswith(b"data: "):
            if line.strip() == b"data: [DONE]":
                break
            events.append(json.loads(line[6:]))
            if cancel_after is not None and len(events) >= cancel_after:
                resp.close()  # drops the socket: the server sees the client go away
                conn.close()
                return "cancelled", events
    conn.close()
    return resp.status, events


@pytest.mark.parametrize("kv", ["oscar", "bf16"])
def test_load_with_cancellations(kv):
    llm = _tiny_llm(kv)
    srv = serve(llm, port=0)
    port = srv.server_address[1]
    rng = random.Random(0)
    n_req = 200 if kv == "oscar" else 120
    results = [None] * n_req
    specs = []
    for i in range(n_req):
        body = {"prompt": [rng.randrange(512) for _ in range(rng.randint(1, 60))], "max_tokens": rng.randint(1, 40),
                "temperature": rng.choice([0.0, 0.8]), "top_p": 0.9, "ignore_eos": True, "seed": i}
        cancel = None
        if i % 4 == 0:
            body["stream"] = True
            body["max_tokens"] = 40
            cancel = 2 if i % 8 == 0 else None
        specs.append((body, cancel))

    def worker(i):
        results[i] = _request(port, *specs[i])

    t0 = time.monotonic()
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n_req)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    try:
        for (body, cancel), res in zip(specs, results):
            assert res is not None
            if cancel is not None:
                assert res[0] == "cancelled"
                continue
            status, data = res
            assert status == 200
            if body.get("stream"):
                toks = [e["choices"][0]["token_id"] for e in data if e["choices"][0]["token_id"] is not None]
                assert len(toks) == body["max_tokens"] and data[-1]["choices"][0]["finish_reason"] == "length"
            else:
                assert data["usage"]["completion_tokens"] == body["max_tokens"]
                assert data["choices"][0]["finish_reason"] == "length"
        deadline = time.monotonic() + 30
        while llm.engine.has_work() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not llm.engine.has_work()
        assert llm.pool.alloc.num_free == llm.pool.alloc.capacity  # no leaked pages
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
        assert "oscarkv_kv_pool_bytes" in text and "oscarkv_requests_total" in text
        if kv == "oscar":
            assert 'oscarkv_quant_rel_error{kv="k",layer="0"}' in text
            assert llm.monitor.snapshot()[2].sum() > 0
        assert llm.pool.alloc.capacity < 70 and llm.engine.stats["preemptions"] > 0  # the small pool forced preemption and resumption
        print(f"{kv}: {n_req} requests in {time.monotonic() - t0:.1f}s, {llm.engine.stats}")
    finally:
        srv.shutdown()


def test_request_that_never_fits_is_rejected():
    llm = _tiny_llm("bf16")
    srv = serve(llm, port=0)
    try:
        status, data = _request(srv.server_address[1], {"prompt": [1] * 200, "max_tokens": 300})
        assert status == 400 and "pool holds" in data["error"]["message"]
        status, data = _request(srv.server_address[1], {"prompt": [1, 2], "max_token": 3})
        assert status == 400 and "max_token" in data["error"]["message"]
    finally:
        srv.shutdown()
