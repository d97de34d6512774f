"""`oscarkv serve` as a process: it starts on a free port, serves a saved model with its tokenizer, and on SIGTERM
lets the stream in flight finish before it exits 0."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from serve_helpers import sse, stream_tokens, tiny_model, word_tokenizer

from oscarkv import models

ROOT = Path(__file__).parents[2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("serve-cli")
    models.save_cache(tiny_model("llama"), word_tokenizer(), root / "model", {"name": "tiny"})
    return root / "model"


def _start(model_dir: Path) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "oscarkv", "serve", str(model_dir), "--kv", "bf16",
                             "--kv-budget-gb", "0.01", "--max-model-len", "128", "--port", "0",
                             "--served-model-name", "tiny"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline()
    match = re.search(r"on (http://127\.0\.0\.1:\d+)", line)
    assert match, (line, proc.stderr.read() if proc.poll() is not None else "")
    url = match.group(1)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health").status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.1)
    proc.kill()
    raise AssertionError("the server did not become healthy")


def test_serve_process_and_graceful_sigterm(model_dir):
    proc, url = _start(model_dir)
    try:
        with httpx.Client(base_url=url, timeout=60) as c:
            assert c.get("/v1/models").json()["data"][0]["id"] == "tiny"
            r = c.post("/v1/completions", json={"prompt": "w1 w2", "max_tokens": 3, "ignore_eos": True})
            assert r.status_code == 200 and r.json()["usage"] == {"prompt_tokens": 3, "completion_tokens": 3,
                                                                 "total_tokens": 6}
            r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "w1"}]})
            assert r.status_code == 400 and "no chat template" in r.json()["error"]["message"]
        events, started = [], threading.Event()

        def stream():
            body = {"prompt": [1, 2, 3], "max_tokens": 100, "ignore_eos": True, "stream": True}
            with httpx.Client(base_url=url, timeout=60) as c, c.stream("POST", "/v1/completions", json=body) as r:
                for line in r.iter_lines():
                    started.set()
                    if line.startswith("data: "):
                        events.append(line)

        t = threading.Thread(target=stream)
        t.start()
        assert started.wait(30)
        proc.send_signal(signal.SIGTERM)
        t.join(60)
        assert proc.wait(60) == 0
        assert events[-1] == "data: [DONE]"
        parsed = sse(_Lines(events))
        assert len(stream_tokens(parsed)[0]) == 100 and parsed[-1]["choices"][0]["finish_reason"] == "length"
        with pytest.raises(httpx.TransportError):
            httpx.get(url + "/health")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


class _Lines:
    def __init__(self, lines: list[str]):
        self.lines = lines

    def iter_lines(self):
        return iter(self.lines)
