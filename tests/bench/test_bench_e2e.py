"""The end-to-end suites on the CPU with the tiny preset: they drive the engine through its public API (prefill
for real, time decode steps of a fixed batch), and the engine check gates the timing."""

import pytest
import torch

from oscarkv.bench import e2e
from oscarkv.bench.harness import CorrectnessError, Timer
from oscarkv.engine import PRESETS, random_model

pytestmark = pytest.mark.slow  # engines built and prefilled on the CPU: about a minute on 2 cores


@pytest.fixture(scope="module")
def model():
    return random_model(PRESETS["tiny-llama"], dtype=torch.float32, device="cpu")


@pytest.fixture(scope="module")
def timer():
    return Timer("cpu", flush_bytes=1 << 16)


def test_latency_rows_have_step_floor_and_gauges(model, timer):
    rows = e2e.latency(model, [448], timer, steps=3, log=lambda s: None)
    assert [(r["kv"], r["context"]) for r in rows] == [("bf16", 448), ("oscar", 448)]
    for r in rows:
        assert r["step_ms"] > 0 and r["steps"] == 3 and r["floor_ms"] > 0
        assert r["ratio_to_floor"] == pytest.approx(r["step_ms"] / r["floor_ms"])
        assert r["kv_bytes_read"] > 0 and r["weight_bytes"] > 0
    bf16, oscar = rows
    assert oscar["weight_bytes"] == model.weight_bytes()  # counted after OSCAR's fold added o_proj biases
    assert 32.0 <= bf16["kv_bits_per_element"] <= 32.0 * 6 * 64 / 320  # float32 pool on the CPU, a partial last page
    assert oscar["kv_paged_bits_per_element"] < bf16["kv_paged_bits_per_element"] / 4
    mem = e2e.memory(rows, model)
    assert mem["ratio_paged"] > 4 and mem["oscar"]["context"] == 448
    table = e2e.latency_table(rows)
    assert len(table) == 3 and table[2].startswith("| 448 | on |")


def test_throughput_runs_as_many_sequences_as_the_budget_holds(model, timer):
    budget = 40 * 448 * e2e.bf16_bytes_per_token(model) / 2**30  # about 40 BF16 sequences of 448 tokens
    rows = e2e.throughput(model, 448, budget, timer, steps=3, log=lambda s: None, cap=12)
    by = {r["kv"]: r for r in rows}
    assert by["oscar"]["batch"] == 12  # the cap: OSCAR fits more
    assert 1 <= by["bf16"]["batch"] <= 12
    for r in rows:
        assert r["tokens_per_s"] == pytest.approx(r["batch"] / r["step_ms"] * 1e3)


def test_timed_steps_and_contexts_must_fit_the_headroom(model, timer):
    with pytest.raises(ValueError, match="steps must be at most"):
        e2e.latency(model, [448], timer, steps=120, log=lambda s: None)
    with pytest.raises(ValueError, match="contexts must exceed"):
        e2e.latency(model, [200], timer, steps=3, log=lambda s: None)


def test_engine_check_passes_on_cpu_and_gates_on_a_mismatch():
    res = e2e.check_engine("cpu", log=lambda s: None)
    assert res == {"bf16_vs_transformers_token_match": 1.0}
    with pytest.raises(CorrectnessError, match="differ from the reference"):
        e2e.check_engine("cpu", log=lambda s: None, min_match=1.01)
