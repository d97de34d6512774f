"""The plugin's quantization monitors (no vLLM import): what a sampled page write reports, and in which metrics."""

import pytest
import torch

from oscarkv.integrations.vllm.core import LayerParams
from oscarkv.integrations.vllm.monitor import PluginMonitor
from oscarkv.kernels.layout import PageFormat, QuantPages
from oscarkv.kernels.reference import quantize_write_ref, rotate_rows_ref
from oscarkv.quant import clip_rows, fake_quantize
from oscarkv.rotation import random_orthogonal

prometheus_client = pytest.importorskip("prometheus_client")
H, D, P = 2, 64, 64


def _params(g: torch.Generator) -> LayerParams:
    r = lambda: torch.stack([random_orthogonal(D, g) for _ in range(H)])  # noqa: E731
    return LayerParams(r_k=r(), r_v=r(), mu_k=torch.randn(H, D, generator=g) * 0.1,
                       mu_v=torch.randn(H, D, generator=g) * 0.1, k_clip=0.9, v_clip=0.95, sm_scale=D**-0.5)


def _written(g: torch.Generator, p: LayerParams, slots: torch.Tensor):
    """Pages holding ``k``/``v`` as the plugin's write stores them: rotated, rounded to the tier dtype, quantized."""
    fmt = PageFormat(num_kv_heads=H, head_dim=D, page_size=P)
    kv = (QuantPages.allocate(fmt, 6), QuantPages.allocate(fmt, 6))
    k, v = (torch.randn(slots.numel(), H, D, generator=g) * 2 for _ in range(2))
    rows = []
    for pages, x, r, mu, clip in ((kv[0], k, p.r_k, p.mu_k, p.k_clip), (kv[1], v, p.r_v, p.mu_v, p.v_clip)):
        x16 = rotate_rows_ref(x, r, mu).to(p.dtype16)
        quantize_write_ref(pages, x16, slots, clip_ratio=clip)
        rows.append(x16.float())
    return kv, k, v, rows


def _value(name: str, **labels) -> float | None:
    return prometheus_client.REGISTRY.get_sample_value(name, labels)


def test_a_sampled_write_reports_the_pages_error_and_clip_rate():
    g = torch.Generator().manual_seed(0)
    p = _params(g)
    slots = torch.tensor([130, 131, -1, *range(200, 260), 5])  # across pages, out of order, one padding row
    kv, k, v, rows = _written(g, p, slots)
    mon = PluginMonitor(rank=7, num_layers=3, every=4)
    mon.observe(2, p, kv, k, v, slots)
    err, clipped, count = mon.quant.snapshot()
    keep = slots >= 0
    for which, clip in enumerate((p.k_clip, p.v_clip)):
        x = rows[which][keep]
        ref = fake_quantize(x, bits=2, clip_ratio=clip)  # the quantizer on the same rows, without the pages
        want = float((x - ref).pow(2).sum() / x.pow(2).sum()) ** 0.5
        assert abs(float(err[which, 2]) - want) < 1e-5 * want
        assert 0.05 < want < 0.6  # 2-bit error of Gaussian rows, not a misread page (~1.4)
        assert float(clipped[which, 2]) == pytest.approx(float((clip_rows(x, clip) != x).float().mean()))
        assert float(clipped[which, 2]) > 0
        assert count[which, 2] == 1 and count[which, :2].sum() == 0
        labels = {"rank": "7", "kv": "kv"[which], "layer": "2"}
        assert _value("oscar_kv_quant_rel_error", **labels) == pytest.approx(float(err[which, 2]))
        assert _value("oscar_kv_quant_clipped_fraction", **labels) == pytest.approx(float(clipped[which, 2]))
        assert _value("oscar_kv_quant_samples_total", **labels) == 1


def test_a_misread_slot_would_show():
    """The comparison reads the rows at their slots: pages that hold other rows report a large error."""
    g = torch.Generator().manual_seed(1)
    p = _params(g)
    slots = torch.arange(64, 128)
    kv, k, v, _ = _written(g, p, slots)
    mon = PluginMonitor(rank=8, num_layers=1, every=1)
    mon.observe(0, p, kv, k, v, slots.flip(0))  # same slots, rows swapped
    err, _, _ = mon.quant.snapshot()
    assert (err[:, 0] > 1.0).all()


def test_channel_pages_are_not_sampled():
    g = torch.Generator().manual_seed(2)
    p = _params(g)
    slots = torch.arange(0, 64)
    kv, k, v, _ = _written(g, p, slots)
    channel = QuantPages.allocate(PageFormat(num_kv_heads=H, head_dim=D, page_size=P, layout="channel"), 2)
    mon = PluginMonitor(rank=9, num_layers=1, every=1)
    mon.observe(0, p, (channel, kv[1]), k, v, slots)
    _, _, count = mon.quant.snapshot()
    assert count[0, 0] == 0 and count[1, 0] == 1


@pytest.mark.parametrize("every, sampled", [(3, [1, 4, 7]), (1, list(range(1, 9))), (0, [])])
def test_sampling_takes_the_first_call_then_every_nth(every, sampled):
    mon = PluginMonitor(rank=10, num_layers=2, every=every)
    got = [n for n in range(1, 9) if mon.due(1)]
    assert got == sampled
    assert mon.calls[0] == 0


def test_figures_of_the_layers_and_tiers():
    mon = PluginMonitor(rank=11, num_layers=2, every=1)
    mon.set_tiers(sink=64, window=128, slots=5)
    mon.set_layer(0, 72.0, 1000)
    mon.set_layer(1, 40.0, 3000)
    mon.set_layer(1, 40.0, 3000)  # a layer set again is not counted twice
    mon.window_misses(0)
    mon.window_misses(3)
    assert _value("oscar_kv_tier_tokens", rank="11", tier="sink") == 64
    assert _value("oscar_kv_tier_tokens", rank="11", tier="window") == 128
    assert _value("oscar_kv_window_slots", rank="11") == 5
    assert _value("oscar_kv_window_bytes", rank="11") == 4000
    assert _value("oscar_kv_bytes_per_token", rank="11", layer="0") == 72
    assert _value("oscar_kv_window_misses_total", rank="11") == 3
