"""Helpers for the server tests (a unique module name, unlike conftest): tiny engines, a served instance, an SSE
reader and raw-socket requests."""

from __future__ import annotations

import json
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import torch

from oscarkv.artifact import Calibration
from oscarkv.config import QuantSpec
from oscarkv.engine import LLM, PRESETS, random_model
from oscarkv.engine.llm import identity_of
from oscarkv.serve import ServeConfig, Server

sys.path.insert(0, str(Path(__file__).parents[1] / "calib"))
from calib_helpers import tiny_model, word_tokenizer

VOCAB = PRESETS["tiny-llama"].vocab_size


def tiny_llm(kv: str = "bf16", pages: int | None = None, max_num_seqs: int = 32, max_model_len: int = 256) -> LLM:
    """The random tiny-llama engine, token ids only (no tokenizer). ``pages``: about this many pages in the KV pool
    (OSCAR: 2-bit pages of 4 tokens besides the 16-bit windows; BF16: pages of 64 tokens), few enough that
    concurrent requests preempt each other; None: a large pool."""
    model = random_model(PRESETS["tiny-llama"], dtype=torch.float32, seed=0)
    calib = None
    if kv == "oscar":
        spec = QuantSpec(sink=4, window=8, page_size=4, k_clip=0.9, v_clip=0.9, centering=False, composition="none")
        calib = Calibration.identity(identity_of(model.cfg), spec, clip=0.9)
    budget = 0.05
    if pages is not None:
        c = model.cfg
        row = 2 * c.num_layers * c.num_kv_heads * c.head_dim  # K and V elements of one token, all layers
        if kv == "oscar":  # 17 bf16 window rows per slot (and a scratch slot), then 2-bit pages of 4 tokens
            bytes_ = (max_num_seqs + 1) * 17 * row * 2 + pages * (4 * row // 4 + 4 * row // c.head_dim * 4) + 256
        else:  # float32 pages of 64 tokens
            bytes_ = pages * 64 * row * 4
        budget = bytes_ / 2**30
    llm = LLM(model, calib, kv=kv, kv_budget_gb=budget, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
              monitor_every=1, method="oscar-nocenter" if kv == "oscar" else None)
    return llm


def chat_llm(chat_template: bool = True) -> LLM:
    """A tiny transformers Llama (vocabulary of 96 words) with a word-level fast tokenizer."""
    return LLM(tiny_model("llama"), None, kv="bf16", kv_budget_gb=0.01, tokenizer=word_tokenizer(chat=chat_template),
               max_num_seqs=8, max_model_len=256)


@contextmanager
def serving(llm: LLM, config: ServeConfig | None = None, **kw: Any) -> Iterator[Server]:
    srv = Server(llm, port=0, config=config or ServeConfig(model_name="tiny", body_timeout_s=5.0), **kw).start()
    try:
        yield srv
    finally:
        srv.shutdown()


def sse(response: httpx.Response) -> list[dict]:
    """The JSON events of a server-sent-event stream up to ``[DONE]``."""
    events = []
    for line in response.iter_lines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            break
        events.append(json.loads(line[6:]))
    return events


def stream_tokens(events: list[dict]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for e in events:
        for c in e.get("choices", []):
            out.setdefault(c["index"], []).extend(c["token_ids"])
    return out


def raw_request(port: int, data: bytes, wait_s: float = 10.0) -> bytes:
    """Send raw bytes, return what the server answers before closing or within ``wait_s``."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait_s) as s:
        s.sendall(data)
        chunks = []
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            try:
                chunk = s.recv(65536)
            except TimeoutError:
                break
            if not chunk:
                break
            chunks.append(chunk)
            if b"\r\n\r\n" in b"".join(chunks) and _complete(b"".join(chunks)):
                break
        return b"".join(chunks)


def _complete(data: bytes) -> bool:
    head, _, body = data.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return len(body) >= int(line.split(b":")[1])
    return False


def status_of(raw: bytes) -> int:
    return int(raw.split(b" ", 2)[1]) if raw.startswith(b"HTTP/") else 0


def wait_idle(llm: LLM, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while llm.engine.has_work() and time.monotonic() < deadline:
        time.sleep(0.02)


def assert_no_pages_held(llm: LLM) -> None:
    """Every KV page is free again (no request holds or leaked one)."""
    g = llm.gauges()
    assert g["kv_pages_free"] == g["kv_pages_total"], g


def metric(text: str, name: str) -> float:
    """The value of an unlabelled sample in Prometheus text."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)
