"""Kernel benchmarks on a CUDA GPU, one row per storage format: decode attention (the dispatcher's kernel: CUDA
C++) against BF16 decode with torch SDPA (cuDNN backend) in the same process, prefill over a quantized prefix,
and quantize/pack/write. Qwen3-8B attention shapes (32 query / 8 KV heads, d = 128), page 64, a 320-token 16-bit
tier (sink 64 + window 256).

Formats: keys token/channel x 2/4 bits, values 2/4 bits ("channel4/token2": 4-bit keys in channel pages, 2-bit
values). Before timing, every decode row is checked against the PyTorch reference (float64, first sequences of
the batch); a row over the budget is reported, not dropped. Every timed call runs from a captured CUDA graph with
the L2 flushed (a 256 MiB write) before each replay; the median of the replays is reported. Bytes read count what
the kernel must read once: codes, scales and offsets of the quantized tier (channel-page metadata per page), the
16-bit tiers, block table and queries, plus its output.

    python benchmarks/bench_kernels.py --out docs/results/kernels_formats.json --git-sha $(git rev-parse HEAD)

``--before DIR``: also time the 2-bit token format with an earlier checkout's kernels, loaded from ``DIR`` (a
copy of its ``oscarkv`` package directory named ``oscarkv_before``), interleaved with this checkout's.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import math
import sys
import time
from pathlib import Path

import torch

from oscarkv.bench.harness import Timer, provenance
from oscarkv.kernels import dispatch
from oscarkv.kernels.layout import PageFormat, QuantPages
from oscarkv.kernels.plan import DecodePlan
from oscarkv.kernels.reference import decode_attention_ref

HQ, HKV, D, PS, W16 = 32, 8, 128, 64, 320
FORMATS = {f"{lay}{kb}/token{vb}": (kb, lay, vb) for lay in ("token", "channel") for kb in (2, 4) for vb in (2, 4)}
DECODE_BUDGET = 6e-3  # bfloat16 output (tests/kernels/test_kernels_decode.py)


_TIMER = None


def timeit(fn, reps: int = 30, graph: bool = True) -> float:
    """Median milliseconds of ``fn`` (replayed from a CUDA graph) with a cold L2 before each replay."""
    global _TIMER
    if _TIMER is None:
        _TIMER = Timer("cuda")
    return _TIMER(fn, reps=reps, graph=graph).median_ms


def formats(name: str) -> tuple[PageFormat, PageFormat]:
    kb, lay, vb = FORMATS[name]
    return PageFormat(HKV, D, PS, bits=kb, layout=lay), PageFormat(HKV, D, PS, bits=vb)


def make_cache(name: str, batch: int, ctx: int, seed: int = 0):
    """Random pages (codes, scales, offsets) + 16-bit tiers for ``batch`` sequences of ``ctx`` tokens
    (``ctx - 320`` quantized), shuffled page ids."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    n2 = max(0, ctx - W16)
    npg = math.ceil(n2 / PS)
    kf, vf = formats(name)
    kp, vp = QuantPages.allocate(kf, batch * npg, "cuda"), QuantPages.allocate(vf, batch * npg, "cuda")
    for t in (kp, vp):
        t.codes.random_(0, 256, generator=g)
        t.scale.copy_(torch.rand(t.scale.shape, device="cuda", generator=g) * 0.1 + 0.01)
        t.offset.copy_(torch.randn(t.offset.shape, device="cuda", generator=g) * 0.1)
    bt = torch.randperm(batch * npg, device="cuda", generator=g).int().view(batch, npg)
    qlen = torch.full((batch,), n2, dtype=torch.int32, device="cuda")
    k16 = torch.randn(batch, HKV, W16, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v16 = torch.randn(batch, HKV, W16, D, device="cuda", dtype=torch.bfloat16, generator=g)
    len16 = torch.full((batch,), min(ctx, W16), dtype=torch.int32, device="cuda")
    q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
    return q, kp, vp, bt, qlen, k16, v16, len16, n2


def decode_bytes(name: str, batch: int, n2: int, n16: int) -> int:
    """Bytes a decode step must read (and write): the quantized tier at each pool's physical bytes per token
    (channel-page metadata amortised over its page), the 16-bit tiers, block table, queries and output."""
    kf, vf = formats(name)
    npg = math.ceil(n2 / PS)
    quant = npg * PS * (kf.bytes_per_token + vf.bytes_per_token)
    return int(batch * (quant + n16 * 2 * HKV * D * 2 + 4 * npg + 2 * 2 * HQ * D))


def bench_sdpa_decode(batch: int, ctx: int) -> tuple[float, str]:
    """BF16 decode with SDPA over ``ctx`` keys: one query token per sequence, GQA through ``enable_gqa``. cuDNN
    backend first; returns (ms, backend used)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    k = torch.randn(batch, HKV, ctx, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(batch, HQ, 1, D, device="cuda", dtype=torch.bfloat16)
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        def fn(backend=backend):
            with sdpa_kernel([backend]):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        try:
            return timeit(fn), name
        except RuntimeError:
            continue
    raise RuntimeError("no SDPA backend ran")


def check_decode(out, q, kp, vp, bt, qlen, k16, v16, len16, nseq: int = 2) -> float:
    """Relative error of ``out`` against the float64 reference on the first ``nseq`` sequences."""
    n = min(nseq, q.shape[0])
    ref = decode_attention_ref(q[:n], kp, vp, bt[:n], qlen[:n], k16[:n], v16[:n], len16[:n], dtype=torch.float64)
    return ((out[:n].double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def bench_decode_row(name: str, batch: int, ctx: int, before=None) -> dict:
    q, kp, vp, bt, qlen, k16, v16, len16, n2 = make_cache(name, batch, ctx)
    nbytes = decode_bytes(name, batch, n2, min(ctx, W16))
    row = {"format": name, "batch": batch, "context": ctx, "tokens_quantized": n2, "bytes": nbytes}
    out = torch.empty(batch, HQ, D, device="cuda", dtype=torch.bfloat16)
    plan = DecodePlan(batch, HQ, HKV, D, PS, bt.shape[1], W16, device="cuda").update(batch)
    impls = {"ours": lambda: dispatch.decode_attention(q, kp, vp, bt, qlen, k16, v16, len16, plan=plan, out=out)}
    if before is not None:
        dc_b, plan_cls = before
        plan_b = plan_cls(batch, HQ, HKV, D, PS, bt.shape[1], W16, device="cuda").update(batch)
        out_b = torch.empty_like(out)
        impls["before"] = lambda: dc_b.decode_attention_cuda(q, kp, vp, bt, qlen, k16, v16, len16, plan=plan_b,
                                                             out=out_b)
    try:
        impls["ours"]()
        row["kernel"] = "cuda" if dispatch._cuda_decode_why_not(q, kp, vp, k16) is None else "triton"
        row["rel_err"] = check_decode(out, q, kp, vp, bt, qlen, k16, v16, len16)
        row["check"] = "ok" if row["rel_err"] < DECODE_BUDGET else "FAIL"
        if before is not None:
            impls["before"]()
            row["before_rel_err"] = check_decode(out_b, q, kp, vp, bt, qlen, k16, v16, len16)
        # every row takes the better of two medians, so that rows with and without a before/after pair are timed
        # alike (a single first median runs a few % slow at the smallest shapes while clocks settle)
        order = ["ours", "before", "ours", "before"] if before is not None else ["ours", "ours"]
        times: dict[str, list[float]] = {}
        for impl in order:
            times.setdefault(impl, []).append(timeit(impls[impl]))
        for impl, ts in times.items():
            ms = min(ts)  # the better of the interleaved medians (drift between them is reported)
            row[f"{impl}_ms"] = ms
            row[f"{impl}_GBps"] = nbytes / ms / 1e6
            row[f"{impl}_ms_runs"] = ts
        row["splits"] = plan.num_splits
    except Exception as e:  # noqa: BLE001 - report and keep going: one failing format must not hide the others
        row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
    return row


def bench_extend_row(name: str, prefix: int, chunk: int) -> dict:
    """Prefill of ``chunk`` tokens over a ``prefix``-token cache (one sequence): the default path (the cuDNN fold,
    host lengths given so that it is the one captured) and the fused kernel; BF16 cuDNN over the same keys."""
    from oscarkv.kernels.extend_triton import extend_attention_triton

    _, kp, vp, bt, qlen, k16, v16, len16, _ = make_cache(name, 1, prefix)
    q = torch.randn(1, chunk, HQ, D, device="cuda", dtype=torch.bfloat16)
    kn = torch.randn(1, chunk, HKV, D, device="cuda", dtype=torch.bfloat16)
    vn = torch.randn_like(kn)
    hl = (qlen.tolist(), len16.tolist())
    res = {"format": name, "prefix": prefix, "chunk": chunk}
    for impl, kw in (("default", {"host_lengths": hl}), ("fused", {"fold": "fused"})):
        def fn(kw=kw):
            return extend_attention_triton(q, kn, vn, kp, vp, bt, qlen, k16, v16, len16, **kw)

        try:
            res[f"{impl}_ms"] = timeit(fn, reps=10)
        except Exception as e:  # noqa: BLE001 - report and keep going
            res[f"{impl}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    torch.cuda.empty_cache()
    return res


def bench_sdpa_extend(prefix: int, chunk: int) -> float:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    k = torch.randn(1, HKV, prefix + chunk, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(1, HQ, chunk, D, device="cuda", dtype=torch.bfloat16)

    def fn():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    return timeit(fn, reps=10)


def bench_quantize_row(name: str, n: int) -> dict:
    """Quantize/write of ``n`` bfloat16 K and V rows into shuffled whole pages (the default clips; none for
    channel-page keys)."""
    kf, vf = formats(name)
    kp, vp = QuantPages.allocate(kf, n // PS, "cuda"), QuantPages.allocate(vf, n // PS, "cuda")
    k = torch.randn(n, HKV, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    slots = (torch.randperm(n // PS, device="cuda")[:, None] * PS + torch.arange(PS, device="cuda")).view(-1)
    kc = 0.0 if kf.channel else 0.96
    def fn():
        return dispatch.quantize_write(kp, vp, k, v, slots, k_clip=kc, v_clip=0.92, check_pages=False)

    ms = timeit(fn)
    nbytes = 2 * n * HKV * D * 2 + n * (kf.bytes_per_token + vf.bytes_per_token) + 8 * n
    return {"format": name, "rows": n, "ms": ms, "bytes": int(nbytes), "GBps": nbytes / ms / 1e6}


def load_before(path: str):
    """(decode_cuda module, DecodePlan class) of the kernels in ``path/oscarkv_before`` (imported as the package
    ``oscarkv_before``, beside this checkout's ``oscarkv``)."""
    root = Path(path) / "oscarkv_before"
    spec = importlib.util.spec_from_file_location("oscarkv_before", root / "__init__.py",
                                                  submodule_search_locations=[str(root)])
    pkg = importlib.util.module_from_spec(spec)
    sys.modules["oscarkv_before"] = pkg
    spec.loader.exec_module(pkg)
    dc = importlib.import_module("oscarkv_before.kernels.decode_cuda")
    plan = importlib.import_module("oscarkv_before.kernels.plan").DecodePlan
    return dc, plan


def prebuild_all(names: list[str], before) -> None:
    """Build every cubin the rows will load, in parallel, before anything is timed."""
    from oscarkv.kernels import decode_cuda

    for name in names:
        kf, vf = formats(name)
        decode_cuda.prebuild(kf, HQ, torch.bfloat16, torch.bfloat16, 64, v_fmt=vf)
    if before is not None:
        before[0].prebuild(formats("token2/token2")[0], HQ, torch.bfloat16, torch.bfloat16, 64)


def summary(rows: list[dict]) -> list[dict]:
    """Per (context, batch): each format's time per byte read against the 2-bit token format's (the target:
    within 1.1x), and the speed-up over BF16 cuDNN."""
    out = []
    base = {(r["context"], r["batch"]): r for r in rows if r["format"] == "token2/token2" and "ours_ms" in r}
    for r in rows:
        b = base.get((r["context"], r["batch"]))
        if "ours_ms" not in r or b is None:
            continue
        per_byte = (r["ours_ms"] / r["bytes"]) / (b["ours_ms"] / b["bytes"])
        s = {"format": r["format"], "context": r["context"], "batch": r["batch"], "ms": r["ours_ms"],
             "GBps": r["ours_GBps"], "time_per_byte_vs_token2": per_byte, "check": r.get("check")}
        if r.get("sdpa_bf16_ms"):
            s["speedup_vs_cudnn"] = r["sdpa_bf16_ms"] / r["ours_ms"]
        if "before_ms" in r:
            s["before_ms"] = r["before_ms"]
            s["after_over_before"] = r["ours_ms"] / r["before_ms"]
        out.append(s)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--formats", default=",".join(FORMATS), help=f"comma-separated, of {list(FORMATS)}")
    ap.add_argument("--contexts", default="32768,131072")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--skip", default="", help="comma-separated sections to skip: decode, extend, quantize")
    ap.add_argument("--before", default=None, help="a directory holding an earlier checkout as oscarkv_before")
    ap.add_argument("--out", default=None)
    ap.add_argument("--git-sha", default=None, help="commit of the code run (default: this checkout's HEAD)")
    args = ap.parse_args()
    names = args.formats.split(",")
    bad = [n for n in names if n not in FORMATS]
    if bad:
        raise SystemExit(f"unknown formats {bad}: choose from {list(FORMATS)}")
    skip = set(filter(None, args.skip.split(",")))
    before = load_before(args.before) if args.before else None
    res = {"provenance": provenance(args.git_sha), "shapes": {"hq": HQ, "hkv": HKV, "d": D, "page": PS, "w16": W16},
           "decode": [], "extend": [], "quantize": []}
    t0 = time.time()
    prebuild_all(names, before)
    res["prebuild_s"] = time.time() - t0
    if "decode" not in skip:
        for ctx in map(int, args.contexts.split(",")):
            for batch in map(int, args.batches.split(",")):
                sdpa_ms, backend = bench_sdpa_decode(batch, ctx)
                torch.cuda.empty_cache()
                for name in names:
                    row = bench_decode_row(name, batch, ctx, before if name == "token2/token2" else None)
                    torch.cuda.empty_cache()
                    row["sdpa_bf16_ms"], row["sdpa_backend"] = sdpa_ms, backend
                    res["decode"].append(row)
                    print(json.dumps({k: v for k, v in row.items() if not k.endswith("_runs")}), flush=True)
        res["decode_summary"] = summary(res["decode"])
    if "extend" not in skip:
        res["extend_sdpa_bf16_ms"] = bench_sdpa_extend(32768, 2048)
        for name in names:
            res["extend"].append(bench_extend_row(name, 32768, 2048))
            print(json.dumps(res["extend"][-1]), flush=True)
    if "quantize" not in skip:
        for name in names:
            res["quantize"].append(bench_quantize_row(name, 32768))
            print(json.dumps(res["quantize"][-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    print(f"{'format':16s} {'ctx':>7s} {'B':>3s} {'ms':>8s} {'GB/s':>7s} {'t/B vs t2':>9s} {'x cuDNN':>8s} "
          f"{'after/before':>12s} check")
    for s in res.get("decode_summary", []):
        print(f"{s['format']:16s} {s['context']:7d} {s['batch']:3d} {s['ms']:8.4f} {s['GBps']:7.0f} "
              f"{s['time_per_byte_vs_token2']:9.3f} {s.get('speedup_vs_cudnn', float('nan')):8.2f} "
              f"{s.get('after_over_before', float('nan')):12.3f} {s['check']}")


if __name__ == "__main__":
    main()
