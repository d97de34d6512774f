"""Serving benchmark in the shape of vLLM's: a Poisson stream of streaming completion requests against
`oscarkv serve`, reporting time to first token (TTFT), inter-token latency (ITL), time per output token (TPOT)
and end-to-end latency percentiles, request and token throughput, as JSON with provenance.

Prompts are random token ids (``--input-len`` each, ids in ``[100, 10000)``, valid for any real tokenizer) and
every request generates exactly ``--output-len`` tokens (``ignore_eos``), as vLLM's "random" dataset does.

Against a running server::

    python benchmarks/bench_serve.py --url http://127.0.0.1:8000 --num-prompts 200 --request-rate 4 --out serve.json

Or start one for the run (``--serve`` takes the arguments of `oscarkv serve`; the port is chosen free)::

    PYTHONPATH=. python benchmarks/bench_serve.py --serve "smollm2-135m --kv oscar --calibration DIR" \\
        --num-prompts 16 --request-rate 0.5 --input-len 64 --output-len 32 --out serve_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from oscarkv.bench.harness import provenance

PERCENTILES = (50, 90, 99)


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    sent: float = 0.0
    token_times: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0


async def one_request(client: httpx.AsyncClient, model: str, prompt: list[int], output_len: int) -> Result:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    res = Result(sent=time.perf_counter())
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    res.error = event["error"]["message"]
                    return res
                now = time.perf_counter()
                for choice in event.get("choices", []):
                    res.token_times.extend([now] * len(choice.get("token_ids", [])))
                if event.get("usage"):
                    res.output_tokens = event["usage"]["completion_tokens"]
                    res.prompt_tokens = event["usage"]["prompt_tokens"]
        res.ok = res.output_tokens == output_len and len(res.token_times) == output_len
        if not res.ok:
            res.error = f"got {res.output_tokens} tokens ({len(res.token_times)} streamed), expected {output_len}"
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run_load(url: str, model: str, prompts: list[list[int]], output_len: int, rate: float, seed: int,
                   max_concurrency: int | None) -> tuple[list[Result], float]:
    """Send ``prompts`` with exponential inter-arrival times of mean ``1 / rate`` (all at once if rate is inf)."""
    rng = random.Random(seed)
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(3600.0), limits=limits) as client:

        async def limited(prompt: list[int]) -> Result:
            if gate is None:
                return await one_request(client, model, prompt, output_len)
            async with gate:
                return await one_request(client, model, prompt, output_len)

        tasks = []
        start = time.perf_counter()
        for prompt in prompts:
            tasks.append(asyncio.create_task(limited(prompt)))
            if math.isfinite(rate):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


def summarize(results: list[Result], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    ttft = [1e3 * (r.token_times[0] - r.sent) for r in ok]
    itl = [1e3 * (b - a) for r in ok for a, b in zip(r.token_times, r.token_times[1:])]
    tpot = [1e3 * (r.token_times[-1] - r.token_times[0]) / (len(r.token_times) - 1) for r in ok
            if len(r.token_times) > 1]
    e2e = [1e3 * (r.token_times[-1] - r.sent) for r in ok]
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": round(duration, 3),
        "request_throughput_per_s": round(len(ok) / duration, 4),
        "output_throughput_tok_per_s": round(out_tokens / duration, 3),
        "total_throughput_tok_per_s": round((out_tokens + sum(r.prompt_tokens for r in ok)) / duration, 3),
        "ttft_ms": stats(ttft), "tpot_ms": stats(tpot), "itl_ms": stats(itl), "e2e_latency_ms": stats(e2e),
    }


def stats(xs: list[float]) -> dict:
    if not xs:
        return {}
    xs = sorted(xs)
    out = {"mean": round(statistics.fmean(xs), 3)}
    for p in PERCENTILES:  # nearest-rank percentile
        out[f"p{p}"] = round(xs[min(len(xs) - 1, max(0, math.ceil(p / 100 * len(xs)) - 1))], 3)
    return out


@contextmanager
def launched(serve_args: str, startup_timeout: float):
    """`oscarkv serve SERVE_ARGS --port 0` in a subprocess; yields its URL; SIGTERM at the end."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "oscarkv", "serve", *shlex.split(serve_args), "--port", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        match = re.search(r" on (http://\S+)", line)
        if not match:
            raise SystemExit(f"`{' '.join(cmd)}` did not start (exit code {proc.wait()})")
        url = match.group(1)
        deadline = time.monotonic() + startup_timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            raise SystemExit(f"the server at {url} did not become healthy in {startup_timeout:g} s")
        yield url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8000")
    where.add_argument("--serve", metavar="ARGS", help="start `oscarkv serve ARGS` for the run")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests per second (Poisson); inf: all "
                                                                        "at once")
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most (default: no cap)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=1, help="requests sent (and discarded) before timing")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--out", help="write the JSON here (it is always printed)")
    args = p.parse_args()
    if args.num_prompts < 1 or args.input_len < 1 or args.output_len < 1 or not args.request_rate > 0:
        p.error("--num-prompts, --input-len, --output-len and --request-rate must be > 0")
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(100, 10000) for _ in range(args.input_len)] for _ in range(args.num_prompts)]

    @contextmanager
    def given(url: str):
        yield url

    with (launched(args.serve, args.startup_timeout) if args.serve else given(args.url)) as url:
        card = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]
        if args.warmup:
            asyncio.run(run_load(url, card["id"], prompts[: args.warmup], args.output_len, math.inf, args.seed,
                                 None))
        results, duration = asyncio.run(run_load(url, card["id"], prompts, args.output_len, args.request_rate,
                                                 args.seed, args.max_concurrency))
    device = card.get("device", "unknown")  # where the server's model runs
    report = {
        "benchmark": "bench_serve",
        "hardware": "GPU" if device.startswith("cuda") else "CPU",
        "server": {"model": card["id"], "device": device, "max_model_len": card.get("max_model_len"),
                   "command": f"oscarkv serve {args.serve}" if args.serve else None, "url": args.url},
        "config": {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in vars(args).items()
                   if k not in ("url", "serve", "out")},
        "results": summarize(results, duration),
        "provenance": {**provenance(), "client_host": {"platform": platform.platform(), "cpus": os.cpu_count(),
                                                          "load_average_at_end": os.getloadavg()}},
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0 if report["results"]["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
