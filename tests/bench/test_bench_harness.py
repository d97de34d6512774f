"""The benchmark harness on the CPU: the timer's median, the correctness gate that refuses to time a candidate
whose output is wrong, and provenance."""

import pytest
import torch

from oscarkv.bench.harness import (
    CorrectnessError, Failures, Timer, check_close, check_equal, measure, provenance, rel_err,
)


def test_timer_reports_the_median_of_its_repetitions(monkeypatch):
    ticks = iter([0.0, 0.001, 1.0, 1.005, 2.0, 2.003])  # 1 ms, 5 ms, 3 ms
    monkeypatch.setattr("oscarkv.bench.harness.time.perf_counter", lambda: next(ticks))
    calls = []
    t = Timer("cpu", flush_bytes=1024)(lambda: calls.append(1), reps=3, warmup=2)
    assert len(calls) == 5  # two warm-up calls, three timed
    assert t.median_ms == pytest.approx(3.0) and t.min_ms == pytest.approx(1.0) and t.max_ms == pytest.approx(5.0)
    assert t.reps == 3 and not t.graph


def test_timer_flushes_before_every_repetition():
    timer = Timer("cpu", flush_bytes=4096)
    seen = []

    def fn():
        seen.append(int(timer._flush.sum()))
        timer._flush.fill_(1)  # a candidate that leaves the buffer dirty; the next repetition must see it zeroed

    timer(fn, reps=4, warmup=0)
    assert seen == [0, 0, 0, 0]


def test_timer_rejects_no_repetitions():
    with pytest.raises(ValueError, match="reps"):
        Timer("cpu", flush_bytes=16)(lambda: None, reps=0)


def test_check_close_and_equal():
    ref = torch.tensor([1.0, 2.0, 3.0])
    assert check_close("x", ref * (1 + 1e-4), ref, 1e-3) < 1e-3
    with pytest.raises(CorrectnessError, match="relative error"):
        check_close("x", ref * 1.1, ref, 1e-3)
    with pytest.raises(CorrectnessError, match="shape"):
        check_close("x", ref[:2], ref, 1.0)
    assert rel_err(torch.tensor([float("nan"), 2.0, 3.0]), ref) == float("inf")
    codes = torch.arange(8, dtype=torch.uint8)
    check_equal("codes", codes.clone(), codes)
    with pytest.raises(CorrectnessError, match="1 of 8"):
        check_equal("codes", torch.where(codes == 3, 0, codes), codes)
    with pytest.raises(CorrectnessError):
        check_equal("codes", codes.int(), codes)


def test_measure_times_only_what_passes_its_check():
    timer, failures = Timer("cpu", flush_bytes=16), Failures()
    calls = []

    def fn():
        calls.append(1)
        return torch.ones(3)

    ok = measure(timer, fn, verify=lambda: {"rel_err": check_close("ok", fn(), torch.ones(3), 1e-6)},
                 failures=failures, name="ok", reps=3)
    assert ok["ms"] >= 0 and ok["check"] == {"rel_err": 0.0} and not failures.any
    n = len(calls)
    bad = measure(timer, fn, verify=lambda: check_close("bad", fn(), torch.zeros(3) + 2, 1e-3), failures=failures,
                  name="bad", reps=3)
    assert "ms" not in bad and bad["error"].startswith("correctness")
    assert len(calls) == n + 1  # run once by the check, never timed
    assert failures.any and "bad: correctness" in failures.report()


def test_measure_records_a_candidate_that_cannot_run():
    failures = Failures()

    def broken():
        raise RuntimeError("no kernel for this shape")

    res = measure(Timer("cpu", flush_bytes=16), broken, verify=broken, failures=failures, name="k")
    assert res == {"error": "RuntimeError: no kernel for this shape"} and failures.items == [
        "k: RuntimeError: no kernel for this shape"]


def test_provenance_names_versions_and_the_commit():
    p = provenance()
    for key in ("torch", "cuda", "triton", "python", "gpu", "git_sha", "git_dirty", "date"):
        assert key in p
    assert p["torch"] == torch.__version__
    assert provenance("abc1234")["git_sha"] == "abc1234"
