"""Start-up validation of the vLLM plugin's configuration (no vLLM import: runs in every venv)."""

import pytest
import torch

from oscarkv.artifact import Calibration, ModelIdentity
from oscarkv.integrations.vllm.options import (
    OscarOptions,
    OscarVllmError,
    ServedModel,
    Tiering,
    check_model,
    load_calibration,
    resolve_recipe,
)
from oscarkv.integrations.vllm.runtime import local_kv_heads

LLAMA = ServedModel("llama", num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=64, hidden_size=256,
                    dtype="float32")


def _artifact(tmp_path, model: ServedModel, name="cal"):
    return str(Calibration.identity(model.identity()).save(tmp_path / name))


def test_no_section_means_not_requested():
    assert OscarOptions.from_additional_config({}) is None
    assert OscarOptions.from_additional_config({"other": 1}) is None


@pytest.mark.parametrize("section, match", [
    ({"calibraton": "x"}, "unknown key"),
    ({"method": "oscar-fast"}, "unknown oscar.method"),
    ({"method": "kivi-2", "calibration": "."}, "per channel"),
    ({}, "calibration is required"),
    ({"calibration": "/does/not/exist"}, "not a folder"),
    ({"method": "bf16", "max_seqs": 0}, "max_seqs"),
    ({"method": "bf16", "decode_graphs": "yes"}, "decode_graphs must be true or false"),
    ("oscar", "JSON object"),
])
def test_bad_sections_are_refused_with_what_to_do(section, match):
    with pytest.raises(OscarVllmError, match=match):
        OscarOptions.from_additional_config({"oscar": section})


@pytest.mark.parametrize("change, match", [
    ({"architecture": "gemma3_text"}, "model type 'gemma3_text' is not supported"),
    ({"architecture": "mistral"}, "not supported"),
    ({"head_dim": 80}, "head size 80"),
    ({"sliding_window": 4096}, "sliding-window"),
    ({"dtype": "float8_e4m3fn"}, "dtype"),
])
def test_unsupported_models_are_refused(change, match):
    from dataclasses import replace

    with pytest.raises(OscarVllmError, match=match):
        check_model(replace(LLAMA, **change))


def test_artifact_of_another_model_is_refused(tmp_path):
    other = ServedModel("qwen2", num_layers=24, num_q_heads=14, num_kv_heads=2, head_dim=64, hidden_size=896,
                        dtype="bfloat16")
    opts = OscarOptions(calibration=_artifact(tmp_path, other))
    with pytest.raises(OscarVllmError, match="cannot serve this model.*architecture.*num_layers"):
        load_calibration(opts, LLAMA)


def test_recipe_follows_the_method_registry(tmp_path):
    opts = OscarOptions(calibration=_artifact(tmp_path, LLAMA))
    calib = load_calibration(opts, LLAMA)
    r = resolve_recipe(opts, calib)
    assert (r.sink, r.window, r.unit) == (64, 256, 64) and {f.k.bits for f in r.formats} == {2}
    r = resolve_recipe(OscarOptions(calibration=opts.calibration, method="oscar-nowindow"), calib)
    assert (r.sink, r.window, r.unit) == (0, 0, 1)
    assert not resolve_recipe(OscarOptions(method="bf16"), calib).quantized


def test_block_size_must_tile_sink_and_pages():
    Tiering(64, 256, 64).check_block_size(64)
    Tiering(64, 256, 64).check_block_size(16)
    with pytest.raises(OscarVllmError, match="block_size=64"):
        Tiering(64, 256, 64).check_block_size(128)
    Tiering(0, 0, 1, enabled=False).check_block_size(128)


def test_tensor_parallel_kv_heads():
    assert local_kv_heads(8, 2, 1) == [4, 5, 6, 7]
    assert local_kv_heads(2, 4, 3) == [1]  # replicated: ranks 2 and 3 hold head 1
    with pytest.raises(OscarVllmError):
        local_kv_heads(3, 2, 0)


def test_identity_calibration_when_none_is_given():
    calib = load_calibration(OscarOptions(method="bf16"), LLAMA)
    assert calib.model == LLAMA.identity() and torch.equal(calib.r_k[0], torch.eye(64))
    assert isinstance(calib.model, ModelIdentity)


def test_per_layer_formats_are_refused_only_for_per_layer_methods(tmp_path):
    calib = Calibration.identity(LLAMA.identity())
    calib.layer_formats = [{"k": {"layout": "channel", "bits": 4, "rotation": "none"},
                            "v": {"layout": "token", "bits": 2}},
                           {"k": {"layout": "token", "bits": 2}, "v": {"layout": "token", "bits": 2}}]
    path = str(calib.save(tmp_path / "auto"))
    opts = OscarOptions(calibration=path)
    loaded = load_calibration(opts, LLAMA)  # plain oscar serves it, ignoring the per-layer formats
    assert len(set(resolve_recipe(opts, loaded).formats)) == 1
    with pytest.raises(OscarVllmError, match="per-layer formats.*one format"):
        resolve_recipe(OscarOptions(calibration=path, method="oscar-auto"), loaded)
