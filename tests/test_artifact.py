"""Calibration artifacts: the sha256 record, value checks on load and save, one-line errors for every damage
(and a hypothesis fuzz of flipped bytes, truncation and edited JSON)."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from oscarkv.artifact import (
    META_FILE,
    TENSOR_FILE,
    ArtifactError,
    Calibration,
    ModelIdentity,
    orthogonality_tolerance,
)
from oscarkv.config import QuantSpec
from oscarkv.rotation import random_orthogonal

IDENT = ModelIdentity("llama", 2, 4, 2, 16, 64, "tiny")
SPEC = QuantSpec(sink=4, window=8, page_size=4, k_clip=0.9, v_clip=0.9)


def calibration(granularity: str = "layer") -> Calibration:
    g = torch.Generator().manual_seed(0)
    L, H, d = IDENT.num_layers, IDENT.num_kv_heads, IDENT.head_dim
    lead = (L, H) if granularity == "head" else (L,)
    rot = torch.stack([random_orthogonal(d, g) for _ in range(math.prod(lead))]).reshape(*lead, d, d)
    return Calibration(spec=SPEC.replace(granularity=granularity), model=IDENT, r_k=rot, r_v=rot.flip(-1),
                       eig_k=torch.rand(*lead, d, generator=g), eig_v=torch.rand(*lead, d, generator=g),
                       mu_k=torch.randn(L, H, d, generator=g), mu_v=torch.randn(L, H, d, generator=g),
                       k_clip=torch.tensor([0.9, 1.0]), v_clip=torch.tensor([0.0, 0.85]),
                       provenance={"kind": "test"})


@pytest.fixture
def saved(tmp_path) -> Path:
    return calibration().save(tmp_path / "calib")


def rewrite_tensors(path: Path, **changes: torch.Tensor) -> None:
    """Change tensors and re-record the sha256: a well-formed artifact whose values are wrong."""
    tensors = load_file(str(path / TENSOR_FILE))
    tensors.update(changes)
    save_file(tensors, str(path / TENSOR_FILE))
    rehash(path)


def rehash(path: Path) -> None:
    from oscarkv.artifact import _sha256

    meta = json.loads((path / META_FILE).read_text())
    meta["files"] = {TENSOR_FILE: {"sha256": _sha256(path / TENSOR_FILE), "bytes": (path / TENSOR_FILE).stat().st_size}}
    (path / META_FILE).write_text(json.dumps(meta))


def edit_meta(path: Path, fn) -> None:
    meta = json.loads((path / META_FILE).read_text())
    fn(meta)
    (path / META_FILE).write_text(json.dumps(meta))


def refused(path: Path, *words: str) -> str:
    with pytest.raises(ArtifactError) as e:
        Calibration.load(path)
    msg = str(e.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg, msg
    return msg


# ------------------------------------------------------------------------------------------ round trip
@pytest.mark.parametrize("granularity", ["layer", "head"])
def test_round_trip_records_and_checks_the_sha256(tmp_path, granularity):
    calib = calibration(granularity)
    path = calib.save(tmp_path / "c")
    meta = json.loads((path / META_FILE).read_text())
    record = meta["files"][TENSOR_FILE]
    assert record["bytes"] == (path / TENSOR_FILE).stat().st_size and len(record["sha256"]) == 64
    back = Calibration.load(path)
    for name in ("r_k", "r_v", "eig_k", "eig_v", "mu_k", "mu_v", "k_clip", "v_clip"):
        assert torch.equal(getattr(back, name), getattr(calib, name))
    assert back.spec == calib.spec and back.model == calib.model and back.provenance == {"kind": "test"}
    assert sorted(p.name for p in path.iterdir()) == [META_FILE, TENSOR_FILE]  # no temporary files left


def test_artifacts_without_a_sha256_record_load_with_a_warning(saved, caplog):
    edit_meta(saved, lambda m: m.pop("files"))
    with caplog.at_level(logging.WARNING, logger="oscarkv.artifact"):
        Calibration.load(saved)
    assert "without a sha256 record" in caplog.text and ".save(" in caplog.text
    Calibration.load(saved).save(saved)  # the fix the warning gives
    assert "files" in json.loads((saved / META_FILE).read_text())


# ------------------------------------------------------------------------------------ damaged tensors
def test_flipped_bytes_are_refused(saved):
    data = bytearray((saved / TENSOR_FILE).read_bytes())
    g = torch.Generator().manual_seed(0)
    header = 8 + int.from_bytes(data[:8], "little")
    for i in torch.randint(header, len(data), (2000,), generator=g).tolist():
        data[i] ^= 0x5A
    (saved / TENSOR_FILE).write_bytes(bytes(data))
    refused(saved, "does not match the sha256", "re-run `oscarkv calibrate`")


def test_truncated_tensor_file_is_refused(saved):
    data = (saved / TENSOR_FILE).read_bytes()
    (saved / TENSOR_FILE).write_bytes(data[: len(data) // 2])
    refused(saved, "truncated", TENSOR_FILE)
    edit_meta(saved, lambda m: m.pop("files"))  # without the record: the safetensors parser's fault, in one line
    refused(saved, "cannot be read as safetensors")


def test_non_orthogonal_rotations_are_refused(saved):
    r = load_file(str(saved / TENSOR_FILE))["r_k"]
    r[1, 3, 5] += 0.01
    rewrite_tensors(saved, r_k=r)
    msg = refused(saved, "r_k is not orthogonal", "(layer 1)", f"{orthogonality_tolerance(16):.3g}")
    assert "1e-06 x head_dim" in msg


def test_rotations_within_the_tolerance_load(saved):
    r = load_file(str(saved / TENSOR_FILE))["r_v"].double()
    r = (r + 1e-7 * torch.randn(r.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))).float()
    rewrite_tensors(saved, r_v=r)
    Calibration.load(saved)


@pytest.mark.parametrize("name, values, words", [
    ("k_clip", [7.0, 0.9], ["k_clip[0] = 7", "[0, 1]"]),
    ("v_clip", [0.9, -3.0], ["v_clip[1] = -3", "[0, 1]"]),
    ("mu_k", None, ["mu_k contains NaN or Inf"]),
    ("eig_v", None, ["eig_v contains NaN or Inf"]),
])
def test_out_of_range_and_non_finite_values_are_refused(saved, name, values, words):
    t = load_file(str(saved / TENSOR_FILE))[name]
    if values is None:
        t.view(-1)[3] = math.nan
    else:
        t = torch.tensor(values)
    rewrite_tensors(saved, **{name: t})
    refused(saved, *words)


def test_wrong_shapes_dtypes_and_names_are_refused(saved, tmp_path):
    rewrite_tensors(saved, mu_v=torch.zeros(2, 2, 8))
    refused(saved, "mu_v has shape (2, 2, 8), expected (2, 2, 16)")
    path = calibration().save(tmp_path / "b")
    rewrite_tensors(path, k_clip=torch.tensor([0.5, 0.5], dtype=torch.float64))
    refused(path, "k_clip is torch.float64")
    path = calibration().save(tmp_path / "c")
    rewrite_tensors(path, extra=torch.zeros(1))
    refused(path, "unknown tensors ['extra']")


# --------------------------------------------------------------------------------------- damaged JSON
def test_unparsable_json_is_refused(saved):
    text = (saved / META_FILE).read_text()
    (saved / META_FILE).write_text(text[: len(text) // 2])
    refused(saved, "is not valid JSON", "line")
    (saved / META_FILE).write_bytes(b"\xff\xfe{")
    refused(saved, "is not UTF-8")
    (saved / META_FILE).write_text("[1, 2]")
    refused(saved, "must hold a JSON object")


@pytest.mark.parametrize("edit, words", [
    (lambda m: m.update(extra=1), ["unknown key(s) ['extra']"]),
    (lambda m: m["model"].update(layers=2), ["model has unknown key(s) ['layers']"]),
    (lambda m: m["model"].update(num_layers="2"), ["model.num_layers must be an int"]),
    (lambda m: m["model"].update(num_layers=3), ["expected (3,"]),
    (lambda m: m["spec"].update(bitz=2), ["spec: unknown QuantSpec key(s) ['bitz']"]),
    (lambda m: m["spec"].update(window=10), ["window (10 tokens) is not a multiple of its page_size (4)"]),
    (lambda m: m.update(format_version=99), ["format version 99"]),
    (lambda m: m.pop("model"), ["lacks the 'model' entry"]),
    (lambda m: m.update(files={TENSOR_FILE: {"sha256": 5}}), ["'files' must be"]),
    (lambda m: m.update(provenance=[1]), ["provenance must be a mapping"]),
    (lambda m: m.update(layer_formats=[{"k": {}, "v": {"layout": "channel"}}] * 2), ["layer_formats[0]"]),
])
def test_edited_json_is_refused_in_one_line(saved, edit, words):
    edit_meta(saved, edit)
    refused(saved, *words)


def test_a_calibration_of_another_model_is_refused(saved):
    with pytest.raises(ArtifactError) as e:
        Calibration.load(saved, model=ModelIdentity("llama", 3, 4, 2, 16, 64))
    assert "num_layers: calibration has 2, model has 3" in str(e.value) and "\n" not in str(e.value)


def test_save_refuses_invalid_values_and_keeps_the_old_artifact(saved):
    bad = calibration()
    bad.k_clip = torch.tensor([7.0, 0.5])
    before = (saved / TENSOR_FILE).read_bytes()
    with pytest.raises(ArtifactError, match=r"k_clip\[0\] = 7"):
        bad.save(saved)
    assert (saved / TENSOR_FILE).read_bytes() == before
    Calibration.load(saved)


# ---------------------------------------------------------------------------------------------- fuzz
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _expect_refused_or_intact(path: Path, original: Calibration) -> None:
    try:
        back = Calibration.load(path)
    except ArtifactError as e:
        assert "\n" not in str(e) and str(e)
        return
    for name in ("r_k", "r_v", "eig_k", "eig_v", "mu_k", "mu_v", "k_clip", "v_clip"):
        assert torch.equal(getattr(back, name), getattr(original, name))


@FUZZ
@given(st.lists(st.tuples(st.integers(0, 10**7), st.integers(1, 255)), min_size=1, max_size=20))
def test_fuzz_flipped_tensor_bytes_are_always_refused(tmp_path_factory, flips):
    path = calibration().save(tmp_path_factory.mktemp("f") / "c")
    original = (path / TENSOR_FILE).read_bytes()
    data = bytearray(original)
    for pos, mask in flips:
        data[pos % len(data)] ^= mask
    assume(bytes(data) != original)  # flips of one byte may cancel
    (path / TENSOR_FILE).write_bytes(bytes(data))
    with pytest.raises(ArtifactError) as e:
        Calibration.load(path)
    assert "\n" not in str(e.value)


@FUZZ
@given(st.sampled_from([TENSOR_FILE, META_FILE]), st.floats(0.0, 0.999), st.booleans())
def test_fuzz_truncation_is_refused(tmp_path_factory, name, keep, legacy):
    path = calibration().save(tmp_path_factory.mktemp("t") / "c")
    if legacy:
        edit_meta(path, lambda m: m.pop("files"))
    data = (path / name).read_bytes()
    cut = data[: int(len(data) * keep)]
    assume(cut.rstrip() != data.rstrip())  # dropping the JSON's final newline damages nothing
    (path / name).write_bytes(cut)
    with pytest.raises(ArtifactError) as e:
        Calibration.load(path)
    assert "\n" not in str(e.value)


JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats() | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                        max_size=3), max_leaves=6)


@FUZZ
@given(st.data())
def test_fuzz_edited_json_is_refused_or_harmless(tmp_path_factory, data):
    calib = calibration()
    path = calib.save(tmp_path_factory.mktemp("j") / "c")
    meta = json.loads((path / META_FILE).read_text())
    section = data.draw(st.sampled_from([None, "spec", "model", "files"]))
    target = meta if section is None else meta[section]
    key = data.draw(st.sampled_from(sorted(target) + ["unknown_key"]))
    if data.draw(st.booleans()):
        target.pop(key, None)
    else:
        target[key] = data.draw(JSON_VALUES)
    (path / META_FILE).write_text(json.dumps(meta))
    _expect_refused_or_intact(path, calib)
