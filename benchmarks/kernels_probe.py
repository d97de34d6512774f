"""Ablation timings that say where a kernel's time goes (not a benchmark of record: see bench_kernels.py).

quantize: ``quantize_write`` at 32768 rows x 8 KV heads (K and V), bf16 input, with the default exact clip,
without clip (``k_clip = v_clip = 0``: no order statistic), and with each formulation variant; the difference
between rows is what that stage costs.

    PYTHONPATH=. python3 benchmarks/kernels_probe.py --out probe.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench_kernels import D, HKV, PS, timeit  # noqa: E402

from oscarkv.kernels.layout import PageFormat, QuantPages  # noqa: E402


def quantize_rows(n: int) -> list[dict]:
    from oscarkv.kernels.quantize_triton import quantize_write_triton

    fmt = PageFormat(num_kv_heads=HKV, head_dim=D, page_size=PS)
    kp, vp = QuantPages.allocate(fmt, n // PS + 1, "cuda"), QuantPages.allocate(fmt, n // PS + 1, "cuda")
    k = torch.randn(n, HKV, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(n, HKV, D, device="cuda", dtype=torch.bfloat16)
    slots = torch.randperm((n // PS + 1) * PS, device="cuda")[:n]
    nbytes = 2 * n * HKV * (D * 2 + D // 4 + 4) + n * 8
    rows = []
    for name, clip, variant in (("clip (default)", (0.96, 0.92), ()), ("no clip", (0.0, 0.0), ()),
                                ("clip, code_div", (0.96, 0.92), ("code_div",)),
                                ("no clip, code_div", (0.0, 0.0), ("code_div",)),
                                ("clip_sort", (0.96, 0.92), ("clip_sort",))):
        fn = lambda: quantize_write_triton(kp, vp, k, v, slots, k_clip=clip[0], v_clip=clip[1],  # noqa: E731
                                           variant=variant)
        try:
            ms = timeit(fn)
            rows.append({"variant": name, "ms": ms, "TBps": nbytes / ms / 1e9})
        except Exception as e:  # noqa: BLE001
            rows.append({"variant": name, "error": f"{type(e).__name__}: {str(e)[:200]}"})
        print("quantize", rows[-1], flush=True)
    copy = lambda: kp.codes.copy_(vp.codes)  # noqa: E731
    ms = timeit(copy)
    rows.append({"variant": "codes copy (reference)", "ms": ms, "TBps": 2 * kp.codes.numel() / ms / 1e9})
    print("quantize", rows[-1], flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=32768)
    ap.add_argument("--out", default="probe.json")
    args = ap.parse_args()
    res = {"quantize": quantize_rows(args.rows)}
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
