"""User errors in the CLI are one line on stderr with exit code 2 (tracebacks only under --debug); a damaged
artifact is refused by `oscarkv inspect`, `generate`, `serve` and by `LLM(...)`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from oscarkv import models
from oscarkv.artifact import (
    META_FILE,
    TENSOR_FILE,
    ArtifactError,
    Calibration,
    ModelIdentity,
)
from oscarkv.cli import main
from oscarkv.config import QuantSpec
from oscarkv.engine import LLM

sys.path.insert(0, str(Path(__file__).parent / "calib"))
from calib_helpers import tiny_model, word_tokenizer

SPEC = QuantSpec(sink=4, window=8, page_size=4, k_clip=0.9, v_clip=0.9, centering=False, composition="none")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("cli-errors")
    models.save_cache(tiny_model("llama"), word_tokenizer(), root / "model", {"name": "tiny"})
    return root / "model"


def _ident(**changes) -> ModelIdentity:
    base = ModelIdentity.from_config(tiny_model("llama").config)
    return ModelIdentity(**{**base.__dict__, **changes})


def _rewrite(path: Path, **changes) -> None:
    from oscarkv.artifact import _sha256

    tensors = load_file(str(path / TENSOR_FILE))
    tensors.update(changes)
    save_file(tensors, str(path / TENSOR_FILE))
    meta = json.loads((path / META_FILE).read_text())
    meta["files"][TENSOR_FILE] = {"sha256": _sha256(path / TENSOR_FILE), "bytes": (path / TENSOR_FILE).stat().st_size}
    (path / META_FILE).write_text(json.dumps(meta))


def _flip(path: Path) -> None:
    data = bytearray((path / TENSOR_FILE).read_bytes())
    for i in range(len(data) - 2000, len(data)):
        data[i] ^= 0xFF
    (path / TENSOR_FILE).write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    data = (path / TENSOR_FILE).read_bytes()
    (path / TENSOR_FILE).write_bytes(data[: len(data) // 3])


def _bad_json(path: Path) -> None:
    (path / META_FILE).write_text((path / META_FILE).read_text()[:-20])


def _not_orthogonal(path: Path) -> None:
    r = load_file(str(path / TENSOR_FILE))["r_k"]
    r[0] *= 1.5
    _rewrite(path, r_k=r)


def _clips(path: Path) -> None:
    _rewrite(path, k_clip=torch.tensor([7.0, 0.9]), v_clip=torch.tensor([0.9, -3.0]))


def _window(path: Path) -> None:
    meta = json.loads((path / META_FILE).read_text())
    meta["spec"]["window"] = 6
    (path / META_FILE).write_text(json.dumps(meta))


DAMAGES = {  # name -> (how, words of the one-line message)
    "flipped bytes": (_flip, "does not match the sha256"),
    "truncated": (_truncate, "truncated"),
    "bad json": (_bad_json, "is not valid JSON"),
    "not orthogonal": (_not_orthogonal, "r_k is not orthogonal"),
    "clips": (_clips, "k_clip[0] = 7 is not a clip ratio in [0, 1]"),
    "window": (_window, "window (6 tokens) is not a multiple of its page_size (4)"),
    "another model": (None, "num_layers: calibration has 3, model has 2"),
}


@pytest.fixture(params=sorted(DAMAGES))
def damaged(request, tmp_path) -> tuple[Path, str]:
    how, words = DAMAGES[request.param]
    ident = _ident(num_layers=3) if how is None else _ident()
    path = Calibration.identity(ident, SPEC, clip=0.9).save(tmp_path / "calib")
    if how is not None:
        how(path)
    return path, words


def _one_line_error(capsys, words: str) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error" in line]
    assert len(lines) == 1 and words in lines[0], err
    assert "Traceback" not in err
    return lines[0]


def test_inspect_refuses(damaged, capsys):
    path, words = damaged
    if words.startswith("num_layers"):
        pytest.skip("inspect reads an artifact without a model")
    assert main(["inspect", str(path)]) == 2
    assert _one_line_error(capsys, words).startswith("oscarkv inspect: error: ")


def test_generate_refuses(damaged, model_dir, capsys):
    path, words = damaged
    rc = main(["generate", "--model", str(model_dir), "--calibration", str(path), "--prompt", "w1 w2",
               "--max-new-tokens", "2"])
    assert rc == 2
    _one_line_error(capsys, words)


def test_serve_refuses(damaged, model_dir, capsys):
    path, words = damaged
    assert main(["serve", str(model_dir), "--calibration", str(path), "--port", "0", "--kv-budget-gb", "0.01"]) == 2
    _one_line_error(capsys, words)


def test_llm_refuses(damaged):
    path, words = damaged
    with pytest.raises(ArtifactError) as e:
        LLM(tiny_model("llama"), path, kv_budget_gb=0.01)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_argument_errors_are_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the following arguments are required: model" in err and "--help" in err


def test_missing_files_and_bad_values_are_one_line(model_dir, tmp_path, capsys):
    assert main(["generate", "--model", str(tmp_path / "nowhere"), "--prompt", "x"]) == 2
    _one_line_error(capsys, "unknown model")
    assert main(["serve", str(model_dir), "--port", "0", "--max-connections", "0"]) == 2
    _one_line_error(capsys, "--max-connections must be >= 1")


def test_debug_shows_the_traceback(tmp_path):
    with pytest.raises(ArtifactError):
        main(["--debug", "inspect", str(tmp_path)])
