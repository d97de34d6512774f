"""bench_vllm's per-engine environment: which model runner each engine gets (no vLLM needed)."""

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_vllm.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_vllm", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_default_runner_is_vllms_choice_for_baselines_and_v1_for_oscar(bench):
    base = {"VLLM_USE_V2_MODEL_RUNNER": "1", "PATH": "/bin"}
    for mode in ("bf16", "fp8", "int4_per_token_head"):
        env = bench.child_env(mode, "default", base)
        assert "VLLM_USE_V2_MODEL_RUNNER" not in env and env["PATH"] == "/bin"
    for mode in ("oscar", "oscar-eager", "oscar-piecewise"):
        assert bench.child_env(mode, "default", base)["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    assert base["VLLM_USE_V2_MODEL_RUNNER"] == "1"  # the caller's environment is not changed


@pytest.mark.parametrize("runner, value", [("v1", "0"), ("v2", "1")])
def test_named_runner_applies_to_every_engine(bench, runner, value):
    for mode in ("bf16", "oscar"):
        env = bench.child_env(mode, runner, {})
        assert env["VLLM_USE_V2_MODEL_RUNNER"] == value and env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
