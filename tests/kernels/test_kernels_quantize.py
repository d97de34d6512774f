"""Quantize/pack/write and demotion kernels: codes, scales and offsets bit-exact with the reference quantizer
(computed on the CPU, the specification), negative slots skipped, untouched slots left alone."""

import pytest
import torch
from kernel_helpers import DEVICE, poisoned_pages

from oscarkv.kernels.layout import PageFormat
from oscarkv.kernels.quantize_triton import demote_triton, quantize_write_triton
from oscarkv.kernels.reference import demote_ref, quantize_write_ref

GPU = DEVICE.type == "cuda"
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
def test_quantize_write_fused_rotation(per_head):
    """With x @ R fused, codes are bit-exact with quantize() of the float32 rows the kernel computed (exposed
    through ``debug_rows``), and those rows match torch's x @ R to float32 rounding."""
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
    dbg = (torch.zeros(N_ROWS, HKV, d, device=DEVICE), torch.zeros(N_ROWS, HKV, d, device=DEVICE))
    quantize_write_triton(kp, vp, k, v, slots, k_rotation=rk, v_rotation=rv, k_mean=mk, v_mean=mv,
                          k_clip=0.96, v_clip=0.92, debug_rows=dbg)
    keep = (slots >= 0).cpu()
    for x, mu, r, rows in ((k, mk, rk, dbg[0]), (v, mv, rv, dbg[1])):
        eq = "nhd,de->nhe" if r.ndim == 2 else "nhd,hde->nhe"
        want = torch.einsum(eq, x.double().cpu() - mu.double().cpu(), r.double().cpu())
        assert (rows.cpu()[keep].double() - want[keep]).abs().max() < 1e-4 * want.abs().max()
    quantize_write_ref(kr, dbg[0].cpu()[keep], slots.cpu()[keep], clip_ratio=0.96)
    quantize_write_ref(vr, dbg[1].cpu()[keep], slots.cpu()[keep], clip_ratio=0.92)
    _assert_same(kp, kr)
    _assert_same(vp, vr)


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


def test_demote_bit_exact():
    d = 128 if GPU else 64
    fmt = PageFormat(num_kv_heads=HKV, head_dim=d, page_size=16)
    B, c16 = 3, 40
    k16 = torch.randn(B, HKV, c16, d, device=DEVICE, dtype=torch.bfloat16)
    v16 = torch.randn(B, HKV, c16, d, device=DEVICE, dtype=torch.bfloat16)
    n = 24
    seq = torch.randint(0, B, (n,), device=DEVICE, dtype=torch.int32)
    src = torch.randint(0, c16, (n,), device=DEVICE, dtype=torch.int32)
    kp, vp = _pools(fmt, 4)
    kr, vr = _cpu_copy(kp), _cpu_copy(vp)
    slots = _slots(n, fmt, 4)
    demote_triton(kp, vp, k16, v16, seq, src, slots, k_clip=0.96, v_clip=0.92)
    demote_ref(kr, vr, k16.cpu(), v16.cpu(), seq.cpu(), src.cpu(), slots.cpu(), k_clip=0.96, v_clip=0.92)
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
