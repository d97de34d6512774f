"""Reference quantizer: hand-written golden vectors, round trips, clipping, metadata dtypes, odd shapes."""

import math

import pytest
import torch

from oscarkv.quant import (
    clip_index,
    clip_rows,
    dequantize,
    dequantize_per_channel,
    fake_quantize,
    pack,
    quantize,
    quantize_lloyd_max,
    quantize_per_channel,
    unpack,
)


def test_pack_golden_2bit_quartered():
    # d = 8: byte c holds elements c, c+2, c+4, c+6 in bits [1:0], [3:2], [5:4], [7:6].
    codes = torch.tensor([0, 1, 2, 3, 3, 2, 1, 0], dtype=torch.uint8)
    # byte 0: e0=0, e2=2, e4=3, e6=1 -> 0 | 2<<2 | 3<<4 | 1<<6 = 0 + 8 + 48 + 64 = 120
    # byte 1: e1=1, e3=3, e5=2, e7=0 -> 1 | 3<<2 | 2<<4 | 0<<6 = 1 + 12 + 32 = 45
    assert pack(codes, 2).tolist() == [120, 45]
    assert unpack(torch.tensor([120, 45], dtype=torch.uint8), 2).tolist() == codes.tolist()


def test_pack_golden_4bit():
    codes = torch.tensor([1, 15, 7, 0], dtype=torch.uint8)  # byte c: e_c in [3:0], e_{c+2} in [7:4]
    assert pack(codes, 4).tolist() == [1 | (7 << 4), 15 | (0 << 4)]


def test_quantize_golden_row():
    # Row [0, 1, 2, 3.3]: lo = 0, scale = 1.1 (fp16 1.099609375), codes floor(x/s + .5) = 0, 1, 2, 3.
    x = torch.tensor([[0.0, 1.0, 2.0, 3.3]])
    q = quantize(x, bits=2)
    assert q.scale.dtype == torch.float16 and q.offset.dtype == torch.float16
    assert q.scale.item() == torch.tensor(1.1, dtype=torch.float16).item()
    assert q.offset.item() == 0.0
    # d = 4, one byte: e0=0 [1:0], e1=1 [3:2], e2=2 [5:4], e3=3 [7:6] -> 0 + 4 + 32 + 192 = 228
    assert q.packed.tolist() == [[228]]
    assert torch.allclose(dequantize(q), torch.tensor([[0.0, 1.0996, 2.1992, 3.2988]]), atol=1e-3)


def test_codes_computed_from_stored_metadata():
    # lo rounds in fp16: codes must use the rounded offset and scale, not the float32 ones.
    x = torch.tensor([[0.1234567, 0.5, 0.77, 1.3333]])
    q = quantize(x, bits=2)
    lo_s, s_s = q.offset.float(), q.scale.float()
    expect = torch.clamp(torch.floor((x - lo_s) / s_s + 0.5), 0, 3).to(torch.uint8)
    assert torch.equal(unpack(q.packed, 2), expect)


def test_round_trip_error_bound():
    torch.manual_seed(0)
    x = torch.randn(7, 3, 128)
    for bits in (2, 4):
        q = quantize(x, bits=bits, meta_dtype=torch.float32)
        err = (dequantize(q) - x).abs()
        step = q.scale.float()  # one group per row: [7, 3, 1]
        assert (err <= step / 2 + 1e-5).all(), bits
        assert q.packed.shape == (7, 3, 128 * bits // 8)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("g", [None, 32])
def test_shapes_and_groups(d, g):
    x = torch.randn(5, d)
    q = quantize(x, bits=2, group_size=g)
    G = d if g is None else g
    assert q.packed.shape == (5, d // 4) and q.scale.shape == (5, d // G) and q.group_size == G
    xr = dequantize(q)
    grouped = x.reshape(5, d // G, G)
    assert torch.allclose(xr.reshape(5, d // G, G).amin(-1), grouped.amin(-1), atol=2e-3 * grouped.abs().amax())


@pytest.mark.parametrize("mdt", [torch.float16, torch.bfloat16, torch.float32])
def test_meta_dtypes(mdt):
    x = torch.randn(4, 64) * 3
    q = quantize(x, meta_dtype=mdt)
    assert q.scale.dtype == mdt and q.offset.dtype == mdt
    assert (dequantize(q) - x).abs().max() < 3 * x.abs().max() / 3


def test_clip_order_statistic():
    x = torch.arange(1, 101, dtype=torch.float32).unsqueeze(0) * torch.tensor([1.0, -1.0]).repeat(50)
    # idx = floor(0.96 * 100) = 96 -> tau = 97th smallest |x| = 97
    assert clip_index(0.96, 100) == 96
    out = clip_rows(x, 0.96)
    assert out.abs().max().item() == 97.0
    assert clip_index(0.0, 64) is None and clip_index(1.0, 64) is None
    assert clip_index(0.999, 64) == 63  # floor(63.936) = 63 = d - 1
    assert torch.equal(clip_rows(x, 1.0), x)


@pytest.mark.parametrize("ratio, shown, error", [
    (1.5, "1.5", ValueError), (-0.5, "-0.5", ValueError), (math.nan, "NaN", ValueError), (math.inf, "inf", ValueError),
    ("0.9", "'0.9'", TypeError), (True, "True", TypeError), (None, "None", TypeError)])
def test_clip_ratio_outside_the_unit_interval_is_refused(ratio, shown, error):
    x = torch.randn(4, 64)
    for fn in (lambda: quantize(x, clip_ratio=ratio), lambda: quantize_lloyd_max(x, clip_ratio=ratio),
               lambda: clip_rows(x, ratio), lambda: clip_index(ratio, 64)):
        with pytest.raises(error, match=r"clip_ratio must be a number in \[0, 1\] \(0 or 1: no clipping\), got "
                                             + shown.replace(".", r"\.")):
            fn()


def test_zero_range_rows_no_nan():
    x = torch.zeros(3, 64)
    x[1] = 5.0
    x[2] = 1e-9 * torch.arange(64)  # range below fp16's smallest step
    q = quantize(x)
    assert torch.isfinite(q.scale.float()).all() and torch.isfinite(q.offset.float()).all()
    assert unpack(q.packed[:2], 2).max() == 0
    assert torch.isfinite(dequantize(q)).all()


def test_nan_input_raises():
    x = torch.randn(2, 64)
    x[1, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        quantize(x)
    with pytest.raises(ValueError, match="NaN"):
        quantize(torch.full((1, 64), float("inf")))


def test_meta_overflow_raises_with_advice():
    x = torch.tensor([[0.0, 1e6, 2.0, 3.0]])
    with pytest.raises(ValueError, match="bfloat16"):
        quantize(x, meta_dtype=torch.float16)
    quantize(x, meta_dtype=torch.bfloat16)


def test_bad_shapes():
    with pytest.raises(ValueError):
        quantize(torch.randn(3, 6))  # not a multiple of 4
    with pytest.raises(ValueError):
        quantize(torch.randn(3, 64), group_size=24)
    with pytest.raises(ValueError):
        quantize(torch.randn(3, 64), bits=3)


def test_deterministic_and_input_untouched():
    x = torch.randn(9, 4, 64)
    x0 = x.clone()
    a, b = quantize(x, clip_ratio=0.9), quantize(x, clip_ratio=0.9)
    assert torch.equal(a.packed, b.packed) and torch.equal(a.scale, b.scale) and torch.equal(x, x0)


def test_fake_quantize_matches():
    x = torch.randn(3, 64)
    assert torch.equal(fake_quantize(x, bits=4), dequantize(quantize(x, bits=4)))


def test_per_channel_kivi():
    torch.manual_seed(1)
    x = torch.randn(2, 64, 16)  # [heads, tokens, dim]
    x[..., 3] += 40.0  # an outlier channel: per-channel groups absorb it
    q = quantize_per_channel(x, group_size=32)
    assert q.packed.shape == (2, 16, 64 // 4) and q.scale.shape == (2, 16, 2)
    xr = dequantize_per_channel(q)
    assert xr.shape == x.shape
    tokenwise = fake_quantize(x)
    assert (xr - x).pow(2).mean() < 0.2 * (tokenwise - x).pow(2).mean()


def test_lloyd_max_beats_uniform_on_gaussian():
    torch.manual_seed(2)
    x = torch.randn(2000, 64)
    lm = dequantize(quantize_lloyd_max(x))
    uni = fake_quantize(x)
    assert (lm - x).pow(2).mean() < (uni - x).pow(2).mean()
    assert math.isfinite(lm.sum().item())


def test_nbytes_physical():
    q = quantize(torch.randn(10, 128))
    assert q.nbytes() == 10 * 32 + 10 * 2 * 2  # codes + fp16 scale + fp16 offset


def test_clip_rows_grid_equals_clip_rows_per_ratio():
    from oscarkv.quant import clip_rows, clip_rows_grid

    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(0))
    grid = [0.0, 0.5, 0.8, 0.96, 1.0]
    out = list(clip_rows_grid(x, grid))
    assert len(out) == len(grid)
    for ratio, y in zip(grid, out):
        assert torch.equal(y, clip_rows(x, ratio))
    assert not torch.equal(out[2], x)  # 0.8 really clips
