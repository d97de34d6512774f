"""Keys in channel pages: a scale/offset per (page, KV head, channel) over the page's tokens. The write path:
codes and metadata bit-exact with ``oscarkv.quant.quantize_per_channel(x_page, group_size=page_size)``
(reference) and with the reference (Triton, on pools filled with random bytes); partial pages are rejected.
Attention over channel-page keys is tested with every format in test_kernels_decode.py / test_kernels_extend.py.
"""

import pytest
import torch
from kernel_helpers import DEVICE, poisoned_pages

from oscarkv.kernels import dispatch
from oscarkv.kernels.layout import PageFormat, QuantPages
from oscarkv.kernels.quantize_triton import demote_triton, quantize_write_triton
from oscarkv.kernels.reference import dequantize_pages_ref, quantize_write_ref
from oscarkv.quant import dequantize_per_channel, quantize_per_channel, unpack

GPU = DEVICE.type == "cuda"
pytestmark = pytest.mark.interpret if not GPU else []


def _fmts(hkv, d, ps, bits=2, meta=torch.float16):
    return (PageFormat(hkv, d, ps, bits, None, meta, layout="channel"), PageFormat(hkv, d, ps, bits, None, meta))


def _clone(p: QuantPages) -> QuantPages:
    return QuantPages(p.codes.clone(), p.scale.clone(), p.offset.clone(), p.fmt)


def _assert_same(a: QuantPages, b: QuantPages):
    for name in ("codes", "scale", "offset"):
        x, y = getattr(a, name), getattr(b, name)
        mism = (x.view(torch.uint8) != y.view(torch.uint8)).sum().item()
        assert mism == 0, f"{name}: {mism} bytes differ"


def test_page_format_channel_geometry():
    kf, vf = _fmts(8, 128, 64)
    assert kf.channel and not vf.channel and kf.same_geometry(vf) and kf != vf
    assert kf.meta_shape == (1, 128) and vf.meta_shape == (64, 1)
    assert vf.bytes_per_token == 8 * (32 + 4)
    assert kf.bytes_per_token == 8 * (32 + 2 * 128 * 2 // 64)  # per-page metadata amortized over its tokens
    assert PageFormat(1, 64, 48, layout="channel").bytes_per_token == pytest.approx(16 + 256 / 48)
    p = QuantPages.allocate(kf, 3)
    assert p.scale.shape == (3, 8, 1, 128) and p.codes.shape == (3, 8, 64, 32)
    assert p.nbytes() == 3 * 64 * kf.bytes_per_token
    with pytest.raises(ValueError, match="group_size"):
        PageFormat(1, 64, 16, group_size=32, layout="channel")
    with pytest.raises(ValueError, match="layout"):
        PageFormat(1, 64, 16, layout="tokens")


@pytest.mark.parametrize("bits,meta", [(2, torch.float16), (4, torch.bfloat16), (2, torch.float32)])
def test_reference_write_is_quantize_per_channel(bits, meta):
    hkv, d, ps = 2, 64, 16
    kf, _ = _fmts(hkv, d, ps, bits, meta)
    pages = poisoned_pages(kf, 5, "cpu")
    before = _clone(pages)
    x = torch.randn(3 * ps, hkv, d) * torch.rand(1, hkv, d) * 4
    x[:, :, :4] = torch.randint(-3, 3, (3 * ps, hkv, 4)).float()  # ties between levels
    mean, rot = torch.randn(hkv, d), torch.linalg.qr(torch.randn(d, d))[0]
    slots = torch.cat([torch.arange(4 * ps, 5 * ps), torch.full((ps,), -1), torch.arange(ps, 2 * ps)])
    quantize_write_ref(pages, x, slots, rotation=rot, mean=mean)
    xr = (x - mean) @ rot
    for rows, page in ((slice(0, ps), 4), (slice(2 * ps, 3 * ps), 1)):
        q = quantize_per_channel(xr[rows].permute(1, 0, 2), bits=bits, group_size=ps, meta_dtype=meta)
        assert torch.equal(unpack(pages.codes[page], bits), unpack(q.packed, bits).transpose(-1, -2))
        assert torch.equal(pages.scale[page], q.scale.transpose(-1, -2))
        assert torch.equal(pages.offset[page], q.offset.transpose(-1, -2))
        deq = dequantize_pages_ref(pages, torch.tensor([page]))[0]
        assert torch.equal(deq, dequantize_per_channel(q))
    for page in (0, 2, 3):  # untouched
        assert torch.equal(pages.codes[page], before.codes[page])
        assert torch.equal(pages.scale[page].view(torch.uint8), before.scale[page].view(torch.uint8))


def test_channel_write_rejects_partial_pages():
    kf, vf = _fmts(1, 64, 16)
    pages = QuantPages.allocate(kf, 4)
    x = torch.randn(32, 1, 64)
    bad = {
        "multiple": (x[:20], torch.arange(20)),
        "one whole page": (x, torch.cat([torch.arange(8, 24), torch.arange(32, 48)])),  # misaligned run
        "one whole page ": (x, torch.cat([torch.arange(16).flip(0), torch.arange(32, 48)])),  # out of order
        "one whole page  ": (x, torch.cat([torch.arange(8), torch.full((8,), -1), torch.arange(32, 48)])),
    }
    for match, (xx, slots) in bad.items():
        with pytest.raises(ValueError, match=match.strip()):
            quantize_write_ref(pages, xx, slots)
    with pytest.raises(ValueError, match="not clipped"):
        quantize_write_ref(pages, x, torch.arange(32), clip_ratio=0.9)
    with pytest.raises(ValueError, match="partial pages"):
        dispatch.quantize_write(pages, QuantPages.allocate(vf, 4), x[:20], x[:20], torch.arange(20))


def _write_case(bits, meta, d, rotation=False):
    hkv, ps = 2, 16
    kf, vf = _fmts(hkv, d, ps, bits, meta)
    kp, vp = poisoned_pages(kf, 5, DEVICE), poisoned_pages(vf, 5, DEVICE)
    rk, rv = _clone(kp), _clone(vp)
    k = torch.randn(3 * ps, hkv, d, device=DEVICE) * torch.rand(1, hkv, d, device=DEVICE) * 4
    k[:, :, :6] = torch.randint(-4, 4, (3 * ps, hkv, 6), device=DEVICE).float()
    v = torch.randn(3 * ps, hkv, d, device=DEVICE)
    slots = torch.cat([torch.arange(4 * ps, 5 * ps), torch.full((ps,), -1), torch.arange(ps, 2 * ps)]).to(DEVICE)
    kw = {}
    if rotation:
        kw = {"k_rotation": torch.linalg.qr(torch.randn(d, d))[0].to(DEVICE), "k_mean": torch.randn(hkv, d).to(DEVICE)}
    quantize_write_triton(kp, vp, k, v, slots, v_clip=0.9, **kw)
    quantize_write_ref(rk, k, slots, rotation=kw.get("k_rotation"), mean=kw.get("k_mean"))
    quantize_write_ref(rv, v, slots, clip_ratio=0.9)
    _assert_same(kp, rk)
    _assert_same(vp, rv)


@pytest.mark.parametrize("bits,meta,d", [(2, torch.float16, 64), (4, torch.bfloat16, 128), (2, torch.float32, 128)])
def test_triton_channel_write_bit_exact(bits, meta, d):
    _write_case(bits, meta, d)


def test_triton_channel_write_rotation():
    _write_case(2, torch.float16, 64, rotation=True)


def test_triton_channel_demote_bit_exact():
    hkv, d, ps = 2, 64, 16
    kf, vf = _fmts(hkv, d, ps)
    kp, vp = poisoned_pages(kf, 4, DEVICE), poisoned_pages(vf, 4, DEVICE)
    rk, rv = _clone(kp), _clone(vp)
    k16 = (torch.randn(2, hkv, 40, d, device=DEVICE) * 3).half()
    v16 = torch.randn(2, hkv, 40, d, device=DEVICE).half()
    seq = torch.tensor([1] * ps + [0] * ps, device=DEVICE)
    src = torch.cat([torch.arange(5, 5 + ps), torch.arange(20, 20 + ps)]).to(DEVICE)
    slots = torch.cat([torch.arange(2 * ps, 3 * ps), torch.arange(0, ps)]).to(DEVICE)
    demote_triton(kp, vp, k16, v16, seq, src, slots, v_clip=0.9)
    dispatch.demote(rk, rv, k16, v16, seq, src, slots, v_clip=0.9, backend="reference")
    _assert_same(kp, rk)
    _assert_same(vp, rv)
    with pytest.raises(ValueError, match="whole"):
        demote_triton(kp, vp, k16, v16, seq, src, slots.flip(0))


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("meta", [torch.float16, torch.bfloat16])
def test_gpu_channel_write_real_shapes_bit_exact(meta):
    """Qwen3-8B shapes (8 KV heads, d 128, page 64), 96 whole pages in shuffled order through dispatch (K and V
    from one call), and the demotion path, against the CPU reference."""
    hkv, d, ps, npg = 8, 128, 64, 96
    kf, vf = _fmts(hkv, d, ps, 2, meta)
    kp, vp = poisoned_pages(kf, npg + 4, DEVICE), poisoned_pages(vf, npg + 4, DEVICE)
    rk, rv, kp2, vp2 = _clone(kp), _clone(vp), _clone(kp), _clone(vp)
    k = (torch.randn(npg * ps, hkv, d, device=DEVICE) * torch.rand(1, hkv, d, device=DEVICE) * 8).bfloat16()
    v = torch.randn(npg * ps, hkv, d, device=DEVICE).bfloat16()
    slots = (torch.randperm(npg + 4, device=DEVICE)[:npg, None] * ps + torch.arange(ps, device=DEVICE)).view(-1)
    dispatch.quantize_write(kp, vp, k, v, slots, v_clip=0.92)
    quantize_write_ref(rk, k, slots)
    quantize_write_ref(rv, v, slots, clip_ratio=0.92)
    _assert_same(kp, rk)
    _assert_same(vp, rv)
    k16, v16 = k.view(4, -1, hkv, d).transpose(1, 2), v.view(4, -1, hkv, d).transpose(1, 2)  # [4, Hkv, C, d]
    seq = torch.arange(npg * ps, device=DEVICE) // (npg * ps // 4)
    src = torch.arange(npg * ps, device=DEVICE) % (npg * ps // 4)
    dispatch.demote(kp2, vp2, k16, v16, seq, src, slots, v_clip=0.92)
    _assert_same(kp2, rk)
    _assert_same(vp2, rv)
