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
