"""Kernel benchmarks on a CUDA GPU: decode attention (2-bit cache, CUDA C++ and Triton kernels) against BF16
decode with torch SDPA (cuDNN backend), quantize/pack/write, and prefill over a quantized prefix against BF16
SDPA. Qwen3-8B attention shapes (32 query / 8 KV heads, d = 128), page 64, sink 64 + window 256 in 16-bit.

Every timed call runs from a captured CUDA graph, with the L2 cache flushed (a 256 MiB write) before each
replay; the median of the replays is reported. Bandwidth counts the bytes the kernel must read from the
cache's own tensors (codes, scales, offsets, 16-bit tiers, block table, queries) plus its output.

    python benchmarks/bench_kernels.py --out docs/results/kernels_h200.json --git-sha $(git rev-parse HEAD)

Keys in channel pages (issue 9) next to token pages, alone:

    python benchmarks/bench_kernels.py --skip decode,quantize,extend --channel \
        --out docs/results/kernels_channel_h200.json --git-sha $(git rev-parse HEAD)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from oscarkv.kernels.layout import PageFormat, QuantPages  # noqa: E402
from oscarkv.kernels.plan import DecodePlan  # noqa: E402

HQ, HKV, D, PS, W16 = 32, 8, 128, 64, 320
READ_CEILING_TBS = 4.7


def provenance(git_sha: str) -> dict:
    import triton

    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.max.sm,memory.total",
                          "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
    return {"gpu": torch.cuda.get_device_name(), "nvidia_smi": smi, "torch": torch.__version__,
            "triton": triton.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
            "git_sha": git_sha, "date": time.strftime("%Y-%m-%d %H:%M:%S")}


_FLUSH = None


def timeit(fn, reps: int = 30, graph: bool = True) -> float:
    """Median milliseconds of ``fn`` (replayed from a CUDA graph) with a cold L2 before each replay."""
    global _FLUSH
    if _FLUSH is None:
        _FLUSH = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    fn()
    torch.cuda.synchronize()
    run = fn
    if graph:
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            fn()
        run = g.replay
    times = []
    for _ in range(reps):
        _FLUSH.zero_()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def make_cache(batch: int, ctx: int, seed: int = 0, key_layout: str = "token"):
    """Random 2-bit pages + 16-bit tiers for ``batch`` sequences of ``ctx`` tokens (ctx - 320 in 2-bit).
    ``key_layout="channel"``: keys in channel pages (a scale/offset per page, head and channel)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    n2 = max(0, ctx - W16)
    npg = math.ceil(n2 / PS)
    fmt = PageFormat(num_kv_heads=HKV, head_dim=D, page_size=PS)
    kfmt = PageFormat(num_kv_heads=HKV, head_dim=D, page_size=PS, layout=key_layout)
    kp, vp = QuantPages.allocate(kfmt, batch * npg, "cuda"), QuantPages.allocate(fmt, batch * npg, "cuda")
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


def decode_bytes(batch: int, n2: int, n16: int, key_layout: str = "token") -> int:
    per_tok2 = 2 * HKV * (D // 4 + 2 * 2)  # K and V: codes + fp16 scale + fp16 offset
    per_tok16 = 2 * HKV * D * 2
    npg = math.ceil(n2 / PS)
    total = n2 * per_tok2 + n16 * per_tok16 + 4 * npg + 2 * 2 * HQ * D
    if key_layout == "channel":  # K metadata: a [d] fp16 scale and offset per (page, head) instead of per row
        total += npg * HKV * 2 * 2 * D - n2 * HKV * 2 * 2
    return batch * total


def bench_sdpa_decode(batch: int, ctx: int) -> tuple[float, str]:
    """BF16 decode with SDPA: one query token per sequence, GQA through ``enable_gqa`` (the KV cache is read once,
    not repeated). cuDNN backend first; returns (ms, backend used)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    k = torch.randn(batch, HKV, ctx, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(batch, HQ, 1, D, device="cuda", dtype=torch.bfloat16)
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        def fn():
            with sdpa_kernel([backend]):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        try:
            return timeit(fn), name
        except RuntimeError:
            continue
    raise RuntimeError("no SDPA backend ran")


def bench_decode(batch: int, ctx: int, impls: list[str], with_sdpa: bool) -> dict:
    from oscarkv.kernels.decode_cuda import decode_attention_cuda
    from oscarkv.kernels.decode_triton import decode_attention_triton

    q, kp, vp, bt, qlen, k16, v16, len16, n2 = make_cache(batch, ctx)
    nbytes = decode_bytes(batch, n2, min(ctx, W16))
    row = {"batch": batch, "context": ctx, "tokens_2bit": n2, "bytes": nbytes}
    out = torch.empty(batch, HQ, D, device="cuda", dtype=torch.bfloat16)
    for impl in impls:
        # "cuda[:N][:mk|:fm][:f|:s][:<variant>...]": N programs per SM, separate merge kernel / fused last-CTA
        # merge, both tiers in one launch / one per tier, compile-time variants of the 2-bit loop (any names of
        # decode_cuda.VARIANTS, e.g. subn, lazy, l2pf, cpa, cpa3, qk2, pdl, or "none"; they replace the library's
        # default, which applies when none is named); "triton[:warps]"
        from oscarkv.kernels.decode_cuda import VARIANTS

        name, *opts = impl.split(":")
        ppsm = next((int(o) for o in opts if o.isdigit()), None)
        kw = {"merge": "kernel"} if "mk" in opts else {"merge": "fused"} if "fm" in opts else {}
        if "f" in opts or "s" in opts:
            kw["fused"] = "f" in opts
        picked = [o for o in opts if o in VARIANTS or o == "none"]
        if name == "cuda" and picked:
            kw["variant"] = "+".join(o for o in picked if o != "none") or "none"
        plan = DecodePlan(batch, HQ, HKV, D, PS, bt.shape[1], W16, device="cuda",
                          **({"programs_per_sm": ppsm} if ppsm and name == "cuda" else {})).update(batch)
        try:
            if name == "cuda":
                fn = lambda: decode_attention_cuda(q, kp, vp, bt, qlen, k16, v16, len16, plan=plan, out=out, **kw)  # noqa
            else:  # triton, triton:nw
                nw = ppsm or 4
                fn = lambda: decode_attention_triton(q, kp, vp, bt, qlen, k16, v16, len16, plan=plan,  # noqa
                                                     out=out, num_warps=nw)
            ms = timeit(fn)
            row[impl] = {"ms": ms, "TBps": nbytes / ms / 1e9, "splits": plan.num_splits}
        except Exception as e:  # report and keep going: one failing variant must not hide the others
            row[impl] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    del q, kp, vp, bt, k16, v16
    torch.cuda.empty_cache()
    if with_sdpa:
        try:
            row["sdpa_bf16_ms"], row["sdpa_backend"] = bench_sdpa_decode(batch, ctx)
        except Exception as e:
            row["sdpa_bf16_ms"] = None
            row["sdpa_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        torch.cuda.empty_cache()
    return row


def bench_channel_decode(batch: int, ctx: int) -> dict:
    """Decode with keys in channel pages (Triton) next to token pages (Triton and CUDA C++), same shapes and
    the same random code bytes; issue 9's target: channel within 10% of the token format."""
    from oscarkv.kernels.decode_cuda import decode_attention_cuda
    from oscarkv.kernels.decode_triton import decode_attention_triton

    row = {"batch": batch, "context": ctx}
    out = torch.empty(batch, HQ, D, device="cuda", dtype=torch.bfloat16)
    for layout in ("token", "channel"):
        q, kp, vp, bt, qlen, k16, v16, len16, n2 = make_cache(batch, ctx, key_layout=layout)
        nbytes = decode_bytes(batch, n2, min(ctx, W16), layout)
        row[f"bytes_{layout}"] = nbytes
        def variant(**kw):
            return lambda *a, **k: decode_attention_triton(*a, **kw, **k)

        impls = [("triton", variant()), ("cuda", decode_attention_cuda)] if layout == "token" else \
            [("triton", variant()), ("tritondequant", variant(kfold="dequant")),
             ("tritonnocap", variant(maxnreg=0)), ("tritondequantnocap", variant(kfold="dequant", maxnreg=0))]
        for name, fn_ in impls:
            plan = DecodePlan(batch, HQ, HKV, D, PS, bt.shape[1], W16, device="cuda").update(batch)
            fn = lambda: fn_(q, kp, vp, bt, qlen, k16, v16, len16, plan=plan, out=out)  # noqa: E731
            try:
                ms = timeit(fn)
                row[f"{name}_{layout}"] = {"ms": ms, "TBps": nbytes / ms / 1e9, "splits": plan.num_splits}
            except Exception as e:
                row[f"{name}_{layout}"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        del q, kp, vp, bt, k16, v16
        torch.cuda.empty_cache()
    ch = row["triton_channel"].get("ms")
    best = [v["ms"] for k, v in row.items() if k.endswith("_channel") and isinstance(v, dict) and "ms" in v]
    row["best_channel_ms"] = min(best) if best else None
    for ref in ("triton_token", "cuda_token"):
        t = row[ref].get("ms")
        row[f"channel_over_{ref}"] = ch / t if ch and t else None
        row[f"best_channel_over_{ref}"] = min(best) / t if best and t else None
    return row


def bench_channel_write_extend(n: int, prefix: int, chunk: int) -> dict:
    """Whole-page quantize/write of K (channel pages) + V (token pages), and extend over a channel-page prefix,
    each next to the token-page equivalent."""
    from oscarkv.kernels.extend_triton import extend_attention_triton
    from oscarkv.kernels.quantize_triton import quantize_write_triton

    res = {"rows": n, "prefix": prefix, "chunk": chunk}
    for layout in ("token", "channel"):
        kf = PageFormat(num_kv_heads=HKV, head_dim=D, page_size=PS, layout=layout)
        vf = PageFormat(num_kv_heads=HKV, head_dim=D, page_size=PS)
        kp, vp = QuantPages.allocate(kf, n // PS, "cuda"), QuantPages.allocate(vf, n // PS, "cuda")
        k = torch.randn(n, HKV, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        slots = (torch.randperm(n // PS, device="cuda")[:, None] * PS + torch.arange(PS, device="cuda")).view(-1)
        fn = lambda: quantize_write_triton(kp, vp, k, v, slots, v_clip=0.92, check_pages=False)  # noqa: E731
        res[f"write_{layout}_ms"] = timeit(fn)
        del kp, vp, k, v
        q0, kp, vp, bt, qlen, k16, v16, len16, n2 = make_cache(1, prefix, key_layout=layout)
        q = torch.randn(1, chunk, HQ, D, device="cuda", dtype=torch.bfloat16)
        kn = torch.randn(1, chunk, HKV, D, device="cuda", dtype=torch.bfloat16)
        vn = torch.randn_like(kn)
        # the fused kernel (as in the sessions before 16: the channel/token comparison), and the default (the
        # cuDNN fold since session 16; host lengths, so that it is the one captured)
        fn = lambda: extend_attention_triton(q, kn, vn, kp, vp, bt, qlen, k16, v16, len16, fold="dequant")  # noqa
        hl = (qlen.tolist(), len16.tolist())
        fd = lambda: extend_attention_triton(q, kn, vn, kp, vp, bt, qlen, k16, v16, len16, host_lengths=hl)  # noqa
        try:
            res[f"extend_{layout}_ms"] = timeit(fn, reps=10)
            res[f"extend_{layout}_default_ms"] = timeit(fd, reps=10)
        except Exception as e:
            res[f"extend_{layout}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        torch.cuda.empty_cache()
    return res


def bench_quantize(n: int, rotate: bool) -> dict:
    from oscarkv.kernels.quantize_triton import quantize_write_triton

    fmt = PageFormat(num_kv_heads=HKV, head_dim=D, page_size=PS)
    kp, vp = QuantPages.allocate(fmt, n // PS + 1, "cuda"), QuantPages.allocate(fmt, n // PS + 1, "cuda")
    k = torch.randn(n, HKV, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(n, HKV, D, device="cuda", dtype=torch.bfloat16)
    slots = torch.randperm((n // PS + 1) * PS, device="cuda")[:n]
    r = torch.linalg.qr(torch.randn(D, D, device="cuda"))[0] if rotate else None
    mu = torch.randn(HKV, D, device="cuda") if rotate else None
    fn = lambda: quantize_write_triton(kp, vp, k, v, slots, k_rotation=r, v_rotation=r, k_mean=mu, v_mean=mu,  # noqa
                                       k_clip=0.96, v_clip=0.92)
    ms = timeit(fn)
    nbytes = 2 * n * HKV * (D * 2 + D // 4 + 4) + n * 8
    return {"rows": n, "rotate": rotate, "ms": ms, "bytes": nbytes, "TBps": nbytes / ms / 1e9}


def bench_extend(prefix: int, chunk: int) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from oscarkv.kernels.extend_triton import extend_attention_triton

    q0, kp, vp, bt, qlen, k16, v16, len16, n2 = make_cache(1, prefix)
    q = torch.randn(1, chunk, HQ, D, device="cuda", dtype=torch.bfloat16)
    kn = torch.randn(1, chunk, HKV, D, device="cuda", dtype=torch.bfloat16)
    vn = torch.randn_like(kn)
    res = {"prefix": prefix, "chunk": chunk}
    # the launcher default (fold="sdpa" where cuDNN attention runs: host lengths given, so that it is
    # graph-capturable), and the fused kernel (fold="dequant", nothing materialised) at two tile geometries
    hl = (qlen.tolist(), len16.tolist())
    for name, kw in (("ours_default", {"host_lengths": hl}), ("ours_sdpa_seg8k", {"fold": "sdpa", "host_lengths": hl,
                                                                               "segment_tokens": 8192})):
        fn = lambda kw=kw: extend_attention_triton(q, kn, vn, kp, vp, bt, qlen, k16, v16, len16, **kw)  # noqa
        try:
            res[f"{name}_ms"] = timeit(fn, reps=10)
            res[f"{name}_eager_ms"] = timeit(fn, reps=10, graph=False)
        except Exception as e:
            res[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    for bm, bn, nw in ((64, 64, 4), (128, 64, 8)):
        fn = lambda: extend_attention_triton(q, kn, vn, kp, vp, bt, qlen, k16, v16, len16, block_m=bm,  # noqa
                                             block_n=bn, num_warps=nw, fold="dequant")
        try:
            res[f"ours_bm{bm}_nw{nw}_ms"] = timeit(fn, reps=10)
        except Exception as e:
            res[f"ours_bm{bm}_nw{nw}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    qs = q.transpose(1, 2)
    ks = torch.randn(1, HKV, prefix + chunk, D, device="cuda", dtype=torch.bfloat16)
    vs = torch.randn_like(ks)
    for name, backends in (("sdpa_cudnn_ms", [SDPBackend.CUDNN_ATTENTION]),
                           ("sdpa_flash_ms", [SDPBackend.FLASH_ATTENTION])):
        def fn():
            with sdpa_kernel(backends):
                return torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, enable_gqa=True)
        try:
            res[name] = timeit(fn, reps=10)
        except Exception as e:
            res[name.replace("_ms", "_error")] = f"{type(e).__name__}: {str(e)[:200]}"
    return res


def _best(row: dict, prefix: str) -> tuple[str, dict] | None:
    cands = [(k, v) for k, v in row.items() if k.startswith(prefix) and isinstance(v, dict) and "ms" in v]
    return min(cands, key=lambda kv: kv[1]["ms"]) if cands else None


def markdown(res: dict) -> str:
    lines = [f"Provenance: {json.dumps(res['provenance'])}", "",
             f"Decode, Qwen3-8B attention shapes (32/8 heads, d=128), 2-bit pages of 64 + 320 tokens in 16-bit; "
             f"'ours' = `{res['best_impl']}` (default plan); cold L2, CUDA-graph replay, median.", "",
             "| context | batch | ours ms | TB/s | % of 4.7 | BF16 SDPA ms | speed-up | best variant | Triton ms |",
             "|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for row in res["decode"]:
        o = row.get(res["best_impl"], {})
        if "ms" not in o:
            continue
        sd = row.get("sdpa_bf16_ms")
        sd_s = "n/a" if sd is None else f"{sd:.4f} ({row.get('sdpa_backend', '?')})"
        up = "" if not sd else f"{sd / o['ms']:.2f}x"
        bv = _best(row, "cuda")
        bv_s = "" if bv is None else f"{bv[0]} {bv[1]['ms']:.4f}"
        tr = _best(row, "triton")
        tr_s = "" if tr is None else f"{tr[1]['ms']:.4f} ({tr[0]})"
        pct = 100 * o["TBps"] / READ_CEILING_TBS
        lines.append(f"| {row['context']} | {row['batch']} | {o['ms']:.4f} | {o['TBps']:.2f} | {pct:.0f}% | "
                     f"{sd_s} | {up} | {bv_s} | {tr_s} |")
    for qrow in res.get("quantize", []):
        lines.append(f"\nquantize_write {qrow['rows']} rows x 8 heads, K+V, rotate={qrow['rotate']}: "
                     f"{qrow['ms']:.4f} ms, {qrow['TBps']:.2f} TB/s ({100 * qrow['TBps'] / READ_CEILING_TBS:.0f}%)")
    for e in res.get("extend", []):
        lines.append(f"\nextend prefix {e['prefix']} chunk {e['chunk']}: " + json.dumps(e))
    if res.get("channel"):
        lines += ["", "Decode with keys in channel pages (Triton) vs token pages (Triton, CUDA C++); ratio = channel "
                  "time / token time (issue 9 target <= 1.10). Channel variants: default (scale folded into the query, "
                  "168-register cap), `dequant` (float16 dequantized key tiles), `nocap` (no register cap).", "",
                  "| context | batch | channel ms | dequant ms | nocap ms | dequant nocap ms | TB/s (default) "
                  "| token Triton ms | ratio default / best | token CUDA ms | ratio default / best |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        f = lambda x: "n/a" if x is None else f"{x:.4f}"  # noqa: E731
        for r in res["channel"]:
            ms = [r[k].get("ms") for k in ("triton_channel", "tritondequant_channel", "tritonnocap_channel",
                                            "tritondequantnocap_channel")]
            lines.append(f"| {r['context']} | {r['batch']} | " + " | ".join(f(m) for m in ms) +
                         f" | {f(r['triton_channel'].get('TBps'))} | {f(r['triton_token'].get('ms'))} | "
                         f"{f(r['channel_over_triton_token'])} / {f(r['best_channel_over_triton_token'])} | "
                         f"{f(r['cuda_token'].get('ms'))} | {f(r['channel_over_cuda_token'])} / "
                         f"{f(r['best_channel_over_cuda_token'])} |")
    for e in res.get("channel_write_extend", []):
        lines.append("\nchannel pages, write and extend: " + json.dumps(e))
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="docs/results/kernels_h200.json")
    ap.add_argument("--git-sha", default="unknown")
    ap.add_argument("--contexts", default="4096,8192,16384,32768,65536,81920,131072")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--impls", default="cuda,triton")
    ap.add_argument("--best", default="cuda")
    ap.add_argument("--skip", default="", help="comma list of sections to skip: decode,quantize,extend")
    ap.add_argument("--channel", action="store_true",
                    help="also time keys in channel pages (decode at --contexts x --batches, write, extend)")
    ap.add_argument("--max-gb", type=float, default=40.0, help="skip shapes whose BF16 baseline exceeds this")
    args = ap.parse_args()
    res = {"provenance": provenance(args.git_sha), "best_impl": args.best, "decode": [], "quantize": [],
           "extend": [], "channel": [], "channel_write_extend": [], "read_ceiling_TBps": READ_CEILING_TBS}
    skip = set(args.skip.split(","))
    if "decode" not in skip:
        for ctx in map(int, args.contexts.split(",")):
            for bs in map(int, args.batches.split(",")):
                bf16_gb = bs * ctx * HKV * D * 2 * 2 / 1e9
                row = bench_decode(bs, ctx, args.impls.split(","), with_sdpa=bf16_gb <= args.max_gb)
                res["decode"].append(row)
                cells = [f"{k}={v['ms']:.4f}ms/{v['TBps']:.2f}TB/s/s{v['splits']}" if "ms" in v
                         else f"{k}=ERR {v['error']}" for k, v in row.items() if isinstance(v, dict)]
                print(f"ctx {ctx} bs {bs} sdpa={row.get('sdpa_bf16_ms')}", *cells, flush=True)
    if "quantize" not in skip:
        for rot in (False, True):
            res["quantize"].append(bench_quantize(32768, rot))
            print(json.dumps(res["quantize"][-1]), flush=True)
    if "extend" not in skip:
        res["extend"].append(bench_extend(32768, 2048))
        print(json.dumps(res["extend"][-1]), flush=True)
    if args.channel:
        for ctx in map(int, args.contexts.split(",")):
            for bs in map(int, args.batches.split(",")):
                res["channel"].append(bench_channel_decode(bs, ctx))
                print(json.dumps(res["channel"][-1]), flush=True)
        res["channel_write_extend"].append(bench_channel_write_extend(32768, 32768, 2048))
        print(json.dumps(res["channel_write_extend"][-1]), flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    md = markdown(res)
    with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
        f.write(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
