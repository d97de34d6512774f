"""The long-context suite: its steps end to end on a tiny model, the time caps, and the reference fallback."""

import json
import time

import pytest

pytest.importorskip("transformers")

from e2e_helpers import make_tiny  # noqa: E402
from oscarkv.eval.suite import Step, long_context_steps, run_suite  # noqa: E402


def test_suite_runs_every_step_and_reports(tmp_path):
    from oscarkv.cli import main

    tiny = make_tiny(tmp_path / "tiny")
    out = tmp_path / "out"
    argv = ["eval", "--suite", "long-context", "--suite-context", "256", "--model", str(tiny.model_dir),
            "--calibration", str(tiny.calib_dir), "--prefill-chunk", "64", "--niah-samples", "1", "--time-budget",
            "900", "--out", str(out), "--quiet"]
    assert main(argv) == 0
    status = json.loads((out / "suite.json").read_text())
    first = [s for s in status["runs"][0]["steps"] if s["round"] == 0]
    assert [s["step"] for s in first] == [s.name for s in long_context_steps(256, 64, 1)]
    assert all("errors" not in s and s["kernels"] == "auto" for s in first)
    units = {s["step"]: s["new_units"] for s in first}
    assert units["curve"] == {"lm@256": 6 * 8} and units["niah"] == {"niah": 3 * 5 * 1 * 2}
    assert units["longgen"] == {"longgen@64": 4 * 8} and units["crosscheck"] == {"lm@256": 3, "fidelity@256": 3}
    md = (out / "summary.md").read_text()
    assert "KLD by position" in md and "long generation" in md and "NIAH" in md
    assert "on code-crosscheck: fidelity" in md  # the cross-check is filed apart from the curve it checks
    again = [s for s in status["runs"][0]["steps"] if s["round"] == 1]
    assert all(not any(s["new_units"].values()) for s in again)  # the second round had nothing left


def test_time_caps_and_reference_fallback(tmp_path):
    calls = []

    def make_context(data, kernels):
        calls.append((data, kernels))
        if kernels == "auto":
            raise RuntimeError("kernel path broken")
        raise ValueError("reference broken too")

    steps = [Step("a", 0.5, "code", {"methods": ["bf16"], "tasks": ["kld"], "contexts": [64]}),
             Step("b", 0.5, "docs", {"methods": ["bf16"], "tasks": ["kld"], "contexts": [64]})]
    status = run_suite(make_context, steps, tmp_path, budget=60, log=lambda m: None)
    first = status["runs"][0]["steps"][:2]
    assert [e["kernels"] for e in first[0]["errors"]] == ["auto", "reference"]
    assert calls[:4] == [("code", "auto"), ("code", "reference"), ("docs", "auto"), ("docs", "reference")]
    t0 = time.monotonic()
    status = run_suite(make_context, steps, tmp_path, budget=0, log=lambda m: None)
    assert status["runs"][-1]["steps"] == [] and time.monotonic() - t0 < 5
    assert len(json.loads((tmp_path / "suite.json").read_text())["runs"]) == 2


def test_a_labelled_step_keeps_the_records_of_the_step_it_checks(tiny_context):
    """The cross-check runs the curve's windows, methods and context under another protocol; filed under the
    same text name it shared the curve's results files, and the report (which reads a file's latest protocol)
    showed the cross-check's single window in place of the curve."""
    from oscarkv.eval.report import write_report

    ctx = tiny_context()
    plan = {"methods": ["q2"], "tasks": ["kld"], "contexts": [64]}
    steps = [Step("curve", 0.5, "rand", {**plan, "windows": 2, "path": "cache", "batch": 2}),
             Step("check", 0.5, "rand", {**plan, "windows": 1, "path": "simulate"}, label="rand-check")]
    status = run_suite(lambda data, kernels: ctx, steps, ctx.store.root, budget=600, log=lambda m: None)
    assert [s.get("label") for s in status["runs"][0]["steps"][:2]] == [None, "rand-check"]
    write_report(ctx.store.root)
    summary = json.loads((ctx.store.root / "summary.json").read_text())
    curve, check = summary["tiny|rand|lm|q2|64"], summary["tiny|rand-check|lm|q2|64"]
    assert curve["units"] == 2 and "simulate" not in curve["paths"]
    assert check["units"] == 1 and check["paths"] == ["simulate"]
    assert ctx.text.name == "rand"  # the step's own context was relabelled, not the caller's
