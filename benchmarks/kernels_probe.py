"""Ablation timings that say where a kernel's time goes (not a benchmark of record: see bench_kernels.py).

quantize: ``quantize_write`` at 32768 rows x 8 KV heads (K and V), bf16 input, clip 0.96/0.92, page 64, fp16
metadata (the issue's target shape), for the default and equivalent formulations and launch knobs of
``quantize_triton.py`` (``--set fast``: the default against the "fast16" kernel's variants; ``--set all``: every
older formulation and knob of the row kernel too); the difference between rows is what that stage costs. Every
variant's pools are compared byte for byte with the default's (``same_as_default``); ``--ref`` also checks the
default's against the CPU reference (``exact_vs_ref``; the full check is the GPU tests). ``--warm N`` compiles
every variant first in N processes (the Triton cache is shared), ``--warm-only`` stops there. ``--baseline
FILE`` also times an older copy of ``quantize_triton.py`` (e.g. ``git show 6e0588b:oscarkv/kernels/
quantize_triton.py``) with its own variants.

    PYTHONPATH=. python3 benchmarks/kernels_probe.py --out probe.json [--set all] [--ref] [--warm 12]

Bytes counted: bf16 input read + codes/scale/offset written, K and V, plus the int64 slots:
``2 * n * 8 * (256 + 32 + 4) + 8 n`` (153.4 MB at n = 32768; 32.6 us at 4.7 TB/s, 54 us at 60%).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time

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
# the default against the fast16 kernel (16-bit rows as words; see quantize_triton.py), its formulations and
# launch knobs; "rows" = the general row kernel (the default), "f16" = fast16
FAST = ("fast16", "code_thr64")
FAST2 = FAST + ("split=2",)
VARIANTS_FAST = [
    ("default (rows, code_thr8)", CLIP, ()),
    ("default, no clip", NOCLIP, ()),
    ("rows, code_thr64", CLIP, ("code_thr64",)),
    ("f16 code_thr8", CLIP, ("fast16",)),
    ("f16 code_thr64", CLIP, FAST),
    ("f16 code_thr64, no clip", NOCLIP, FAST),
    ("f16 code_thr64, bpp=1", CLIP, FAST + ("bpp=1",)),
    ("f16 code_thr64, bpp=2", CLIP, FAST + ("bpp=2",)),
    ("f16 code_thr64, bpp=8", CLIP, FAST + ("bpp=8",)),
    ("f16 code_thr64, block_r=64", CLIP, FAST + ("block_r=64",)),
    ("f16 code_thr64, prefetch=1", CLIP, FAST + ("prefetch=1",)),
    ("f16 split=2 code_thr64", CLIP, FAST2),
    ("f16 split=2 code_thr64, no clip", NOCLIP, FAST2),
    ("f16 split=2 code_thr64, bpp=1", CLIP, FAST2 + ("bpp=1",)),
    ("f16 split=2 code_thr64, bpp=2", CLIP, FAST2 + ("bpp=2",)),
    ("f16 split=2 code_thr64, bpp=8", CLIP, FAST2 + ("bpp=8",)),
    ("f16 split=2 code_thr64, hred=1", CLIP, FAST2 + ("hred=1",)),
    ("f16 split=2 code_thr64, warps=8", CLIP, FAST2 + ("warps=8",)),
    ("f16 split=2 code_thr64, prefetch=1", CLIP, FAST2 + ("prefetch=1",)),
    ("f16 split=2 code_thr64, prefetch=1, bpp=8", CLIP, FAST2 + ("prefetch=1", "bpp=8")),
    ("f16 split=2 code_thr64, warps=2", CLIP, FAST2 + ("warps=2",)),
    ("f16 code_thr64, warps=8", CLIP, FAST + ("warps=8",)),
] + [  # the windowed clip (16-bit keys, two per word) against the session-14 default (win=0); --only win
    ("win=0 (session-14 default), clip", CLIP, ("win=0",)),
    ("win=0, no clip", NOCLIP, ("win=0",)),
    ("win=1, clip", CLIP, ("win=1",)),
    ("win=1, warps=1", CLIP, ("win=1", "warps=1")),
    ("win=1, warps=2", CLIP, ("win=1", "warps=2")),
    ("win=1, warps=8", CLIP, ("win=1", "warps=8")),
    ("win=1, split=1", CLIP, ("win=1", "split=1")),
    ("win=1, regs=80", CLIP, ("win=1", "regs=80")),
    ("win=1, regs=128", CLIP, ("win=1", "regs=128")),
    ("win=1, hred=1", CLIP, ("win=1", "hred=1")),
    ("win=1, bpp=2", CLIP, ("win=1", "bpp=2")),
    ("win=1, fp16 rows (int32 keys)", CLIP, ("win=1", "fp16")),
    ("win=2, fp16 rows (windows)", CLIP, ("win=2", "fp16")),
] + [  # session 15's default (win=1, one warp where a side takes the window) and knobs on top; --only w1x
    ("w1x library default, clip", CLIP, ()),
    ("w1x library default, no clip", NOCLIP, ()),
    ("w1x bpp=2", CLIP, ("warps=1", "bpp=2")),
    ("w1x bpp=4", CLIP, ("warps=1", "bpp=4")),
    ("w1x hred=1", CLIP, ("warps=1", "hred=1")),
    ("w1x regs=80", CLIP, ("warps=1", "regs=80")),
    ("w1x regs=64", CLIP, ("warps=1", "regs=64")),
    ("w1x split=1", CLIP, ("warps=1", "split=1")),
    ("w1x prefetch=1", CLIP, ("warps=1", "prefetch=1")),
    ("w1x prefetch=1, bpp=4", CLIP, ("warps=1", "prefetch=1", "bpp=4")),
] + [  # session 16 (not yet measured): the no-clip fast16 path at fewer warps (it keeps 4; clipped rows run 1)
    ("w1x no clip, warps0=1", NOCLIP, ("warps0=1",)),
    ("w1x no clip, warps0=2", NOCLIP, ("warps0=2",)),
]
DEMOTE_VARIANTS = [("demote (gather), clip, default", ()), ("demote (gather), clip, f16 code_thr64", FAST),
                   ("demote (gather), clip, f16 split=2 code_thr64", FAST2),
                   ("demote (gather), clip, win=0", ("win=0",))]
BASELINE_VARIANTS = [("clip (default)", CLIP, ()), ("no clip", NOCLIP, ()), ("clip, code_div", CLIP, ("code_div",)),
                     ("no clip, code_div", NOCLIP, ("code_div",))]


def _load_baseline(path: str):
    """An older quantize_triton.py as module oscarkv.kernels._quantize_baseline (relative imports resolve)."""
    spec = importlib.util.spec_from_file_location("oscarkv.kernels._quantize_baseline", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _inputs(n: int):
    fmt = PageFormat(num_kv_heads=HKV, head_dim=D, page_size=PS)
    npages = n // PS + 1
    g = torch.Generator(device="cuda").manual_seed(0)
    k = torch.randn(n, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(n, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    slots = torch.randperm(npages * PS, device="cuda", generator=g)[:n]
    return fmt, npages, k, v, slots


def _demote_inputs(k, v, n):
    k16, v16 = k.view(4, n // 4, HKV, D).transpose(1, 2), v.view(4, n // 4, HKV, D).transpose(1, 2)
    seq = torch.arange(n, device="cuda", dtype=torch.int32) // (n // 4)
    src = torch.arange(n, device="cuda", dtype=torch.int32) % (n // 4)
    return k16, v16, seq, src


def _rows_for(variant, k, v):
    """The probe's own pseudo-variant "fp16": the same rows in float16 (not comparable with the default's
    pools); the rest goes to the launcher."""
    if "fp16" in variant:
        return tuple(x for x in variant if x != "fp16"), k.half(), v.half(), False
    return variant, k, v, True


def _warm_one(task) -> str:
    """Compile one variant (same shapes and strides as the timed run, few rows: one Triton specialization)."""
    name, clip, variant, demote = task
    try:
        from oscarkv.kernels.quantize_triton import demote_triton, quantize_write_triton

        n = 256
        fmt, npages, k, v, slots = _inputs(n)
        kp, vp = QuantPages.allocate(fmt, npages, "cuda"), QuantPages.allocate(fmt, npages, "cuda")
        if demote:
            k16, v16, seq, src = _demote_inputs(k, v, n)
            demote_triton(kp, vp, k16, v16, seq, src, slots, k_clip=clip[0], v_clip=clip[1], variant=variant)
        else:
            variant, k, v, _ = _rows_for(variant, k, v)
            quantize_write_triton(kp, vp, k, v, slots, k_clip=clip[0], v_clip=clip[1], variant=variant)
        torch.cuda.synchronize()
        return f"warm {name}: ok"
    except Exception as e:  # noqa: BLE001
        return f"warm {name}: {type(e).__name__}: {str(e)[:200]}"


def warm(nproc: int, which: str, only: str | None) -> None:
    import multiprocessing as mp

    seen, tasks = set(), []
    for name, clip, variant in (VARIANTS_FAST if which == "fast" else VARIANTS):
        key = tuple(v for v in variant if not v.startswith("bpp="))  # bpp changes the grid, not the kernel
        if (only and only not in name) or key in seen:
            continue
        seen.add(key)
        tasks.append((name, clip, variant, False))
    for name, variant in (DEMOTE_VARIANTS if which == "fast" else DEMOTE_VARIANTS[:1]):
        tasks.append((name, CLIP, variant, True))
    t0 = time.time()
    with mp.get_context("spawn").Pool(min(nproc, len(tasks))) as pool:
        for line in pool.imap_unordered(_warm_one, tasks):
            print(line, flush=True)
    print(f"warm: {len(tasks)} kernels in {time.time() - t0:.1f} s", flush=True)


def quantize_rows(n: int, only: str | None, baseline: str | None, which: str = "fast", check_ref: bool = False,
                  out: str | None = None) -> list[dict]:
    """Time the variants; each row is printed (a table line) and ``out`` rewritten as it comes, so that a run
    cut short keeps what it measured."""
    from oscarkv.kernels.quantize_triton import quantize_write_triton

    fmt, npages, k, v, slots = _inputs(n)
    nbytes = 2 * n * HKV * (D * 2 + D // 4 + 4) + n * 8
    pools = lambda: (QuantPages.allocate(fmt, npages, "cuda"), QuantPages.allocate(fmt, npages, "cuda"))  # noqa
    ref = {}
    for clip in (CLIP, NOCLIP):
        ref[clip] = pools()
        quantize_write_triton(*ref[clip], k, v, slots, k_clip=clip[0], v_clip=clip[1])
    rows = []

    def emit(row):
        rows.append(row)
        print(table([row], header=False), flush=True)
        if out:
            with open(out, "w") as f:
                json.dump({"gpu": torch.cuda.get_device_name(), "triton": __import__("triton").__version__,
                           "torch": torch.__version__, "quantize": rows}, f, indent=1)

    print(table([]), flush=True)

    def record(name, fn, check=None):
        try:
            ms = timeit(fn)
            row = {"variant": name, "ms": ms, "TBps": nbytes / ms / 1e9,
                   "pct_of_4.7": 100 * nbytes / ms / 1e9 / READ_CEILING_TBS}
            if check is not None:
                row["same_as_default"] = check()
        except Exception as e:  # noqa: BLE001
            row = {"variant": name, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        emit(row)

    def same(pp, clip):
        return all(torch.equal(getattr(a, t).view(torch.uint8), getattr(b, t).view(torch.uint8))
                   for a, b in zip(pp, ref[clip]) for t in ("codes", "scale", "offset"))

    if check_ref:  # the default's pools against the CPU reference (slots written; unwritten ones are zeros in both)
        from oscarkv.kernels.reference import quantize_write_ref

        for clip in (CLIP, NOCLIP):
            rp = (QuantPages.allocate(fmt, npages, "cpu"), QuantPages.allocate(fmt, npages, "cpu"))
            quantize_write_ref(rp[0], k.cpu(), slots.cpu(), clip_ratio=clip[0])
            quantize_write_ref(rp[1], v.cpu(), slots.cpu(), clip_ratio=clip[1])
            ok = all(torch.equal(getattr(a, t).cpu().view(torch.uint8), getattr(b, t).view(torch.uint8))
                     for a, b in zip(ref[clip], rp) for t in ("codes", "scale", "offset"))
            emit({"variant": f"default vs CPU reference, clip {clip}", "exact_vs_ref": ok})

    for name, clip, variant in (VARIANTS_FAST if which == "fast" else VARIANTS):
        if only and only not in name:
            continue
        kp, vp = pools()
        form, kx, vx, comparable = _rows_for(variant, k, v)
        fn = lambda: quantize_write_triton(kp, vp, kx, vx, slots, k_clip=clip[0], v_clip=clip[1],  # noqa: E731
                                           variant=form)
        record(name, fn, (lambda: same((kp, vp), clip)) if comparable else None)  # noqa: B023
    if not only or "demote" in only:  # gather mode: the same rows from a [4, Hkv, n/4, d] 16-bit tier
        from oscarkv.kernels.quantize_triton import demote_triton

        k16, v16, seq, src = _demote_inputs(k, v, n)
        for name, variant in (DEMOTE_VARIANTS if which == "fast" else DEMOTE_VARIANTS[:1]):
            kp, vp = pools()
            record(name, lambda: demote_triton(kp, vp, k16, v16, seq, src, slots, k_clip=CLIP[0],  # noqa: B023
                                               v_clip=CLIP[1], variant=variant),  # noqa: B023
                   lambda: same((kp, vp), CLIP))  # noqa: B023
    if which == "all" and (not only or "rotation" in only):  # float32 rows (rotated in torch first): tie counts
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
    emit({"variant": "codes copy (reference)", "ms": ms, "TBps": 2 * kp.codes.numel() / ms / 1e9})
    k2 = torch.empty_like(k)
    ms = timeit(lambda: k2.copy_(k))
    emit({"variant": "bf16 K copy, read+write (bandwidth reference)", "ms": ms,
          "TBps": 2 * k.numel() * 2 / ms / 1e9})
    return rows


def table(rows: list[dict], header: bool = True) -> str:
    """The timed rows as a fixed-width table (ms, TB/s, % of 4.7 TB/s, same bytes as the default)."""
    out = [f"{'variant':<48} {'ms':>8} {'TB/s':>6} {'% 4.7':>6}  same_as_default", "-" * 86] if header else []
    for r in rows:
        if "ms" in r:
            pct = 100 * r["TBps"] / READ_CEILING_TBS
            out.append(f"{r['variant']:<48} {r['ms']:8.4f} {r['TBps']:6.2f} {pct:5.0f}%  "
                       f"{r.get('same_as_default', '')}")
        elif "exact_vs_ref" in r:
            out.append(f"{r['variant']:<48} exact_vs_ref={r['exact_vs_ref']}")
        else:
            out.append(f"{r['variant']:<48} {r.get('error', '')[:120]}")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=32768)
    ap.add_argument("--out", default="probe.json")
    ap.add_argument("--only", default=None, help="time only variants whose name contains this string")
    ap.add_argument("--baseline", default=None, help="an older quantize_triton.py to time next to this one")
    ap.add_argument("--set", dest="which", choices=("fast", "all"), default="fast")
    ap.add_argument("--ref", action="store_true", help="check the default's pools against the CPU reference")
    ap.add_argument("--warm", type=int, default=0, help="compile the variants first in this many processes")
    ap.add_argument("--warm-only", action="store_true")
    args = ap.parse_args()
    if args.warm:
        warm(args.warm, args.which, args.only)
        if args.warm_only:
            return 0
    if args.baseline and not os.path.getsize(args.baseline):
        print(f"baseline {args.baseline} is empty: skipped", flush=True)
        args.baseline = None
    rows = quantize_rows(args.rows, args.only, args.baseline, args.which, args.ref, args.out)
    print("\n" + table(rows), flush=True)
    res = {"gpu": torch.cuda.get_device_name(), "triton": __import__("triton").__version__,
           "torch": torch.__version__, "quantize": rows}
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
