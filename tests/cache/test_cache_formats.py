"""Per-layer formats in the store (oscar-auto): each layer of a mixed-format store holds exactly what a store of
that single format holds; channel pages follow ``quantize_per_channel`` on each page."""

import pytest
import torch

from oscarkv import methods
from oscarkv.artifact import ArtifactError, Calibration, ModelIdentity
from oscarkv.cache import growable_store
from oscarkv.config import QuantSpec
from oscarkv.formats import FormatError, LayerFormat, TensorFormat
from oscarkv.quant import dequantize_per_channel, quantize_per_channel

D, H = 64, 2
IDENT = ModelIdentity("llama", num_layers=3, num_q_heads=4, num_kv_heads=H, head_dim=D, hidden_size=256)
SPEC = QuantSpec(k_clip=0.9, v_clip=0.9, sink=4, window=8, page_size=16)
MIXED = [
    {"k": {"layout": "channel", "bits": 2, "rotation": "none"}, "v": {"layout": "token", "bits": 4,
                                                                       "rotation": "hadamard"}},
    {"k": {"layout": "token", "bits": 2, "rotation": "calibrated", "clip": 0.94},
     "v": {"layout": "token", "bits": 2, "rotation": "calibrated", "clip": 0.9}},
    {"k": {"layout": "channel", "bits": 4, "rotation": "calibrated"}, "v": {"layout": "token", "bits": 2,
                                                                             "rotation": "none", "clip": 0.88}},
]


def _calib(formats=None) -> Calibration:
    c = Calibration.identity(IDENT, SPEC, clip=0.9)
    torch.manual_seed(0)
    q, _ = torch.linalg.qr(torch.randn(3, D, D))
    c.r_k.copy_(q)
    c.r_v.copy_(q.flip(0))
    c.mu_k.normal_()
    c.mu_v.normal_()
    c.layer_formats = formats
    c.validate_shapes()
    return c


def _fill(store, rows_k, rows_v, steps=(5, 1, 17, 3, 30, 1, 1, 20)):
    t = 0
    for m in steps:
        store.reserve(0, t + m)
        for layer in range(store.L):
            store.write(layer, 0, rows_k[t: t + m], rows_v[t: t + m])
        store.commit(0, m)
        t += m
    return store


@pytest.mark.parametrize("layer", [0, 1, 2])
def test_mixed_store_equals_single_format_store(layer):
    mixed = methods.resolve("oscar-auto", _calib(MIXED))
    single = methods.resolve("oscar-auto", _calib([MIXED[layer]] * 3))
    assert mixed.formats[layer] == single.formats[(layer + 1) % 3] == LayerFormat.from_entry(MIXED[layer])
    torch.manual_seed(layer)
    k, v = torch.randn(78, H, D) * 3, torch.randn(78, H, D)
    a = _fill(growable_store(mixed, [0, 1, 2], 1, H, D, torch.float32, "cpu"), k, v)
    b = _fill(growable_store(single, [0], 1, H, D, torch.float32, "cpu"), k, v)
    ta, tb = a.tiers(layer, 0), b.tiers(0, 0)
    assert ta["k_quantized"].shape[1] == 64  # 78 - 4 sink - 10 recent -> 4 pages of 16
    for name in ta:
        assert torch.equal(ta[name], tb[name]), name


def test_layer_pools_follow_formats():
    r = methods.resolve("oscar-auto", _calib(MIXED))
    st = growable_store(r, [0, 1, 2], 1, H, D, torch.bfloat16, "cpu")
    k0, v0 = st.k_pages[0].fmt, st.v_pages[0].fmt
    assert k0.channel and k0.page_size == 16 and k0.bits == 2 and not v0.channel and v0.bits == 4
    assert st.formats[1].k.clip == 0.94 and not st.k_pages[1].fmt.channel
    assert st.k_pages[2].fmt.channel and st.k_pages[2].fmt.bits == 4 and st.v_pages[2].fmt.bits == 2
    kivi = growable_store(methods.resolve("kivi-2", _calib(MIXED)), [0], 1, H, D, torch.bfloat16, "cpu")
    assert kivi.k_pages[0].fmt.channel and kivi.page_size == 32  # KIVI's 32-token key groups: channel pages


def test_channel_pages_equal_per_channel_quantizer_on_each_page():
    r = methods.resolve("oscar-auto", _calib(MIXED))
    store = growable_store(r, [0], 1, H, D, torch.float32, "cpu")
    torch.manual_seed(3)
    k, v = torch.randn(60, H, D) * 2 + 1, torch.randn(60, H, D)
    _fill(store, k, v, steps=(60,))
    got = store.tiers(0, 0)["k_quantized"]  # tokens 4..51: 3 pages of 16
    assert got.shape[1] == 48
    for p in range(3):
        page = k[4 + 16 * p: 4 + 16 * (p + 1)].transpose(0, 1)  # rows arrive centered and rotated (here: as given)
        want = dequantize_per_channel(quantize_per_channel(page, bits=2, group_size=16))
        assert torch.equal(got[:, 16 * p: 16 * (p + 1)], want)


def test_unknown_format_names_error_clearly():
    with pytest.raises(ArtifactError, match="unknown format layout 'rows'"):
        _calib([{"k": {"layout": "rows"}, "v": {}}] * 3)
    with pytest.raises(FormatError, match="unknown format rotation"):
        TensorFormat(rotation="random")
    with pytest.raises(FormatError, match="bits must be 2 or 4"):
        TensorFormat(bits=3)
    with pytest.raises(FormatError, match="unknown tensor-format key"):
        TensorFormat.from_dict({"layout": "token", "bitz": 2})
    with pytest.raises(FormatError, match="no per-row clip"):
        TensorFormat("channel", clip=0.9)
    with pytest.raises(FormatError, match="clip must be a ratio"):
        TensorFormat(clip=1.5)
    with pytest.raises(ArtifactError, match="values are stored token-wise"):
        _calib([{"k": {}, "v": {"layout": "channel"}}] * 3)
    with pytest.raises(ArtifactError, match="'k' and 'v'"):
        _calib([{"bits": 4}] * 3)
