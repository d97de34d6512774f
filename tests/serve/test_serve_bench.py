"""benchmarks/bench_serve.py against a tiny in-process server: every request completes, the figures are
consistent (percentiles ordered, throughput = completed / duration)."""

from __future__ import annotations

import asyncio
import importlib.util
import math
import sys
from pathlib import Path

from serve_helpers import serving, tiny_llm

_BENCH = Path(__file__).parents[2] / "benchmarks" / "bench_serve.py"
_spec = importlib.util.spec_from_file_location("bench_serve", _BENCH)
bench_serve = importlib.util.module_from_spec(_spec)
sys.modules["bench_serve"] = bench_serve  # dataclasses look their module up there
_spec.loader.exec_module(bench_serve)


def test_poisson_load_and_summary():
    llm = tiny_llm("bf16")
    prompts = [[1 + i, 2, 3, 4] for i in range(8)]
    with serving(llm) as srv:
        results, duration = asyncio.run(bench_serve.run_load(srv.url, "tiny", prompts, 6, rate=20.0, seed=0,
                                                             max_concurrency=4))
    summary = bench_serve.summarize(results, duration)
    assert summary["completed"] == 8 and summary["failed"] == 0
    assert math.isclose(summary["request_throughput_per_s"], 8 / duration, rel_tol=1e-3)
    for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_latency_ms"):
        s = summary[key]
        assert 0 < s["p50"] <= s["p90"] <= s["p99"], (key, s)
    assert summary["e2e_latency_ms"]["p50"] >= summary["ttft_ms"]["p50"]
    assert all(len(r.token_times) == 6 and r.prompt_tokens == 4 for r in results)


def test_percentiles_are_nearest_rank():
    s = bench_serve.stats([float(x) for x in range(1, 101)])
    assert (s["p50"], s["p90"], s["p99"], s["mean"]) == (50.0, 90.0, 99.0, 50.5)
