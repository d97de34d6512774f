"""Ablation timings that say where a kernel's time goes (not a benchmark of record: see bench_kernels.py).

quantize: ``quantize_write`` at 32768 rows x 8 KV heads (K and V), bf16 input, clip 0.96/0.92, page 64, fp16
metadata (the issue's target shape), for the default and every equivalent formulation and launch knob of
``quantize_triton.py``; the difference between rows is what that stage costs. Every variant's pools are
compared byte for byte with the default's (``same_as_default``; the CPU reference check is
``pytest tests/kernels/test_kernels_quantize.py`` on the GPU). ``--baseline FILE`` also times an older copy of
``quantize_triton.py`` (e.g. ``git show 6e0588b:oscarkv/kernels/quantize_triton.py``) with its own variants.

    PYTHONPATH=. python3 benchmarks/kernels_probe.py --out probe.json [--baseline old_quantize_triton.py]

Bytes counted: bf16 input read + codes/scale/offset written, K and V, plus the int64 slots:
``2 * n * 8 * (256 + 32 + 4) + 8 n`` (153.4 MB at n = 32768; 32.6 us at 4.7 TB/s, 54 us at 60%).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench_kernels import D, HKV, PS, READ_CEILING_TBS, timeit  # noqa: E402

from oscarkv.kernels.layout import PageFormat, QuantPages  # noqa: E402

CLIP = (0.96, 0.92)
NOCLIP = (0.0, 0.0)
# (name, (k_clip, v_clip), variant): formulations first, then launch knobs on the default formulation
VARIANTS = [
    ("default (clip, code_div, extraction)", CLIP, ()),
    ("no clip", NOCLIP, ()),
    ("clip, code_thr8", CLIP, ("code_thr8",)),
    ("no clip, code_thr8", NOCLIP, ("code_thr8",)),
    ("clip, code_thr (old 7-probe thresholds)", CLIP, ("code_thr",)),
    ("no clip, code_thr", NOCLIP, ("code_thr",)),
    ("clip, code_floor", CLIP, ("code_floor",)),
    ("no clip, code_floor", NOCLIP, ("code_floor",)),
    ("clip_bisect (15-pass order statistic)", CLIP, ("clip_bisect",)),
    ("clip_bisect, code_thr (old formulations)", CLIP, ("clip_bisect", "code_thr")),
    ("clip_sort", CLIP, ("clip_sort",)),
    ("block_r=16", CLIP, ("block_r=16",)),
    ("block_r=64", CLIP, ("block_r=64",)),
    ("block_r=16, warps=2", CLIP, ("block_r=16", "warps=2")),
    ("warps=2", CLIP, ("warps=2",)),
    ("warps=8", CLIP, ("warps=8",)),
    ("block_r=64, warps=8", CLIP, ("block_r=64", "warps=8")),
    ("bpp=1", CLIP, ("bpp=1",)),
    ("bpp=2", CLIP, ("bpp=2",)),
    ("bpp=8", CLIP, ("bpp=8",)),
    ("bpp=16", CLIP, ("bpp=16",)),
    ("prefetch=1", CLIP, ("prefetch=1",)),
    ("prefetch=1, bpp=8", CLIP, ("prefetch=1", "bpp=8")),
    ("no clip, block_r=64", NOCLIP, ("block_r=64",)),
    ("no clip, bpp=1", NOCLIP, ("bpp=1",)),
    ("no clip, prefetch=1", NOCLIP, ("prefetch=1",)),
    ("code_thr8, block_r=64", CLIP, ("code_thr8", "block_r=64")),
    ("no clip, code_thr8, block_r=64", NOCLIP, ("code_thr8", "block_r=64")),
    ("code_thr8, bpp=8", CLIP, ("code_thr8", "bpp=8")),
]
BASELINE_VARIANTS = [("clip (default)", CLIP, ()), ("no clip", NOCLIP, ()), ("clip, code_div", CLIP, ("code_div",)),
                     ("no clip, code_div", NOCLIP, ("code_div",))]


def _load_baseline(path: str):
    """An older quantize_triton.py as module oscarkv.kernels._quantize_baseline (relative imports resolve)."""
    spec = importlib.util.spec_from_file_location("oscarkv.kernels._quantize_baseline", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def quantize_rows(n: int, only: str | None, baseline: str | None) -> list[dict]:
    from oscarkv.kernels.quantize_triton import quantize_write_triton

    fmt = PageFormat(num_kv_heads=HKV, head_dim=D, page_size=PS)
    npages = n // PS + 1
    k = torch.randn(n, HKV, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(n, HKV, D, device="cuda", dtype=torch.bfloat16)
    slots = torch.randperm(npages * PS, device="cuda")[:n]
    nbytes = 2 * n * HKV * (D * 2 + D // 4 + 4) + n * 8
    pools = lambda: (QuantPages.allocate(fmt, npages, "cuda"), QuantPages.allocate(fmt, npages, "cuda"))  # noqa
    ref = {}
    for clip in (CLIP, NOCLIP):
        ref[clip] = pools()
        quantize_write_triton(*ref[clip], k, v, slots, k_clip=clip[0], v_clip=clip[1])
    rows = []

    def record(name, fn, check=None):
        try:
            ms = timeit(fn)
            row = {"variant": name, "ms": ms, "TBps": nbytes / ms / 1e9,
                   "pct_of_4.7": 100 * nbytes / ms / 1e9 / READ_CEILING_TBS}
            if check is not None:
                row["same_as_default"] = check()
        except Exception as e:  # noqa: BLE001
            row = {"variant": name, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        rows.append(row)
        print("quantize", json.dumps(row), flush=True)

    def same(pp, clip):
        return all(torch.equal(getattr(a, t).view(torch.uint8), getattr(b, t).view(torch.uint8))
                   for a, b in zip(pp, ref[clip]) for t in ("codes", "scale", "offset"))

    for name, clip, variant in VARIANTS:
        if only and only not in name:
            continue
        kp, vp = pools()
        fn = lambda: quantize_write_triton(kp, vp, k, v, slots, k_clip=clip[0], v_clip=clip[1],  # noqa: E731
                                           variant=variant)
        record(name, fn, lambda: same((kp, vp), clip))  # noqa: B023
    if not only or "demote" in only:  # gather mode: the same rows from a [4, Hkv, n/4, d] 16-bit tier
        from oscarkv.kernels.quantize_triton import demote_triton

        k16, v16 = k.view(4, n // 4, HKV, D).transpose(1, 2), v.view(4, n // 4, HKV, D).transpose(1, 2)
        seq = torch.arange(n, device="cuda", dtype=torch.int32) // (n // 4)
        src = torch.arange(n, device="cuda", dtype=torch.int32) % (n // 4)
        kp, vp = pools()
        record("demote (gather), clip", lambda: demote_triton(kp, vp, k16, v16, seq, src, slots, k_clip=CLIP[0],
                                                              v_clip=CLIP[1]), lambda: same((kp, vp), CLIP))
    if not only or "rotation" in only:  # float32 rows (rotated in torch first): tie-counting extraction
        r = torch.linalg.qr(torch.randn(HKV, D, D, device="cuda"))[0]
        kp, vp = pools()
        record("rotation + mean (torch float32 rows), clip", lambda: quantize_write_triton(
            kp, vp, k, v, slots, k_rotation=r, v_rotation=r, k_mean=r[:, 0], v_mean=r[:, 1], k_clip=CLIP[0],
            v_clip=CLIP[1]))
    if baseline:
        old = _load_baseline(baseline)
        for name, clip, variant in BASELINE_VARIANTS:
            kp, vp = pools()
            fn = lambda: old.quantize_write_triton(kp, vp, k, v, slots, k_clip=clip[0], v_clip=clip[1],  # noqa
                                                   variant=variant)
            record(f"baseline: {name}", fn, lambda: same((kp, vp), clip))  # noqa: B023
    kp, vp = pools()
    ms = timeit(lambda: kp.codes.copy_(vp.codes))
    rows.append({"variant": "codes copy (reference)", "ms": ms, "TBps": 2 * kp.codes.numel() / ms / 1e9})
    print("quantize", json.dumps(rows[-1]), flush=True)
    k2 = torch.empty_like(k)
    ms = timeit(lambda: k2.copy_(k))
    rows.append({"variant": "bf16 K copy, read+write (bandwidth reference)", "ms": ms,
                 "TBps": 2 * k.numel() * 2 / ms / 1e9})
    print("quantize", json.dumps(rows[-1]), flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=32768)
    ap.add_argument("--out", default="probe.json")
    ap.add_argument("--only", default=None, help="time only variants whose name contains this string")
    ap.add_argument("--baseline", default=None, help="an older quantize_triton.py to time next to this one")
    args = ap.parse_args()
    if args.baseline and not os.path.getsize(args.baseline):
        print(f"baseline {args.baseline} is empty: skipped", flush=True)
        args.baseline = None
    res = {"gpu": torch.cuda.get_device_name(), "quantize": quantize_rows(args.rows, args.only, args.baseline)}
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
