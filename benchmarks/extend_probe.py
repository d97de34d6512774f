"""Extend/prefill probe: every variant of the Triton extend kernel at the benchmark shape, checked, then timed.

One sequence, a 2048-token chunk over a 32K quantized prefix (32,448 2-bit tokens + 320 in the 16-bit tiers),
Qwen3-8B attention shapes (32 query / 8 KV heads, d = 128, page 64), bfloat16 activations. For each variant
(launcher keywords of ``extend_attention_triton``):

1. correctness against a float64 reference over the dequantized cache (chunked over query rows, checked
   against ``reference.extend_attention_ref`` at a small shape first): bfloat16 inputs with the benchmark's
   queries and with queries x16 (sharp softmax, the running max keeps moving), budget 1e-2; float16 inputs,
   budget 2e-3;
2. time (``bench_kernels.timeit``: CUDA graph, cold L2, median), also with the x16 queries,

next to BF16 SDPA (cuDNN and flash) over the same 34,816 keys (non-causal, as ``bench_kernels.bench_extend``:
slightly more work than ours). Issue target: within 1.5x of cuDNN. Also keys in channel pages (default and
``fold="factor"``). Prints a table; ``--out`` writes JSON and a markdown table next to it.

    PYTHONPATH=. python benchmarks/extend_probe.py --out $OUT/extend_probe.json
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench_kernels import D, HKV, HQ, W16, make_cache, provenance, timeit  # noqa: E402

from oscarkv.kernels.extend_triton import extend_attention_triton  # noqa: E402
from oscarkv.kernels.reference import extend_attention_ref, gather_dequant_ref  # noqa: E402

BUDGET = {torch.bfloat16: 1e-2, torch.float16: 2e-3}
SHARP = 16.0  # query multiplier for the sharp-softmax check

# (name, launcher keywords); "default" is whatever the launcher defaults are
VARIANTS = [
    ("default", {}),
    ("dq-cat-m64w4-s2", dict(fold="dequant", unpack="cat", block_m=64, num_warps=4, num_stages=2)),
    ("dq-cat-m64w4-s3", dict(fold="dequant", unpack="cat", block_m=64, num_warps=4, num_stages=3)),
    ("dq-cat-m64w4-s4", dict(fold="dequant", unpack="cat", block_m=64, num_warps=4, num_stages=4)),
    ("dq-cat-m128w8-s2", dict(fold="dequant", unpack="cat", block_m=128, num_warps=8, num_stages=2)),
    ("dq-cat-m128w8-s3", dict(fold="dequant", unpack="cat", block_m=128, num_warps=8, num_stages=3)),
    ("dq-cat-lazy-m64w4", dict(fold="dequant", unpack="cat", rescale="lazy", block_m=64, num_warps=4)),
    ("dq-cat-lazy-m128w8", dict(fold="dequant", unpack="cat", rescale="lazy", block_m=128, num_warps=8)),
    ("dq-vcat-m64w4", dict(fold="dequant", unpack="vcat", block_m=64, num_warps=4)),
    ("dq-fields-m64w4", dict(fold="dequant", unpack="fields", block_m=64, num_warps=4)),
    ("dq-fields-m128w8", dict(fold="dequant", unpack="fields", block_m=128, num_warps=8)),
    ("factor-cat-m64w4", dict(fold="factor", unpack="cat", block_m=64, num_warps=4)),
    ("factor-cat-m128w8", dict(fold="factor", unpack="cat", block_m=128, num_warps=8)),
    ("factor-fields-f32-m128w8", dict(fold="factor", unpack="fields", pmul="f32", qnative=False, block_m=128,
                                      num_warps=8)),
]
FP16_CHECK = ("default", "dq-cat-m128w8-s3", "dq-cat-lazy-m64w4", "factor-cat-m64w4")
CHANNEL = ("default", "dq-cat-m128w8-s3", "factor-cat-m64w4")


def reference_f64(q, kn, vn, kp, vp, bt, qlen, k16, v16, len16, sm_scale=None, block=256):
    """``extend_attention_ref`` in float64, chunked over query rows (the full score matrix at the benchmark shape
    would be ~18 GB in float64)."""
    B, T, hq, d = q.shape
    scale = d**-0.5 if sm_scale is None else sm_scale
    out = torch.empty(B, T, hq, d, dtype=torch.float64, device=q.device)
    for b in range(B):
        n16, nq = int(len16[b]), int(qlen[b])
        k = torch.cat([k16[b, :, :n16].double(), gather_dequant_ref(kp, bt, b, nq).double(),
                       kn[b].transpose(0, 1).double()], 1)
        v = torch.cat([v16[b, :, :n16].double(), gather_dequant_ref(vp, bt, b, nq).double(),
                       vn[b].transpose(0, 1).double()], 1)
        hkv = k.shape[0]
        g = hq // hkv
        npre = n16 + nq
        kpos = torch.arange(k.shape[1], device=q.device) - npre  # chunk keys at 0..T-1, prefix keys < 0
        for t0 in range(0, T, block):
            t1 = min(T, t0 + block)
            qb = q[b, t0:t1].double().view(t1 - t0, hkv, g, d).permute(1, 2, 0, 3)
            s = torch.einsum("hgtd,hnd->hgtn", qb, k) * scale
            s.masked_fill_(kpos[None, :] > torch.arange(t0, t1, device=q.device)[:, None], float("-inf"))
            o = torch.einsum("hgtn,hnd->hgtd", torch.softmax(s, dim=-1), v)
            out[b, t0:t1] = o.permute(2, 0, 1, 3).reshape(t1 - t0, hq, d)
            del s, o
    return out


def rel_err(out, ref) -> float:
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def self_check() -> float:
    """The chunked reference equals reference.extend_attention_ref (small shape, partial pages, GQA 4)."""
    from oscarkv.kernels.layout import PageFormat, QuantPages
    from oscarkv.kernels.reference import quantize_write_ref

    g = torch.Generator(device="cuda").manual_seed(1)
    fmt = PageFormat(num_kv_heads=2, head_dim=64, page_size=16)
    kp, vp = QuantPages.allocate(fmt, 8, "cuda"), QuantPages.allocate(fmt, 8, "cuda")
    n = 70
    bt = torch.randperm(8, device="cuda", generator=g)[:5].int()[None]
    pos = torch.arange(n, device="cuda")
    slots = bt[0, pos // 16].long() * 16 + pos % 16
    quantize_write_ref(kp, torch.randn(n, 2, 64, device="cuda", generator=g), slots)
    quantize_write_ref(vp, torch.randn(n, 2, 64, device="cuda", generator=g), slots)
    k16 = torch.randn(1, 2, 8, 64, device="cuda", generator=g)
    v16 = torch.randn(1, 2, 8, 64, device="cuda", generator=g)
    q = torch.randn(1, 37, 8, 64, device="cuda", generator=g)
    kn = torch.randn(1, 37, 2, 64, device="cuda", generator=g)
    vn = torch.randn(1, 37, 2, 64, device="cuda", generator=g)
    i32 = lambda x: torch.tensor(x, dtype=torch.int32, device="cuda")  # noqa: E731
    args = (q, kn, vn, kp, vp, bt, i32([n]), k16, v16, i32([5]))
    return rel_err(reference_f64(*args, block=8), extend_attention_ref(*args, dtype=torch.float64))


def make_inputs(prefix: int, chunk: int, key_layout: str, seed: int = 0):
    _, kp, vp, bt, qlen, k16, v16, len16, n2 = make_cache(1, prefix, seed=seed, key_layout=key_layout)
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    q = torch.randn(1, chunk, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
    kn = torch.randn(1, chunk, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    vn = torch.randn(1, chunk, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    return q, kn, vn, kp, vp, bt, qlen, k16, v16, len16


def sdpa_times(prefix: int, chunk: int, reps: int) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(1, HQ, chunk, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, HKV, prefix + chunk, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    res = {}
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        def fn():
            with sdpa_kernel([backend]):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        try:
            res[name] = timeit(fn, reps=reps)
        except Exception as e:  # one missing backend must not hide the rest
            res[name] = None
            res[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    return res


def run_variant(name, kw, inputs, ref, ref_sharp, reps, inputs16=None, ref16=None) -> dict:
    q, kn, vn, kp, vp, bt, qlen, k16, v16, len16 = inputs
    row = {"variant": name, "kwargs": kw}
    out = torch.empty_like(q)
    try:
        t0 = time.time()
        extend_attention_triton(q, kn, vn, kp, vp, bt, qlen, k16, v16, len16, out=out, **kw)
        torch.cuda.synchronize()
        row["first_call_s"] = round(time.time() - t0, 1)  # includes compilation
        row["err"] = rel_err(out, ref)
        qs = (q.float() * SHARP).to(q.dtype)
        extend_attention_triton(qs, kn, vn, kp, vp, bt, qlen, k16, v16, len16, out=out, **kw)
        row["err_sharp"] = rel_err(out, ref_sharp)
        if inputs16 is not None:
            a16 = inputs16
            out16 = torch.empty_like(a16[0])
            extend_attention_triton(*a16, out=out16, **kw)
            row["err_fp16"] = rel_err(out16, ref16)
        row["ok"] = row["err"] < BUDGET[q.dtype] and row["err_sharp"] < BUDGET[q.dtype] and \
            row.get("err_fp16", 0.0) < BUDGET[torch.float16]
        row["ms"] = timeit(lambda: extend_attention_triton(q, kn, vn, kp, vp, bt, qlen, k16, v16, len16, out=out,
                                                           **kw), reps=reps)
        row["ms_sharp"] = timeit(lambda: extend_attention_triton(qs, kn, vn, kp, vp, bt, qlen, k16, v16, len16,
                                                                 out=out, **kw), reps=reps)
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        traceback.print_exc()
    torch.cuda.empty_cache()
    return row


def fmt_row(r: dict, sd: dict, flops: float) -> str:
    f = lambda x, p=4: "n/a" if x is None else (f"{x:.{p}f}" if isinstance(x, float) else str(x))  # noqa: E731
    if "error" in r:
        return f"| {r['variant']} | ERROR: {r['error'][:150]} |" + " |" * 8
    ms = r["ms"]
    cu, fl = sd.get("cudnn"), sd.get("flash")
    e = lambda k: "" if k not in r else f"{r[k]:.1e}"  # noqa: E731
    return (f"| {r['variant']} | {'ok' if r['ok'] else 'FAIL'} | {e('err')} | {e('err_sharp')} | {e('err_fp16')} | "
            f"{ms:.3f} | {r['ms_sharp']:.3f} | {flops / ms / 1e9:.0f} | "
            f"{f(ms / cu, 2) if cu else 'n/a'} | {f(ms / fl, 2) if fl else 'n/a'} |")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="JSON path (a .md table is written next to it)")
    ap.add_argument("--prefix", type=int, default=32768, help="prefix tokens (320 of them in the 16-bit tiers)")
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--variants", default="all", help="comma list of variant names, or 'all'")
    ap.add_argument("--no-channel", action="store_true", help="skip keys in channel pages")
    ap.add_argument("--git-sha", default="unknown")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    sel = VARIANTS if args.variants == "all" else [v for v in VARIANTS if v[0] in args.variants.split(",")]
    defaults = {k: p.default for k, p in inspect.signature(extend_attention_triton).parameters.items()
                if p.kind == p.KEYWORD_ONLY and k != "out"}
    res = {"provenance": provenance(args.git_sha), "prefix": args.prefix, "chunk": args.chunk,
           "launcher_defaults": defaults, "rows": [], "channel_rows": []}
    sc = self_check()
    res["reference_self_check"] = sc
    print(f"chunked float64 reference vs extend_attention_ref: {sc:.1e}", flush=True)
    assert sc < 1e-12, "chunked reference disagrees with extend_attention_ref"
    n2 = max(0, args.prefix - W16)
    keys = args.prefix + args.chunk
    # work of our kernel (causal chunk) and of the SDPA baseline (all keys), 2 products x 2 flops per MAC
    flops = 4.0 * args.chunk * HQ * D * (args.prefix + (args.chunk + 1) / 2)
    flops_sdpa = 4.0 * args.chunk * HQ * D * keys
    res.update(tokens_2bit=n2, keys=keys, flops=flops, flops_sdpa=flops_sdpa)
    print(f"shape: 1 sequence, chunk {args.chunk} over {args.prefix} ({n2} 2-bit + {min(args.prefix, W16)} 16-bit), "
          f"{HQ}/{HKV} heads, d={D}; {flops / 1e12:.3f} TFLOP (SDPA over {keys} keys: {flops_sdpa / 1e12:.3f})\n"
          f"launcher defaults: {defaults}", flush=True)
    sd = sdpa_times(args.prefix, args.chunk, args.reps)
    res["sdpa_ms"] = sd
    print(f"BF16 SDPA over {keys} keys: cuDNN {sd.get('cudnn')} ms, flash {sd.get('flash')} ms "
          f"(target <= 1.5 x cuDNN = {1.5 * sd['cudnn']:.3f} ms)" if sd.get("cudnn") else f"SDPA: {sd}", flush=True)
    torch.cuda.empty_cache()
    for layout in ("token",) + (() if args.no_channel else ("channel",)):
        inputs = make_inputs(args.prefix, args.chunk, layout)
        q = inputs[0]
        ref = reference_f64(*inputs)
        ref_sharp = reference_f64((q.float() * SHARP).to(q.dtype), *inputs[1:])
        inputs16 = tuple(x.half() if torch.is_tensor(x) and x.dtype == torch.bfloat16 else x for x in inputs)
        ref16 = reference_f64(*inputs16)
        rows = res["rows"] if layout == "token" else res["channel_rows"]
        for name, kw in sel:
            if layout == "channel" and name not in CHANNEL:
                continue
            fp16 = name in FP16_CHECK
            r = run_variant(name, kw, inputs, ref, ref_sharp, args.reps, inputs16 if fp16 else None,
                            ref16 if fp16 else None)
            r["layout"] = layout
            rows.append(r)
            print(f"[{layout}] {name}: " + json.dumps({k: v for k, v in r.items() if k not in ("variant", "kwargs")}),
                  flush=True)
        del inputs, ref, ref_sharp, inputs16, ref16
        torch.cuda.empty_cache()
    head = ("| variant | check | err bf16 | err bf16 q x16 | err fp16 | ms | ms q x16 | TFLOP/s | / cuDNN | / flash |\n"
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    lines = [f"Extend probe: chunk {args.chunk} over a {args.prefix}-token prefix ({n2} 2-bit + "
             f"{min(args.prefix, W16)} 16-bit), {HQ}/{HKV} heads, d={D}, bf16; cold L2, CUDA graph, median of "
             f"{args.reps}. SDPA over {keys} keys: cuDNN {sd.get('cudnn')} ms, flash {sd.get('flash')} ms. "
             f"Budgets: 1e-2 (bf16), 2e-3 (fp16). TFLOP/s counts our causal work ({flops / 1e12:.3f} TFLOP).",
             f"Launcher defaults: `{json.dumps(defaults)}`", "", "Token pages:", "", head]
    lines += [fmt_row(r, sd, flops) for r in res["rows"]]
    if res["channel_rows"]:
        lines += ["", "Keys in channel pages:", "", head] + [fmt_row(r, sd, flops) for r in res["channel_rows"]]
    ok = [r for r in res["rows"] if r.get("ok")]
    if ok:
        best = min(ok, key=lambda r: r["ms"])
        res["best"] = best["variant"]
        cu = sd.get("cudnn")
        lines += ["", f"Fastest correct variant: {best['variant']} `{json.dumps(best['kwargs'])}` {best['ms']:.3f} ms"
                  + (f" = {best['ms'] / cu:.2f} x cuDNN (target <= 1.5)" if cu else "")]
    md = "\n".join(lines)
    print("\n" + md, flush=True)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1, default=str)
        with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
            f.write(md + "\n")
    return 0 if all(r.get("ok") for r in res["rows"] + res["channel_rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
