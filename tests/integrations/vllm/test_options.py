"""Start-up validation of the vLLM plugin's configuration (no vLLM import: runs in every venv)."""

import pytest
import torch

from oscarkv import methods
from oscarkv.artifact import Calibration, ModelIdentity
from oscarkv.cache import TierPolicy, policy_for
from oscarkv.integrations.vllm.options import (
    OscarOptions,
    OscarVllmError,
    ServedModel,
    check_model,
    check_served,
    load_calibration,
    resolve_recipe,
    serving_policy,
    windows_of,
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
    ({"method": "kivi-2", "calibration": "."}, "residual window without a sink"),
    ({}, "calibration is required"),
    ({"calibration": "/does/not/exist"}, "not a folder"),
    ({"method": "bf16", "max_seqs": 0}, "max_seqs"),
    ({"method": "bf16", "decode_graphs": "yes"}, "decode_graphs must be true or false"),
    ({"method": "bf16", "monitor_every": -1}, "monitor_every must be an int >= 0"),
    ({"method": "bf16", "monitor_every": True}, "monitor_every must be an int >= 0"),
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
    bf16 = resolve_recipe(OscarOptions(method="bf16"), calib)
    assert not bf16.quantized and windows_of(serving_policy(bf16)) == (0, 0)  # vLLM's own pages, no ring


def _recipe(layer_formats=None, method="oscar"):
    calib = Calibration.identity(LLAMA.identity())
    calib.layer_formats = layer_formats
    return methods.resolve(method, calib)


def test_block_size_must_tile_sink_and_pages():
    r = _recipe()
    check_served(r, policy_for(r), 64, 4, 4)
    check_served(r, policy_for(r), 16, 4, 4)
    with pytest.raises(OscarVllmError, match="block_size=64"):
        check_served(r, policy_for(r), 128, 4, 4)
    nowin = _recipe(method="oscar-nowindow")
    check_served(nowin, policy_for(nowin), 128, 4, 4)


CHANNEL = [{"k": {"layout": "channel", "bits": 4, "rotation": "none"}, "v": {"layout": "token", "bits": 2}},
           {"k": {"layout": "token", "bits": 2}, "v": {"layout": "token", "bits": 4}}]


def test_channel_page_layers_need_their_own_blocks_windows_and_slots():
    r = _recipe(CHANNEL, "oscar-auto")
    pol = policy_for(r)
    check_served(r, pol, 64, 8, 8)
    with pytest.raises(OscarVllmError, match=r"layers \[0\] store keys in channel pages of 64 tokens: start vLLM "
                                             "with --block-size 64"):
        check_served(r, pol, 16, 8, 8)
    with pytest.raises(OscarVllmError, match="oscar.max_seqs"):
        check_served(r, pol, 64, 4, 8)
    with pytest.raises(OscarVllmError, match="need the 16-bit windows"):
        check_served(r, TierPolicy(0, 0, 64), 64, 8, 8)


def test_tensor_parallel_kv_heads():
    assert local_kv_heads(8, 2, 1) == [4, 5, 6, 7]
    assert local_kv_heads(2, 4, 3) == [1]  # replicated: ranks 2 and 3 hold head 1
    with pytest.raises(OscarVllmError):
        local_kv_heads(3, 2, 0)


def test_identity_calibration_when_none_is_given():
    calib = load_calibration(OscarOptions(method="bf16"), LLAMA)
    assert calib.model == LLAMA.identity() and torch.equal(calib.r_k[0], torch.eye(64))
    assert isinstance(calib.model, ModelIdentity)


def test_per_layer_formats_are_served(tmp_path):
    calib = Calibration.identity(LLAMA.identity())
    calib.layer_formats = CHANNEL
    path = str(calib.save(tmp_path / "auto"))
    loaded = load_calibration(OscarOptions(calibration=path), LLAMA)
    assert len(set(resolve_recipe(OscarOptions(calibration=path), loaded).formats)) == 1  # oscar ignores them
    auto = resolve_recipe(OscarOptions(calibration=path, method="oscar-auto"), loaded)
    assert auto.formats == (loaded.formats(0), loaded.formats(1))
