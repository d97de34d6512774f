"""``oscarkv bench``'s plots: what is drawn (``series``), the PNGs, and ``--plot`` redrawing a committed result on
a machine without a GPU."""

import argparse
import json
from pathlib import Path

import pytest

from oscarkv.cli import bench
from oscarkv.bench.plots import plot_results, series

RESULT = Path(__file__).resolve().parents[2] / "docs" / "results" / "e2e_h200_2026-12-01_e990e9a.json"


def _row(kv, ctx, ms, variant="on", **kw):
    return {"kv": kv, "context": ctx, "graph_ms": ms, "floor_ms": ms / 1.3, "variant": variant, **kw}


def _synthetic():
    lat = [_row("oscar", 131072, 5.0), _row("bf16", 32768, 5.2), _row("oscar", 32768, 4.5),
           _row("oscar", 32768, 4.9, variant="off"), {"kv": "bf16", "context": 65536, "error": "OOM"},
           _row("bf16", 131072, 8.6)]
    thr = [_row("oscar", 131072, 36.0, batch=34, tokens_per_s=940.0), _row("bf16", 131072, 8.6, batch=1,
           tokens_per_s=116.0), _row("oscar", 131072, 5.3, batch=1, tokens_per_s=187.0),
           _row("bf16", 131072, 31.0, batch=4, tokens_per_s=129.0)]
    mem = {"bf16": {"paged_bytes_per_token": 147456.0, "bytes_per_token_at_ctx": 147456.0},
           "oscar": {"paged_bytes_per_token": 20736.0, "bytes_per_token_at_ctx": 21118.5}}
    return {"provenance": {"git_sha": "abc1234", "gpu": "test GPU"},
            "models": {"m": {"latency": lat, "throughput": thr, "memory": mem}}}


def test_series_sorts_picks_the_on_variant_and_skips_errors():
    s = series(_synthetic())["m"]
    assert s["latency"]["oscar"] == [(32768, 4.5, 4.5 / 1.3), (131072, 5.0, 5.0 / 1.3)]  # "on", not "off"
    assert s["latency"]["bf16"] == [(32768, 5.2, 5.2 / 1.3), (131072, 8.6, 8.6 / 1.3)]  # the OOM row left out
    assert s["throughput"]["oscar"] == [(1, 187.0), (34, 940.0)] and s["throughput"]["bf16"] == [(1, 116.0), (4, 129.0)]
    assert s["throughput_context"] == 131072
    assert s["memory"] == {"bf16": (147456.0, 147456.0), "oscar": (20736.0, 21118.5)}


def test_series_draws_the_per_layer_mix_where_present():
    res = _synthetic()
    res["models"]["m"]["latency"] += [_row("oscar-mix", 131072, 5.4), _row("oscar-mix", 32768, 4.7)]
    res["models"]["m"]["memory"]["oscar-mix"] = {"paged_bytes_per_token": 22000.0, "bytes_per_token_at_ctx": 22400.0}
    s = series(res)["m"]
    assert s["latency"]["oscar-mix"] == [(32768, 4.7, 4.7 / 1.3), (131072, 5.4, 5.4 / 1.3)]
    assert s["memory"]["oscar-mix"] == (22000.0, 22400.0) and s["throughput"]["oscar-mix"] == []
    assert series(_synthetic())["m"]["latency"]["oscar-mix"] == []  # results without it: nothing drawn


def test_series_of_the_committed_h200_result():
    res = json.loads(RESULT.read_text())
    s = series(res)
    rows = [r for r in res["models"]["qwen3-8b"]["latency"] if "graph_ms" in r and r["kv"] == "oscar"]
    assert s["qwen3-8b"]["latency"]["oscar"] == sorted((r["context"], r["graph_ms"], r["floor_ms"]) for r in rows)
    assert len(rows) >= 2 and s["qwen3-8b"]["throughput"]["oscar"][-1][0] > s["qwen3-8b"]["throughput"]["bf16"][-1][0]


def test_plot_results_writes_three_pngs(tmp_path):
    pytest.importorskip("matplotlib")
    paths = plot_results(_synthetic(), tmp_path, prefix="run")
    assert sorted(p.name for p in paths) == ["run_latency.png", "run_memory.png", "run_throughput.png"]
    for p in paths:
        data = p.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_plot_results_without_data_writes_nothing(tmp_path):
    pytest.importorskip("matplotlib")
    assert plot_results({"models": {"m": {"latency": [{"kv": "bf16", "context": 1, "error": "x"}]}}}, tmp_path) == []


def test_bench_plot_redraws_a_result_without_a_gpu(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    src = tmp_path / "e2e_h200.json"
    src.write_text(RESULT.read_text())
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    assert bench.run(parser.parse_args(["--plot", str(src)])) == 0
    for name in ("e2e_h200_latency.png", "e2e_h200_throughput.png", "e2e_h200_memory.png"):
        assert (tmp_path / name).stat().st_size > 10_000
    assert "wrote" in capsys.readouterr().out
