"""Extend/prefill probe: variants of the Triton extend kernel at the benchmark shape, checked, then timed, next to
the plain Triton flash attention over a bfloat16 prefix (the same work without quantization: Triton's ceiling
at this geometry) and to BF16 SDPA (the default backend, and cuDNN / flash forced).

One sequence, a 2048-token chunk over a 32K prefix (32,448 2-bit tokens + 320 in the 16-bit tiers), Qwen3-8B
attention shapes (32 query / 8 KV heads, d = 128, page 64), bfloat16 activations. Row kinds:

* ``quant``: ``extend_attention_triton`` with the row's launcher keywords (fused: the page tiles dequantized in
  registers; ``fold="workspace"``: a dequantization pass into a float16 workspace, then flash attention on it);
* ``dequant``: the workspace's first pass alone (``dequant_workspace``); ``ws-attn``: its second pass alone
  (``extend_attention_dense`` over the float16 workspace);
* ``dense``: ``extend_attention_dense`` over a bfloat16 prefix of the same length (no quantization);
* ``quant16``: as ``quant`` with float16 activations (queries, chunk, 16-bit tiers): the query enters the page
  dots as loaded, with no bfloat16-to-float16 conversion held in registers (checked against the float64
  reference of those inputs, budget 2e-3; no sharp check).

Each is checked against a float64 reference (chunked over query rows; over the dequantized cache, or over the
bfloat16 prefix for ``dense``): bfloat16 inputs with the benchmark's queries and with queries x16 (sharp softmax,
the running max keeps moving), budget 1e-2; float16 inputs for the default, budget 2e-3. Then timed
(``bench_kernels.timeit``: CUDA graph, cold L2, median). SDPA runs over the same 34,816 keys, non-causal (as
``bench_kernels.bench_extend``: slightly more work than ours); the default backend is what torch picks without
an ``sdpa_kernel`` context, read from the CUDA kernel names of one profiled call. Issue target: within 1.5x of
BF16 SDPA, the prefix dequantized tile by tile, never materialised. Keys in channel pages for the default.
Rows trimmed to the candidates (``pages_per_step`` 1/2/4 at 64 rows / 4 warps and 128 / 8, lazy rescale,
``num_stages`` 2/3/4, a register cap, float16 activations) and two references (the float16 workspace, which
materialises the prefix, and plain Triton flash over a bfloat16 prefix). ``--warm N`` (default 6) compiles the
selected rows first in N processes. Prints a table; ``--out`` writes
JSON (after every row) and a markdown table next to it.

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

from oscarkv.kernels.extend_dense import dequant_workspace, extend_attention_dense  # noqa: E402
from oscarkv.kernels.extend_triton import extend_attention_triton  # noqa: E402
from oscarkv.kernels.reference import extend_attention_ref, gather_dequant_ref  # noqa: E402

BUDGET = {torch.bfloat16: 1e-2, torch.float16: 2e-3}
SHARP = 16.0  # query multiplier for the sharp-softmax check

_WS = dict(fold="workspace", block_m=128, block_n=64, num_warps=8, num_stages=3)
_M64 = dict(block_m=64, num_warps=4)
_M128 = dict(block_m=128, num_warps=8)
# (name, kind, keywords); "default" is whatever the launcher defaults are (2 pages a step at 64 rows / 4 warps, 2
# stages). The fused fold's TMA rows were removed with the option (session 14: no compile at 2 pages a step).
# All "quant" rows but the ws- one dequantize tile by tile in registers (the prefix never materialised).
VARIANTS = [
    ("default", "quant", {}),  # session 16: fold="sdpa" (cuDNN over a dequantized segment workspace)
    ("sdpa-seg16k", "quant", dict(fold="sdpa", segment_tokens=16384)),
    ("sdpa-seg8k", "quant", dict(fold="sdpa", segment_tokens=8192)),
    ("fused-default", "quant", dict(fold="dequant")),  # the fused default until session 15 (2 pages a step)
    ("dq-pps1-m64w4", "quant", dict(_M64, pages_per_step=1)),  # the previous default (4.217 ms at 7e56ab3)
    ("dq-pps2-m64w4-lazy", "quant", dict(_M64, pages_per_step=2, rescale="lazy")),
    ("dq-pps2-m64w4-s3", "quant", dict(_M64, pages_per_step=2, num_stages=3)),  # the default has 2 stages
    ("dq-pps2-m64w4-s4", "quant", dict(_M64, pages_per_step=2, num_stages=4)),
    ("dq-pps4-m64w4", "quant", dict(_M64, pages_per_step=4)),
    ("dq-pps4-m128w8", "quant", dict(_M128, pages_per_step=4)),
    ("dq-pps4-m128w8-lazy", "quant", dict(_M128, pages_per_step=4, rescale="lazy")),
    # session 15: 2 pages a step at 128 rows / 8 warps (static sm_90 SASS of the page loop, triton 3.6, per warp
    # per 64 keys: s2 384 with 3 spill instructions in the loop, 383 and none with maxnreg 240, s3 389 and
    # none, lazy s2 394 and none, lazy s3 413 with 6; the default 502); one page a step there (s2 472)
    # measured on the H200 (session 15, extend_probe_s15_h200.md, ms): s2 3.599, s3 3.490, r240 3.438, lazy 3.612,
    # lazy s3 3.656, one page s2 4.263, f16in 4 pages 3.347 / 2 pages 3.363, against the default's 3.285: none faster
    ("dq-pps2-m128w8", "quant", dict(_M128, pages_per_step=2)),
    ("dq-pps2-m128w8-s3", "quant", dict(_M128, pages_per_step=2, num_stages=3)),
    ("dq-pps2-m128w8-r240", "quant", dict(_M128, pages_per_step=2, maxnreg=240)),
    ("dq-pps2-m128w8-lazy", "quant", dict(_M128, pages_per_step=2, rescale="lazy")),
    ("dq-pps2-m128w8-lazy-s3", "quant", dict(_M128, pages_per_step=2, rescale="lazy", num_stages=3)),
    ("dq-pps1-m128w8-s2", "quant", dict(_M128, pages_per_step=1, num_stages=2)),
    # float16 activations: static page loop 4 pages at 128 / 8 342 with 4 spill instructions (bfloat16: 377, 88)
    ("dq-pps4-m128w8-f16in", "quant16", dict(_M128, pages_per_step=4)),
    ("dq-pps2-m128w8-f16in", "quant16", dict(_M128, pages_per_step=2)),
    ("ws-m128n64w8s3-tma", "quant", dict(_WS, tma=True)),  # materialises a float16 prefix: reference only
    ("triton-bf16-m128n64w8s3-tma", "dense", dict(block_m=128, block_n=64, num_warps=8, num_stages=3, tma=True)),
]
FP16_CHECK = ("default", "fused-default")
CHANNEL = ("default", "fused-default")


def reference_f64(q, kn, vn, kp, vp, bt, qlen, k16, v16, len16, sm_scale=None, block=256, prefix=None):
    """``extend_attention_ref`` in float64, chunked over query rows (the full score matrix at the benchmark shape
    would be ~18 GB in float64). ``prefix=(k, v)`` ``[B, Hkv, NP, d]``: that 16-bit prefix (``qlen[b]`` rows)
    instead of the dequantized pages (the ``dense`` rows)."""
    B, T, hq, d = q.shape
    scale = d**-0.5 if sm_scale is None else sm_scale
    out = torch.empty(B, T, hq, d, dtype=torch.float64, device=q.device)
    for b in range(B):
        n16, nq = int(len16[b]), int(qlen[b])
        if prefix is None:
            kq, vq = gather_dequant_ref(kp, bt, b, nq), gather_dequant_ref(vp, bt, b, nq)
        else:
            kq, vq = prefix[0][b, :, :nq], prefix[1][b, :, :nq]
        k = torch.cat([k16[b, :, :n16].double(), kq.double(), kn[b].transpose(0, 1).double()], 1)
        v = torch.cat([v16[b, :, :n16].double(), vq.double(), vn[b].transpose(0, 1).double()], 1)
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


def _backend_of(names: list[str]) -> str:
    low = " ".join(names).lower()
    for key, name in (("cudnn", "cudnn"), ("flash_fwd", "flash"), ("pytorch_flash", "flash"),
                      ("fmha_cutlass", "efficient"), ("mem_eff", "efficient")):
        if key in low:
            return name
    return "math/unknown"


def sdpa_times(prefix: int, chunk: int, reps: int) -> dict:
    """BF16 SDPA over all ``prefix + chunk`` keys (non-causal, GQA through ``enable_gqa``): the default backend
    (no context; which one ran, from the kernel names of one profiled call) and cuDNN, flash and efficient."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(1, HQ, chunk, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, HKV, prefix + chunk, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    res = {}
    for name, backend in (("default", None), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("flash", SDPBackend.FLASH_ATTENTION)):
        def fn(backend=backend):
            if backend is None:
                return sdpa(q, k, v, enable_gqa=True)
            with sdpa_kernel([backend]):
                return sdpa(q, k, v, enable_gqa=True)
        try:
            res[name] = timeit(fn, reps=reps)
        except Exception as e:  # one missing backend must not hide the rest
            res[name] = None
            res[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            sdpa(q, k, v, enable_gqa=True)
            torch.cuda.synchronize()
        names = sorted({e.name for e in prof.events() if str(getattr(e, "device_type", "")).endswith("CUDA")})
        res["default_kernels"] = [n[:160] for n in names]
        res["default_backend"] = _backend_of(names)
    except Exception as e:
        res["default_backend"] = f"unknown ({type(e).__name__}: {str(e)[:120]})"
    res["flags"] = {f: getattr(torch.backends.cuda, f)() for f in ("flash_sdp_enabled", "mem_efficient_sdp_enabled",
                                                                    "cudnn_sdp_enabled", "math_sdp_enabled")
                    if hasattr(torch.backends.cuda, f)}
    del q, k, v
    torch.cuda.empty_cache()
    return res


def run_variant(name, kind, kw, inputs, refs, reps, dense=None, inputs16=None, ref16=None) -> dict:
    """Check, then time, one row. ``refs``: (ref, ref_sharp) of the row's semantics; ``dense``: (k, v) bf16 prefix."""
    q, kn, vn, kp, vp, bt, qlen, k16, v16, len16 = inputs
    row = {"variant": name, "kind": kind, "kwargs": kw}
    if kind in ("quant", "quant16"):  # host lengths: fold="sdpa" (the default) is then graph-capturable
        kw = {**kw, "host_lengths": (qlen.tolist(), len16.tolist())}
    out = torch.empty_like(q)
    qs = (q.float() * SHARP).to(q.dtype)
    try:
        if kind == "dequant":
            fn = lambda: dequant_workspace(kp, vp, bt, qlen, round_to=64)  # noqa: E731
            t0 = time.time()
            fn()
            torch.cuda.synchronize()
            row["first_call_s"] = round(time.time() - t0, 1)
            row["ok"] = True
            row["ms"] = timeit(fn, reps=reps)
            return row
        if kind == "quant16":  # float16 activations: checked against their own reference, timed
            out16 = torch.empty_like(inputs16[0])
            fn = lambda: extend_attention_triton(*inputs16, out=out16, **kw)  # noqa: E731
            t0 = time.time()
            fn()
            torch.cuda.synchronize()
            row["first_call_s"] = round(time.time() - t0, 1)
            row["err_fp16"] = rel_err(out16, ref16)
            row["ok"] = row["err_fp16"] < BUDGET[torch.float16]
            row["ms"] = timeit(fn, reps=reps)
            return row
        if kind == "quant":
            call = lambda qq, o, a=inputs: extend_attention_triton(qq, *a[1:], out=o, **kw)  # noqa: E731
        elif kind == "ws-attn":
            # the workspace path's second pass as it runs there: float16 workspace, tiers and chunk
            kw_, vw_ = dequant_workspace(kp, vp, bt, qlen, round_to=kw.get("block_n", 64))
            h16 = [x.half() for x in (kn, vn, k16, v16)]
            call = lambda qq, o: extend_attention_dense(qq, h16[0], h16[1], kw_, vw_, qlen, h16[2], h16[3],  # noqa
                                                        len16, out=o, **kw)
        else:  # dense
            call = lambda qq, o: extend_attention_dense(qq, kn, vn, dense[0], dense[1], qlen, k16, v16,  # noqa: E731
                                                        len16, out=o, **kw)
        t0 = time.time()
        call(q, out)
        torch.cuda.synchronize()
        row["first_call_s"] = round(time.time() - t0, 1)  # includes compilation
        row["err"] = rel_err(out, refs[0])
        call(qs, out)
        row["err_sharp"] = rel_err(out, refs[1])
        if inputs16 is not None:
            out16 = torch.empty_like(inputs16[0])
            extend_attention_triton(*inputs16, out=out16, **kw)
            row["err_fp16"] = rel_err(out16, ref16)
        row["ok"] = row["err"] < BUDGET[q.dtype] and row["err_sharp"] < BUDGET[q.dtype] and \
            row.get("err_fp16", 0.0) < BUDGET[torch.float16]
        row["ms"] = timeit(lambda: call(q, out), reps=reps)
        row["ms_sharp"] = timeit(lambda: call(qs, out), reps=reps)
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        traceback.print_exc()
    torch.cuda.empty_cache()
    return row


def select(variants: str) -> list:
    return VARIANTS if variants == "all" else [v for v in VARIANTS if v[0] in variants.split(",")]


def warm_part(prefix: int, chunk: int, part: int, nparts: int, variants: str = "all") -> None:
    """Compile (one call each, unchecked, untimed) the selected rows ``part::nparts`` into Triton's disk cache:
    the same shapes, dtypes and layouts as the main run, so that it finds every kernel compiled."""
    mine = select(variants)[part::nparts]
    for layout in ("token", "channel"):
        rows = [v for v in mine if layout == "token" or v[0] in CHANNEL]
        if not rows:
            continue
        inputs = make_inputs(prefix, chunk, layout)
        q, kn, vn, _, _, _, qlen, k16, v16, len16 = inputs
        for name, kind, kw in rows:
            if kind == "quant":
                extend_attention_triton(*inputs, **kw)
            if kind == "quant16" or (kind == "quant" and name in FP16_CHECK):
                extend_attention_triton(*(x.half() if torch.is_tensor(x) and x.dtype == torch.bfloat16 else x
                                          for x in inputs), **kw)
            if kind == "dense":
                npad = -(-max(0, prefix - W16) // 128) * 128
                kd = torch.zeros(1, HKV, npad, D, device="cuda", dtype=torch.bfloat16)
                extend_attention_dense(q, kn, vn, kd, kd, qlen, k16, v16, len16, **kw)
        torch.cuda.synchronize()


def start_warm(args) -> list:
    import subprocess

    cmd = [sys.executable, os.path.abspath(__file__), "--prefix", str(args.prefix), "--chunk", str(args.chunk)]
    cmd += ["--variants", args.variants]
    return [subprocess.Popen(cmd + ["--warm-part", f"{i}/{args.warm}"]) for i in range(args.warm)]


HEAD = ("| variant | kind | check | err bf16 | err bf16 q x16 | err fp16 | ms | ms q x16 | TFLOP/s | x cuDNN | "
        "x flash | x default SDPA |\n|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")


def fmt_row(r: dict, sd: dict, flops: float) -> str:
    if "error" in r:
        return f"| {r['variant']} | {r['kind']} | ERROR: {r['error'][:150]} |" + " |" * 9
    ms = r["ms"]
    e = lambda k: "" if k not in r else f"{r[k]:.1e}"  # noqa: E731
    x = lambda k: "" if r["kind"] == "dequant" else (f"{ms / sd[k]:.2f}" if sd.get(k) else "n/a")  # noqa: E731
    tf = "" if r["kind"] == "dequant" else f"{flops / ms / 1e9:.0f}"
    ms_s = f"{r['ms_sharp']:.3f}" if "ms_sharp" in r else ""
    return (f"| {r['variant']} | {r['kind']} | {'ok' if r['ok'] else 'FAIL'} | {e('err')} | {e('err_sharp')} | "
            f"{e('err_fp16')} | {ms:.3f} | {ms_s} | {tf} | {x('cudnn')} | {x('flash')} | {x('default')} |")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="JSON path (a .md table is written next to it)")
    ap.add_argument("--prefix", type=int, default=32768, help="prefix tokens (320 of them in the 16-bit tiers)")
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--variants", default="all", help="comma list of variant names, or 'all'")
    ap.add_argument("--no-channel", action="store_true", help="skip keys in channel pages")
    ap.add_argument("--git-sha", default="unknown")
    ap.add_argument("--warm", type=int, default=6, help="compile every row first in N processes (0: no)")
    ap.add_argument("--warm-part", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.warm_part:
        part, nparts = map(int, args.warm_part.split("/"))
        warm_part(args.prefix, args.chunk, part, nparts, args.variants)
        return 0
    torch.backends.cuda.matmul.allow_tf32 = False
    sel = select(args.variants)
    defaults = {k: p.default for k, p in inspect.signature(extend_attention_triton).parameters.items()
                if p.kind == p.KEYWORD_ONLY and k != "out"}
    res = {"provenance": provenance(args.git_sha), "prefix": args.prefix, "chunk": args.chunk,
           "launcher_defaults": defaults, "rows": [], "channel_rows": []}

    def save():
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1, default=str)

    t_start = time.time()
    warm = start_warm(args) if args.warm > 0 else []
    sc = self_check()
    res["reference_self_check"] = sc
    print(f"chunked float64 reference vs extend_attention_ref: {sc:.1e}", flush=True)
    assert sc < 1e-12, "chunked reference disagrees with extend_attention_ref"
    for w in warm:  # before any timing: the compiling processes share the GPU
        w.wait()
    if warm:
        res["warm_s"] = round(time.time() - t_start, 1)
        print(f"compiled in {args.warm} processes: {res['warm_s']} s", flush=True)
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
    print(f"BF16 SDPA over {keys} keys (ms): default {sd.get('default')} (backend {sd.get('default_backend')}), "
          f"cuDNN {sd.get('cudnn')}, flash {sd.get('flash')}\n"
          f"default SDPA kernels: {sd.get('default_kernels')}", flush=True)
    save()
    for layout in ("token",) + (() if args.no_channel else ("channel",)):
        rows_sel = [v for v in sel if layout == "token" or v[0] in CHANNEL]
        if not rows_sel:
            continue
        inputs = make_inputs(args.prefix, args.chunk, layout)
        q = inputs[0]
        qs = (q.float() * SHARP).to(q.dtype)
        refs = (reference_f64(*inputs), reference_f64(qs, *inputs[1:]))
        need16 = any(v[0] in FP16_CHECK or v[1] == "quant16" for v in rows_sel)
        inputs16 = tuple(x.half() if torch.is_tensor(x) and x.dtype == torch.bfloat16 else x for x in inputs) \
            if need16 else None
        ref16 = reference_f64(*inputs16) if need16 else None
        dense = dense_refs = None
        if layout == "token" and any(v[1] == "dense" for v in rows_sel):
            g = torch.Generator(device="cuda").manual_seed(7)
            npad = -(-n2 // 128) * 128
            dense = tuple(torch.randn(1, HKV, npad, D, device="cuda", dtype=torch.bfloat16, generator=g) * 0.3
                          for _ in range(2))
            dense_refs = (reference_f64(*inputs, prefix=dense), reference_f64(qs, *inputs[1:], prefix=dense))
        rows = res["rows"] if layout == "token" else res["channel_rows"]
        for name, kind, kw in rows_sel:
            fp16 = (name in FP16_CHECK and kind == "quant") or kind == "quant16"
            r = run_variant(name, kind, kw, inputs, dense_refs if kind == "dense" else refs, args.reps,
                            dense=dense, inputs16=inputs16 if fp16 else None, ref16=ref16 if fp16 else None)
            r["layout"] = layout
            rows.append(r)
            print(f"[{layout}] {name} ({time.time() - t_start:.0f} s): " +
                  json.dumps({k: v for k, v in r.items() if k not in ("variant", "kwargs")}), flush=True)
            save()
        del inputs, refs, inputs16, ref16, dense, dense_refs
        torch.cuda.empty_cache()
    sdl = ", ".join(f"{k} {sd[k]:.3f}" for k in ("default", "cudnn", "flash", "efficient") if sd.get(k))
    lines = [f"Extend probe: chunk {args.chunk} over a {args.prefix}-token prefix ({n2} 2-bit + "
             f"{min(args.prefix, W16)} 16-bit), {HQ}/{HKV} heads, d={D}, bf16; cold L2, CUDA graph, median of "
             f"{args.reps}. BF16 SDPA over {keys} keys, non-causal (ms): {sdl}; the default backend is "
             f"{sd.get('default_backend')}. Budgets: 1e-2 (bf16), 2e-3 (fp16). TFLOP/s counts our causal work "
             f"({flops / 1e12:.3f} TFLOP; SDPA does {flops_sdpa / 1e12:.3f}). `dense` rows: bfloat16 prefix, no "
             f"quantization (checked against attention over it).",
             f"Launcher defaults: `{json.dumps(defaults)}`", "", "Token pages:", "", HEAD]
    lines += [fmt_row(r, sd, flops) for r in res["rows"]]
    if res["channel_rows"]:
        lines += ["", "Keys in channel pages:", "", HEAD] + [fmt_row(r, sd, flops) for r in res["channel_rows"]]
    ok = [r for r in res["rows"] if r.get("ok") and r["kind"] == "quant"]
    if ok:
        best = min(ok, key=lambda r: r["ms"])
        res["best"] = best["variant"]
        xs = ", ".join(f"{best['ms'] / sd[k]:.2f} x {k}" for k in ("cudnn", "flash", "default") if sd.get(k))
        lines += ["", f"Fastest correct quantized variant: {best['variant']} `{json.dumps(best['kwargs'])}` "
                  f"{best['ms']:.3f} ms = {xs} (target <= 1.5)"]
    md = "\n".join(lines)
    print("\n" + md, flush=True)
    res["wall_s"] = round(time.time() - t_start, 1)
    save()
    if args.out:
        with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
            f.write(md + "\n")
    return 0 if all(r.get("ok") for r in res["rows"] + res["channel_rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
