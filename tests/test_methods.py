"""The method registry: names, suffixes, nominal bits, and what each method resolves to."""

import pytest
import torch

from oscarkv import methods
from oscarkv.artifact import Calibration, ModelIdentity
from oscarkv.config import ConfigError, QuantSpec
from oscarkv.formats import LayerFormat, TensorFormat
from oscarkv.rotation import hadamard

IDENT = ModelIdentity("llama", num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=64, hidden_size=256)


def _calib(**spec) -> Calibration:
    c = Calibration.identity(IDENT, QuantSpec(**{"k_clip": 0.9, "v_clip": 0.8, **spec}), clip=0.9)
    c.mu_k.normal_()
    c.mu_v.normal_()
    c.r_k.copy_(hadamard(64))  # a recognisable non-identity "calibrated" rotation
    c.k_clip.fill_(0.93)
    c.v_clip.fill_(0.91)
    return c


def test_names_and_suffix():
    assert {"bf16", "oscar", "naive-int2", "quarot-int2", "kivi-2", "int4-hadamard", "oscar-nowindow",
            "oscar-hadamard", "oscar-gram"} <= set(methods.METHODS)
    assert all(n + "-nocenter" in methods.names() for n in methods.METHODS)
    m = methods.get("oscar-nocenter")
    assert m.name == "oscar-nocenter" and not m.centering and methods.get("oscar").centering
    with pytest.raises(ConfigError, match="valid methods"):
        methods.get("oscar2")


@pytest.mark.parametrize("name,d,bits", [("naive-int2", 64, 2.5), ("quarot-int2", 128, 2.25),
                                         ("int4-hadamard", 128, 4.25), ("kivi-2", 64, 2.75), ("bf16", 64, 16.0),
                                         ("oscar", 128, 2.25), ("oscar", 64, 2.5)])
def test_nominal_bits(name, d, bits):
    assert methods.get(name).bits_per_element(d) == pytest.approx(bits)


def test_resolve_oscar_uses_calibration():
    c = _calib(sink=16, window=32, page_size=16, group_size=32)
    r = methods.resolve("oscar", c)
    assert (r.sink, r.window, r.unit, r.page_size, r.group_size) == (16, 32, 16, 16, 32)
    lr = r.layers[1]
    k_clip, v_clip = float(c.k_clip[1]), float(c.v_clip[1])  # the artifact's float32 ratios, unrounded
    assert lr.format == LayerFormat(TensorFormat("token", 2, "calibrated", k_clip),
                                    TensorFormat("token", 2, "calibrated", v_clip))
    assert torch.equal(lr.r_k[0], hadamard(64)) and torch.equal(lr.mu_v, c.mu_v[1])
    assert (lr.k_clip, lr.v_clip) == (pytest.approx(0.93), pytest.approx(0.91))
    assert methods.resolve("oscar-nocenter", c).layers[0].mu_k is None


def test_resolve_baselines():
    c = _calib()
    naive = methods.resolve("naive-int2", c)
    assert (naive.sink, naive.window, naive.unit) == (0, 0, 1)
    assert naive.layers[0].r_k is None and naive.layers[0].k_clip == 0.0 and naive.layers[0].mu_k is not None
    quarot = methods.resolve("quarot-int2-nocenter", c)
    assert torch.equal(quarot.layers[0].r_v[1], hadamard(64)) and quarot.layers[0].mu_v is None
    kivi = methods.resolve("kivi-2", c)
    assert (kivi.sink, kivi.window, kivi.unit, kivi.page_size) == (0, 128, 32, 32)  # KIVI groups = channel pages
    assert kivi.formats[0] == LayerFormat(TensorFormat("channel", 2, "none"), TensorFormat("token", 2, "none"))
    int4 = methods.resolve("int4-hadamard", c)
    assert (int4.formats[1].v.bits, int4.sink, int4.window) == (4, 0, 0)
    had = methods.resolve("oscar-hadamard", c)
    assert (had.layers[0].k_clip, had.layers[0].v_clip) == (0.96, 0.92) and had.window == c.spec.window
    nowin = methods.resolve("oscar-nowindow", c)
    assert (nowin.sink, nowin.window, nowin.unit) == (0, 0, 1) and nowin.layers[0].k_clip == pytest.approx(0.93)
    bf16 = methods.resolve("bf16", c)
    assert not bf16.quantized and bf16.layers[0].r_v is None and bf16.layers[0].mu_v is None
    assert bf16.formats == (None, None) and bf16.quantized_layers == [] and bf16.bits_per_element(64) == 16.0


def test_gram_method_needs_gram_calibration():
    with pytest.raises(ConfigError, match="target 'gram'"):
        methods.resolve("oscar-gram", _calib())
    assert methods.resolve("oscar-gram", _calib(target="gram")).quantized


def test_head_granularity_passes_through():
    c = Calibration.identity(IDENT, QuantSpec(granularity="head", k_clip=0.0, v_clip=0.0))
    c.r_k[:, 1] = hadamard(64)
    r = methods.resolve("oscar-nocenter", c)
    assert torch.equal(r.layers[0].r_k[1], hadamard(64)) and torch.equal(r.layers[0].r_k[0], torch.eye(64))


def test_zero_means_warn():
    c = Calibration.identity(IDENT)
    with pytest.warns(UserWarning, match="means are all zero"):
        methods.resolve("naive-int2", c)


def test_per_layer_formats_ignored_by_oscar_required_by_auto():
    c = _calib()
    with pytest.raises(ConfigError, match="per-layer formats"):
        methods.resolve("oscar-auto", c)
    plain = methods.resolve("oscar", c)
    c.layer_formats = [{"k": {"layout": "channel", "bits": 2, "rotation": "none"},
                        "v": {"layout": "token", "bits": 4, "rotation": "hadamard", "clip": 0.9}},
                       {"k": {"layout": "token", "bits": 2, "rotation": "calibrated", "clip": 0.93},
                        "v": {"layout": "token", "bits": 2, "rotation": "none"}}]
    again = methods.resolve("oscar", c)  # plain oscar ignores layer_formats
    assert again.formats == plain.formats and all(torch.equal(a.r_k, b.r_k) for a, b in zip(plain.layers, again.layers))
    auto = methods.resolve("oscar-auto", c)
    assert auto.formats == (c.formats(0), c.formats(1))  # carried unchanged from the artifact
    assert [(f.k.bits, f.v.bits, f.k.layout) for f in auto.formats] == [(2, 4, "channel"), (2, 2, "token")]
    l0, l1 = auto.layers
    assert l0.r_k is None and torch.equal(l0.r_v[0], hadamard(64)) and l0.v_clip == 0.9
    assert torch.equal(l1.r_k, c.layer(1)["r_k"]) and l1.r_v is None and l1.k_clip == 0.93
    # K ch2 (2 + 32/64) + V tok4 (4.5), K tok2 2.5 + V tok2 2.5 -> mean 3.0
    assert auto.bits_per_element(64) == pytest.approx(3.0)
    assert methods.nominal_bits("oscar-auto", 64, c) == pytest.approx(3.0)
    assert methods.nominal_bits("kivi-2", 64, c) == pytest.approx(2.75)


def test_recipe_bits_match_method_bits_for_uniform_methods():
    c = _calib()
    for name, d in (("oscar", 64), ("kivi-2", 64), ("int4-hadamard", 64), ("naive-int2", 64)):
        assert methods.resolve(name, c).bits_per_element(d) == pytest.approx(methods.get(name).bits_per_element(d))
