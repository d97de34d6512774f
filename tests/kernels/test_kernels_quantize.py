"""Quantize/pack/write and demotion kernels: codes, scales and offsets bit-exact with the reference quantizer
(computed on the CPU, the specification), negative slots skipped, untouched slots left alone; every K/V pair of
storage formats (keys token/channel x 2/4 bits, values 2/4 bits). The clip order statistic's method is picked per
ratio (top-down, bottom-up, bisection), so ratios select each one; interpreter tests run at tiny shapes."""

import pytest
import torch
from kernel_helpers import DEVICE, FORMATS, brute_threshold, fmt_id, poisoned_pages

from oscarkv.kernels.layout import PageFormat
from oscarkv.kernels.quantize_triton import demote_triton, quantize_write_triton
from oscarkv.kernels.reference import demote_ref, quantize_write_ref

GPU = DEVICE.type == "cuda"
pytestmark = pytest.mark.interpret if not GPU else []
N_ROWS = 1000 if GPU else 21
HKV = 8 if GPU else 2


def _pools(fmt, num_pages):
    kp = poisoned_pages(fmt, num_pages, DEVICE)
    vp = poisoned_pages(fmt, num_pages, DEVICE)
    return kp, vp


def _cpu_copy(pages):
    """An independent CPU copy (``.cpu()`` alone would alias a CPU pool and make every comparison trivial)."""
    return type(pages)(pages.codes.cpu().clone(), pages.scale.cpu().clone(), pages.offset.cpu().clone(), pages.fmt)


def _bits(t):
    return t.cpu().contiguous().view(torch.uint8)


def _assert_same(a, b):
    """Bit-for-bit equality of whole pools (poisoned bytes included, so NaN compares by its bits)."""
    assert torch.equal(_bits(a.codes), _bits(b.codes)), "codes differ"
    assert torch.equal(_bits(a.scale), _bits(b.scale)), "scales differ"
    assert torch.equal(_bits(a.offset), _bits(b.offset)), "offsets differ"


def _slots(n, fmt, num_pages):
    slots = torch.randperm(num_pages * fmt.page_size)[:n].to(DEVICE)
    slots[n // 3] = -1  # padding row: never written
    return slots


@pytest.mark.parametrize("d,bits,group,meta,clip", [
    (64, 2, None, torch.float16, 0.9),
    (128, 2, 32, torch.bfloat16, 0.96),
    (128, 2, None, torch.float32, 0.0),
    (96, 2, None, torch.float16, 0.92),
    (64, 4, 16, torch.float16, 0.95),
    (256, 2, None, torch.bfloat16, 0.97),
])
def test_quantize_write_bit_exact(d, bits, group, meta, clip):
    fmt = PageFormat(num_kv_heads=HKV, head_dim=d, page_size=16, bits=bits, group_size=group, meta_dtype=meta)
    npages = N_ROWS // 8 + 2
    kp, vp = _pools(fmt, npages)
    kr, vr = _cpu_copy(kp), _cpu_copy(vp)
    k = (torch.randn(N_ROWS, HKV, d, device=DEVICE) * 4).to(torch.bfloat16)
    v = torch.randn(N_ROWS, HKV, d, device=DEVICE, dtype=torch.float16)
    k[0, 0] = 1.5  # a constant row: scale 0, every code 0
    mean = torch.randn(HKV, d, device=DEVICE)
    slots = _slots(N_ROWS, fmt, npages)
    quantize_write_triton(kp, vp, k, v, slots, k_mean=mean, k_clip=clip, v_clip=clip / 2)
    quantize_write_ref(kr, k.cpu(), slots.cpu(), mean=mean.cpu(), clip_ratio=clip)
    quantize_write_ref(vr, v.cpu(), slots.cpu(), clip_ratio=clip / 2)
    _assert_same(kp, kr)
    _assert_same(vp, vr)


@pytest.mark.parametrize("per_head", [False, True])
def test_quantize_write_rotation(per_head):
    """With a mean and a rotation (applied as the reference's float32 einsum before the kernel), bit-exact."""
    d = 128 if GPU else 64
    fmt = PageFormat(num_kv_heads=HKV, head_dim=d, page_size=16)
    npages = N_ROWS // 8 + 2
    kp, vp = _pools(fmt, npages)
    kr, vr = _cpu_copy(kp), _cpu_copy(vp)
    shape = (HKV, d, d) if per_head else (d, d)
    rk = torch.linalg.qr(torch.randn(*shape, dtype=torch.float64))[0].float().to(DEVICE)
    rv = torch.linalg.qr(torch.randn(*shape, dtype=torch.float64))[0].float().to(DEVICE)
    k = torch.randn(N_ROWS, HKV, d, device=DEVICE, dtype=torch.bfloat16)
    v = torch.randn(N_ROWS, HKV, d, device=DEVICE, dtype=torch.bfloat16)
    mk, mv = torch.randn(HKV, d, device=DEVICE), torch.randn(HKV, d, device=DEVICE)
    slots = _slots(N_ROWS, fmt, npages)
    quantize_write_triton(kp, vp, k, v, slots, k_rotation=rk, v_rotation=rv, k_mean=mk, v_mean=mv,
                          k_clip=0.96, v_clip=0.92)
    # the reference on the same device (its einsum is the kernel path's), copied to the CPU pools
    kd, vd = poisoned_pages(fmt, npages, DEVICE), poisoned_pages(fmt, npages, DEVICE)
    for t, u in ((kd, kr), (vd, vr)):
        for name in ("codes", "scale", "offset"):
            getattr(t, name).copy_(getattr(u, name))
    quantize_write_ref(kd, k, slots, rotation=rk, mean=mk, clip_ratio=0.96)
    quantize_write_ref(vd, v, slots, rotation=rv, mean=mv, clip_ratio=0.92)
    _assert_same(kp, kd)
    _assert_same(vp, vd)


def test_clip_threshold_exact_with_ties():
    """Rows full of ties, zeros and negative zeros: the order statistic must still be exact."""
    d = 64
    fmt = PageFormat(num_kv_heads=1, head_dim=d, page_size=16)
    kp, vp = _pools(fmt, 2)
    kr, vr = _cpu_copy(kp), _cpu_copy(vp)
    base = torch.tensor([0.0, -0.0, 1.0, -1.0, 2.0, 2.0, -2.0, 3.5], dtype=torch.float32)
    x = base[torch.randint(0, 8, (16, 1, d))].to(DEVICE)
    slots = torch.arange(16, device=DEVICE)
    for ratio in (0.3, 0.5, 0.9, 0.99):
        quantize_write_triton(kp, vp, x, -x, slots, k_clip=ratio, v_clip=ratio)
        quantize_write_ref(kr, x.cpu(), slots.cpu(), clip_ratio=ratio)
        quantize_write_ref(vr, -x.cpu(), slots.cpu(), clip_ratio=ratio)
        _assert_same(kp, kr)
        _assert_same(vp, vr)


@pytest.mark.parametrize("ties,k_clip,v_clip", [(False, 0.96, 0.92), (True, 0.9, 0.05), (True, 0.5, 0.3)],
                         ids=["bf16", "ties-bottom-up", "ties-bisection"])
def test_demote_bit_exact(ties, k_clip, v_clip):
    """Demotion (gather mode) bit-exact with demote_ref: bfloat16 K and V at the default clips, and float16 keys
    full of ties (small integers) with clips that extract bottom-up or bisect."""
    d = 128 if GPU else 64
    fmt = PageFormat(num_kv_heads=HKV, head_dim=d, page_size=16)
    B, c16 = 3, 40
    if ties:
        k16 = (torch.randn(B, HKV, c16, d, device=DEVICE) * 2).round().to(torch.float16)
    else:
        k16 = torch.randn(B, HKV, c16, d, device=DEVICE, dtype=torch.bfloat16)
    v16 = torch.randn(B, HKV, c16, d, device=DEVICE, dtype=torch.bfloat16)
    n = 24
    seq = torch.randint(0, B, (n,), device=DEVICE, dtype=torch.int32)
    src = torch.randint(0, c16, (n,), device=DEVICE, dtype=torch.int32)
    kp, vp = _pools(fmt, 4)
    kr, vr = _cpu_copy(kp), _cpu_copy(vp)
    slots = _slots(n, fmt, 4)
    demote_triton(kp, vp, k16, v16, seq, src, slots, k_clip=k_clip, v_clip=v_clip)
    demote_ref(kr, vr, k16.cpu(), v16.cpu(), seq.cpu(), src.cpu(), slots.cpu(), k_clip=k_clip, v_clip=v_clip)
    _assert_same(kp, kr)
    _assert_same(vp, vr)


def test_quantize_write_rejects_bad_shapes():
    fmt = PageFormat(num_kv_heads=2, head_dim=64, page_size=16)
    kp, vp = _pools(fmt, 2)
    x = torch.randn(4, 2, 32, device=DEVICE)
    with pytest.raises(ValueError, match="must both be"):
        quantize_write_triton(kp, vp, x, x, torch.arange(4, device=DEVICE))
    x = torch.randn(4, 2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="rotation"):
        quantize_write_triton(kp, vp, x, x, torch.arange(4, device=DEVICE), k_rotation=torch.eye(32))


def test_codes_exact_at_rounding_ties():
    """Elements exactly at (m + 1/2) steps above the minimum round up (RN(RN(a/s) + 0.5)); large magnitudes
    (float bits >= 2^30) once broke the threshold search with an int32 overflow."""
    d = 64
    fmt = PageFormat(num_kv_heads=1, head_dim=d, page_size=16)
    kp, vp = _pools(fmt, 2)
    kr, vr = _cpu_copy(kp), _cpu_copy(vp)
    rows = []
    for s in (4.9375, 0.75, 1.25 * 2**-7, 96.0, 3000.0):
        lo = -1.5 * s
        vals = torch.tensor([lo + m * s / 2 for m in range(7)])
        rows.append(vals[torch.randint(0, 7, (d,))])
        rows[-1][:2] = torch.tensor([lo, lo + 3 * s])  # pin the range: scale = s exactly
    x = torch.stack(rows)[:, None, :].to(DEVICE)
    slots = torch.arange(len(rows), device=DEVICE)
    quantize_write_triton(kp, vp, x, x * 0.5, slots)
    quantize_write_ref(kr, x.cpu(), slots.cpu())
    quantize_write_ref(vr, x.cpu() * 0.5, slots.cpu())
    _assert_same(kp, kr)
    _assert_same(vp, vr)


# ------------------------------------------------------------------------------- edge rows and ratios
def _round_trip(x, k_clip, v_clip, bits=2, group=None, meta=torch.float16, n_pages=None, v=None):
    """Write ``x`` (K) and ``v`` (V; default ``-x``) through the kernel and the reference into independent
    poisoned pools (random slots, one padding row) and assert bit equality."""
    n, hkv, d = x.shape
    fmt = PageFormat(num_kv_heads=hkv, head_dim=d, page_size=16, bits=bits, group_size=group, meta_dtype=meta)
    npages = n_pages or n // 8 + 2
    kp, vp = _pools(fmt, npages)
    kr, vr = _cpu_copy(kp), _cpu_copy(vp)
    v = -x if v is None else v
    slots = _slots(n, fmt, npages)
    quantize_write_triton(kp, vp, x.to(DEVICE), v.to(DEVICE), slots, k_clip=k_clip, v_clip=v_clip)
    quantize_write_ref(kr, x.cpu(), slots.cpu(), clip_ratio=k_clip)
    quantize_write_ref(vr, v.cpu(), slots.cpu(), clip_ratio=v_clip)
    _assert_same(kp, kr)
    _assert_same(vp, vr)


def _tie_rows(n, hkv, d, dtype):
    """Gaussian rows, some rounded (ties everywhere), one with a single repeated maximum, one constant."""
    x = torch.randn(n, hkv, d) * 3
    x[1::3] = x[1::3].round()
    x[2, 0] = torch.tensor([0.0, 1.0, -1.0, 2.0])[torch.randint(0, 4, (d,))]
    x[0, -1] = 0.75
    return x.to(dtype)


def test_code_boundaries_are_the_rounding_thresholds():
    """The 2-bit codes compare v = div_rn(x - lo, s) with pred(0.5), 1.5, 2.5: equal to the reference
    clamp(floor(RN(v + 0.5)), 0, 3) on both sides of every boundary (both sides are monotone in v, so the
    boundaries decide everything), and on a sample of all magnitudes."""
    from oscarkv.kernels.quantize_math import _U1

    u1 = torch.tensor(0.5).view(torch.int32) - 1
    assert torch.tensor(_U1.value, dtype=torch.float32).view(torch.int32) == u1
    cuts = torch.tensor([_U1.value, 1.5, 2.5])
    near = torch.cat([(cuts.view(torch.int32)[i] + torch.arange(-4096, 4097)).view(torch.float32) for i in range(3)])
    wide = torch.randint(0, 2**32 - 1, (1 << 18,), dtype=torch.int64).to(torch.int32).view(torch.float32)
    v = torch.cat([near, wide, torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 3.0, 1e30])])
    v = v[torch.isfinite(v) | torch.isinf(v)]  # no NaN (never produced for finite input)
    ref = torch.floor(v + 0.5).clamp(0, 3)
    got = (v[:, None] >= cuts[None, :]).sum(1).to(torch.float32)
    assert torch.equal(ref, got)


def test_threshold8_window_exhaustive():
    """code_thr8's short search (kernel ``_threshold8``, mirrored here in torch) finds the exact threshold for
    every finite float16 and bfloat16 scale (2 probes), and for float32 samples (3 probes: random, binade
    edges, subnormals); the threshold is never more than one ulp from ``RN(u_k s)``."""
    f16 = torch.arange(1, 0x7C00, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    bf16 = torch.arange(1, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    p2 = torch.ldexp(torch.ones(277, dtype=torch.float64), torch.arange(-149, 128)).float().view(torch.int32)
    edges = torch.cat([p2 + i for i in range(-8, 9)]).clamp(1, 0x7F7FFFFF).view(torch.float32)
    rand = torch.randint(1, 0x7F800000, (1 << 17,), dtype=torch.int32).view(torch.float32)
    sub = torch.arange(1, 1 << 16, dtype=torch.int32).view(torch.float32)
    for scales, below, above, probes in ((torch.cat([f16, bf16]), 2, 2, 2), (torch.cat([edges, rand, sub]), 5, 3, 3)):
        for k in (1, 2, 3):
            u = torch.tensor(0.4999999701976776 if k == 1 else k - 0.5, dtype=torch.float32)
            c = (scales * u).view(torch.int32)
            lo, hi = (c - below).clamp(min=0), (c + above).clamp(max=0x7F800000)
            for _ in range(probes):
                mid = lo + ((hi - lo) >> 1)
                ok = torch.floor(mid.view(torch.float32) / scales + 0.5) >= k
                hi, lo = torch.where(ok, mid, hi), torch.where(ok, lo, mid)
            exact = brute_threshold(scales, k)
            assert torch.equal(hi, exact), k
            assert (exact - c).abs().max() <= 1, k


def test_clip_plan_picks_fewest_passes():
    from oscarkv.kernels.quantize_triton import clip_plan

    assert clip_plan(0.96, 128, True) == (1, 5, 122)  # K: top-down, 5 steps after the max
    assert clip_plan(0.92, 128, True) == (1, 10, 117)  # V
    assert clip_plan(0.92, 128, False) == (1, 10, 117)  # float32 rows: 22 passes < 31
    assert clip_plan(0.5, 128, True)[0] == 3 and clip_plan(0.5, 128, False)[0] == 3  # bisection
    assert clip_plan(0.02, 128, True) == (2, 2, 2)  # bottom-up
    assert clip_plan(0.999, 64, True) == (1, 0, 63)  # r = 0: the maximum
    for ratio in (0.0, 1.0):
        assert clip_plan(ratio, 128, True) == (0, 0, 0)
    for ratio in (-0.5, 1.5, float("nan")):
        with pytest.raises(ValueError, match="clip_ratio"):
            clip_plan(ratio, 128, True)


CLIP_CASES = [(64, torch.bfloat16), (128, torch.float16), (96, torch.float32), (256, torch.bfloat16),
              (64, torch.float32)]
# top-down / top-down, r = 0 / bottom-up, bisection / none, none / none
RATIO_PAIRS = [(0.96, 0.92), (0.999, 0.02), (0.5, 0.0), (1.0, 0.0)]


@pytest.mark.parametrize("d,dtype", CLIP_CASES)
def test_clip_methods_bit_exact(d, dtype):
    """Every order-statistic method the ratio picks (unique keys for 16-bit rows, tie counts for float32 rows)
    at r = 0, small and large idx, ratios that disable clipping, on rows full of ties; d = 96 has padded
    quarters."""
    x = _tie_rows(8 if not GPU else 300, HKV, d, dtype)
    for k_clip, v_clip in RATIO_PAIRS:
        _round_trip(x, k_clip, v_clip)


@pytest.mark.parametrize("bits,group,meta", [(2, None, torch.float16), (2, 32, torch.bfloat16), (2, 16, torch.float32),
                                             (4, None, torch.float16), (4, 16, torch.bfloat16)])
def test_groups_bit_exact(bits, group, meta):
    """Groups inside and across quarters (d = 96, G = 32 or 16), with and without clip."""
    d = 96 if group != 16 else 64
    x = _tie_rows(12 if not GPU else 400, HKV, d, torch.bfloat16)
    v = torch.randn(x.shape) * 5 + 2
    _round_trip(x, 0.9, 0.0, bits=bits, group=group, meta=meta, v=v)
    _round_trip(x, 0.0, 0.95, bits=bits, group=group, meta=meta, v=v)


@pytest.mark.parametrize("meta", [torch.float16, torch.bfloat16, torch.float32])
def test_metadata_edge_rows_bit_exact(meta):
    """Rows whose offset rounds by more than a step (|x| up to 1000, float16 ulp 0.5: clamped elements can
    get codes above 0, or stay below 3), rows where tau = 0 (more zeros than idx), and rows in the
    subnormal range (bfloat16/float32 metadata). Mixed-sign zeros as a row's min or max are left out: the
    reference's own min/max of +0 and -0 depends on torch's reduction order."""
    d = 64
    big = (torch.rand(12, 1, 1) * 2000 - 1000).round() + torch.rand(12, 1, d) * 0.8
    zeros = torch.randn(6, 1, d)
    zeros[:, :, :40] = 0.0
    zeros[3] = 0.0
    rows = [big, zeros]
    if meta != torch.float16:
        tiny = torch.rand(6, 1, d) * 2e-39 - 1e-39
        tiny[1] = torch.rand(d) * 1e-43 + 1e-44  # bfloat16 input flushes these to +0 or its smallest step
        rows.append(tiny)
    x = torch.cat(rows)
    for dtype in (torch.float32, torch.bfloat16):
        xx = x.to(dtype)
        for k_clip, v_clip in ((0.9, 0.5), (0.0, 0.3)):
            _round_trip(xx, k_clip, v_clip, meta=meta, v=xx * 0.5)
            _round_trip(xx, k_clip, v_clip, bits=4, meta=meta, v=xx * 0.5)


@pytest.mark.parametrize("fmt", FORMATS, ids=fmt_id)
def test_every_kv_format_pair_bit_exact(fmt):
    """K and V pools of different bits and key layouts (one launch per pool where they differ), 16-bit and
    float32 rows, write and demote; channel-page keys in whole pages (one all-padding page)."""
    kb, lay, vb = fmt
    d, ps = (128, 64) if GPU else (64, 16)
    kf = PageFormat(num_kv_heads=HKV, head_dim=d, page_size=ps, bits=kb, layout=lay)
    vf = PageFormat(num_kv_heads=HKV, head_dim=d, page_size=ps, bits=vb)
    npages = 6
    n = 4 * ps
    slots = (torch.randperm(npages)[:4, None] * ps + torch.arange(ps)).reshape(-1).to(DEVICE)
    slots[ps:2 * ps] = -1  # an all-padding page (channel keys) / padding rows
    if lay == "token":
        slots[5] = -1
    for dtype in (torch.bfloat16, torch.float32):
        kp, vp = poisoned_pages(kf, npages, DEVICE), poisoned_pages(vf, npages, DEVICE)
        kr, vr = _cpu_copy(kp), _cpu_copy(vp)
        k = (torch.randn(n, HKV, d) * 3).to(dtype)
        v = torch.randn(n, HKV, d).to(dtype)
        kc = 0.0 if lay == "channel" else 0.96
        quantize_write_triton(kp, vp, k.to(DEVICE), v.to(DEVICE), slots, k_clip=kc, v_clip=0.92)
        quantize_write_ref(kr, k, slots.cpu(), clip_ratio=kc)
        quantize_write_ref(vr, v, slots.cpu(), clip_ratio=0.92)
        _assert_same(kp, kr)
        _assert_same(vp, vr)
    B, c16 = 2, 2 * ps
    k16 = torch.randn(B, HKV, c16, d, dtype=torch.bfloat16)
    v16 = torch.randn(B, HKV, c16, d, dtype=torch.bfloat16)
    seq = torch.arange(n, dtype=torch.int32) // (2 * ps)
    src = torch.arange(n, dtype=torch.int32) % (2 * ps)
    kp, vp = poisoned_pages(kf, npages, DEVICE), poisoned_pages(vf, npages, DEVICE)
    kr, vr = _cpu_copy(kp), _cpu_copy(vp)
    kc = 0.0 if lay == "channel" else 0.9
    demote_triton(kp, vp, k16.to(DEVICE), v16.to(DEVICE), seq.to(DEVICE), src.to(DEVICE), slots, k_clip=kc,
                  v_clip=0.92)
    demote_ref(kr, vr, k16, v16, seq, src, slots.cpu(), k_clip=kc, v_clip=0.92)
    _assert_same(kp, kr)
    _assert_same(vp, vr)
