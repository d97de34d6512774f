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


@pytest.mark.parametrize("kv", ["bf16", "oscar"])
def test_a_seeded_cache_holds_what_a_prefilled_one_holds(model, kv):
    """The equal-batch suite's seeded caches: after the same number of decode steps, token counts, tier sizes,
    pages and bytes in use equal those of a cache that prefilled the same prompts."""
    gauges = {}
    for how in ("prefill", "seed"):
        llm = e2e.make_llm(model, kv, max_num_seqs=2, max_model_len=448, kv_budget_gb=0.05)
        (e2e.prefill if how == "prefill" else e2e.seed)(llm, 2, 300, 40)
        while min(s.n_cached for s in llm.engine.running) < 310:
            llm.step()
        st = llm.store
        g = llm.gauges()
        gauges[how] = ([s.n_cached for s in llm.engine.running], [st.lens[s.slot] for s in llm.engine.running],
                       getattr(st, "qlens", [])[:2], g["kv_pool_used_bytes"], g["kv_pages_free"])
    assert gauges["seed"] == gauges["prefill"]


def test_equal_batch_rows_and_table(model, timer):
    rows = e2e.equal_batch(model, [448], [1, 2], timer, steps=3, log=lambda s: None)
    assert [(r["kv"], r["batch"]) for r in rows] == [("bf16", 1), ("oscar", 1), ("bf16", 2), ("oscar", 2)]
    for r in rows:
        assert r["fits"] and r["step_ms"] > 0 and r["floor_ms"] > 0 and r["kv_bytes_read"] > 0
        assert r["tokens_per_s"] == pytest.approx(r["batch"] / r["step_ms"] * 1e3)
    assert rows[2]["kv_bytes_read"] > rows[0]["kv_bytes_read"] > rows[1]["kv_bytes_read"]
    table = e2e.equal_batch_table(rows)
    assert len(table) == 4 and table[2].startswith("| 448 | 1 |") and table[3].startswith("| 448 | 2 |")
