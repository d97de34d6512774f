"""Builders of random paged caches for the kernel tests (tiny on CPU, real shapes on the GPU)."""

from __future__ import annotations

import math

import torch

from oscarkv.kernels.layout import PageFormat, QuantPages
from oscarkv.kernels.reference import quantize_write_ref

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "kernel output has NaN/Inf"
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def brute_threshold(s: torch.Tensor, k) -> torch.Tensor:
    """Bits (int32) of the smallest float a >= 0 with RN(RN(a/s) + 0.5) >= k, by a full bitwise search (float32
    arithmetic): the reference of the kernels' per-row code thresholds."""
    lo = torch.zeros_like(s, dtype=torch.int32)
    hi = torch.full_like(s, 0x7F800000, dtype=torch.int32)
    for _ in range(32):
        mid = lo + ((hi - lo) >> 1)
        ok = torch.floor(mid.view(torch.float32) / s + 0.5) >= k
        hi, lo = torch.where(ok, mid, hi), torch.where(ok, lo, mid)
    return hi


def poisoned_pages(fmt: PageFormat, num_pages: int, device) -> QuantPages:
    """A pool filled with random bytes (metadata included, so NaN and Inf too), so that unwritten, misaddressed
    or insufficiently masked slots show up in comparisons."""
    pages = QuantPages.allocate(fmt, num_pages, device)
    for t in (pages.codes, pages.scale, pages.offset):
        t.view(torch.uint8).random_(0, 256)
    return pages


# every per-layer storage format: (key bits, key layout, value bits)
FORMATS = [(kb, lay, vb) for lay in ("token", "channel") for kb in (2, 4) for vb in (2, 4)]


def fmt_id(f) -> str:
    return f"{f[1]}{f[0]}-token{f[2]}"


def build_cache(B, hkv, g, d, page_size, lens, lens16, c16, *, dtype16=torch.float16, device=DEVICE,
                k_clip=0.96, v_clip=0.92, extra_pages=3, key_layout="token", meta_dtype=torch.float16,
                k_bits=2, v_bits=2):
    """Random rotated-basis cache: quantized pages of ``lens[b]`` tokens (shuffled page ids, poisoned spare
    pages), 16-bit tiers of ``lens16[b]`` valid rows out of ``c16``. Returns the decode arguments after q.

    Keys in ``k_bits``-bit pages of ``key_layout``, values in ``v_bits``-bit token pages. ``key_layout="channel"``:
    keys written in whole pages (a last page past ``lens[b]`` holds random tokens beyond the sequence end, which
    attention must mask), no key clipping."""
    fmt = PageFormat(num_kv_heads=hkv, head_dim=d, page_size=page_size, meta_dtype=meta_dtype, bits=v_bits)
    kfmt = PageFormat(num_kv_heads=hkv, head_dim=d, page_size=page_size, layout=key_layout, meta_dtype=meta_dtype,
                      bits=k_bits)
    maxp = max(1, max(math.ceil(n / page_size) for n in lens))
    total = sum(math.ceil(n / page_size) for n in lens) + extra_pages
    kp, vp = poisoned_pages(kfmt, total, device), poisoned_pages(fmt, total, device)
    perm = torch.randperm(total, device=device)
    bt = torch.full((B, maxp), total - 1, dtype=torch.int32, device=device)
    at = 0
    for b, n in enumerate(lens):
        npg = math.ceil(n / page_size)
        bt[b, :npg] = perm[at:at + npg].int()
        at += npg
        if n:
            pos = torch.arange(n, device=device)
            slots = bt[b, pos // page_size].long() * page_size + pos % page_size
            scale_k = torch.rand(1, hkv, d, device=device) * 3
            if kfmt.channel:
                nk = npg * page_size
                pos = torch.arange(nk, device=device)
                kslots = bt[b, pos // page_size].long() * page_size + pos % page_size
                quantize_write_ref(kp, torch.randn(nk, hkv, d, device=device) * scale_k, kslots)
            else:
                quantize_write_ref(kp, torch.randn(n, hkv, d, device=device) * scale_k, slots, clip_ratio=k_clip)
            quantize_write_ref(vp, torch.randn(n, hkv, d, device=device), slots, clip_ratio=v_clip)
    k16 = torch.randn(B, hkv, c16, d, device=device).to(dtype16)
    v16 = torch.randn(B, hkv, c16, d, device=device).to(dtype16)
    return kp, vp, bt, _i32(device, lens), k16, v16, _i32(device, lens16)


def sharp_extend_case(device=DEVICE):
    """An extend case built to stress the online softmax: keys growing along the prefix (the running max moves by
    far more than the lazy threshold, page after page), V scales 100x larger after the first page (P s_v / v_ref
    far from 1), a sharp softmax (queries x3). Returns (q, k_new, v_new, cache args, float64 reference)."""
    from oscarkv.kernels.reference import extend_attention_ref

    hkv, g, d, ps, n, T = 1, 4, 64, 16, 90, 6
    fmt = PageFormat(num_kv_heads=hkv, head_dim=d, page_size=ps)
    kp, vp = poisoned_pages(fmt, 9, device), poisoned_pages(fmt, 9, device)
    npg = -(-n // ps)
    bt = torch.randperm(9, device=device)[:npg].int()[None]
    pos = torch.arange(n, device=device)
    slots = bt[0, pos // ps].long() * ps + pos % ps
    grow = torch.linspace(1.0, 6.0, n, device=device)[:, None, None]
    quantize_write_ref(kp, torch.randn(n, hkv, d, device=device) * grow, slots, clip_ratio=0.96)
    vscale = torch.where(pos >= ps, 100.0, 1.0)[:, None, None]
    quantize_write_ref(vp, torch.randn(n, hkv, d, device=device) * vscale, slots, clip_ratio=0.92)
    k16 = torch.randn(1, hkv, 4, d, device=device).half()
    v16 = torch.randn(1, hkv, 4, d, device=device).half()
    args = (kp, vp, bt, _i32(device, [n]), k16, v16, _i32(device, [3]))
    q = (torch.randn(1, T, hkv * g, d, device=device) * 3).half()
    kn = torch.randn(1, T, hkv, d, device=device).half()
    vn = torch.randn(1, T, hkv, d, device=device).half()
    return q, kn, vn, args, extend_attention_ref(q, kn, vn, *args, dtype=torch.float64)


def _i32(device, values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)
