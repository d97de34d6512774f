"""``oscarkv eval`` end to end on the CPU (tiny random Llama on disk, every task, the main methods and
oscar-auto), a bfloat16 model, result separation by numerics, and the kernel choice of the caches."""

import json

import pytest

pytest.importorskip("transformers")

from e2e_helpers import CONTEXT, METHODS, check_properties, make_tiny, records, run_eval, summary  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def cpu_run(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("cpu") / "out"
    assert run_eval(tiny, out) == 0
    return out


@pytest.mark.slow  # the shared CLI run takes minutes on 2 cores
def test_cli_runs_every_task_on_cpu(cpu_run):
    s = summary(cpu_run)
    check_properties(s)
    assert s[("greedy", "bf16", CONTEXT)]["exact"] == 1.0  # float32: teacher pass == decode through the cache
    recs = records(cpu_run, "lm")
    assert {r["device"] for r in recs.values()} == {"cpu"} and {r["dtype"] for r in recs.values()} == {"float32"}
    info = json.loads(next(cpu_run.glob("*/methods.json")).read_text())
    assert info["numerics"]["device"] == "cpu" and info["numerics"]["kernels"] == "auto"
    assert "(latest run): device cpu, dtype float32, kernels auto" in (cpu_run / "summary.md").read_text()
    assert "By variant" in (cpu_run / "summary.md").read_text()


@pytest.mark.slow  # the shared CLI run takes minutes on 2 cores
def test_bfloat16_model_runs_and_never_mixes_with_float32_units(tiny, cpu_run, tmp_path):
    import shutil

    out = tmp_path / "out"
    shutil.copytree(cpu_run, out)  # float32 results and reference hidden states already on file
    methods = ["bf16", "naive-int2", "oscar"]
    assert run_eval(tiny, out, "--dtype", "bfloat16", methods=methods, tasks=["kld", "ppl"]) == 0
    lm = records(out, "lm")
    bf16 = {(r["dtype"], r["method"]) for r in lm.values() if r["dtype"] == "bfloat16"}
    assert bf16 == {("bfloat16", m) for m in methods}
    runs = {(r["dtype"], r["run"]) for r in lm.values()}
    assert len({run for _, run in runs}) == len(runs)  # no fingerprint shared by the two dtypes
    refs = sorted(p.name for p in (out / ".ref").rglob("*.pt"))
    assert any("cpu-bfloat16" in n for n in refs) and any("cpu-" not in n for n in refs)
    s = summary(out)  # the report reads the latest run of each file: the bfloat16 one
    assert s[("lm", "bf16", CONTEXT)]["kld"] == 0.0
    assert 0.0 < s[("lm", "oscar", CONTEXT)]["kld"] < s[("lm", "naive-int2", CONTEXT)]["kld"]


def test_fp32_pseudo_method_is_refused_on_a_16_bit_model(tiny, tmp_path, capsys):
    assert run_eval(tiny, tmp_path / "out", "--dtype", "bfloat16", methods=["fp32", "bf16"], tasks=["kld"]) == 2
    assert "fp32" in capsys.readouterr().err
    assert run_eval(tiny, tmp_path / "out", "--dtype", "bfloat16", "--reference", "fp32", methods=["bf16"],
                    tasks=["kld"]) == 2


@pytest.mark.slow  # the shared CLI run takes minutes on 2 cores
def test_reference_kernels_are_recorded_and_give_the_same_niah_outputs(tiny, cpu_run, tmp_path):
    out = tmp_path / "out"
    methods = ["bf16", "oscar", "oscar-auto", "naive-int2"]
    assert run_eval(tiny, out, "--kernels", "reference", methods=methods, tasks=["niah"]) == 0
    ref, auto = records(out, "niah"), records(cpu_run, "niah")
    assert all(r["protocol"]["kernels"] == "reference" for r in ref.values())
    assert all("kernels" not in r["protocol"] for r in auto.values())  # CPU default: fingerprints as before
    # the dispatcher's reference (extend_attention_ref) and the CPU cache's chunked attention compute the same
    for k, r in ref.items():
        assert r["output"] == auto[k]["output"] and r["bits_physical"] == auto[k]["bits_physical"]
    assert set(METHODS) >= {m for m, _ in ref}
