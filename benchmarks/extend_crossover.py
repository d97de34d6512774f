"""Extend over a quantized prefix: the fused Triton kernel (``fold="fused"``, nothing materialised) against the
cuDNN fold (``fold="sdpa"``: the prefix dequantized segment by segment into a bounded workspace, cuDNN attention
with its log-sum-exp, a merge) across chunk lengths, prefix lengths and batch sizes, next to BF16 cuDNN SDPA over
the same keys (non-causal, as ``bench_kernels.bench_extend``). It picks ``extend_sdpa.min_chunk``, the chunk
length from which the launcher's default takes the cuDNN fold.

Qwen3-8B attention shapes (32 / 8 heads, d 128, page 64), bfloat16, random pages (``bench_kernels.make_cache``:
``prefix - 320`` 2-bit tokens + 320 16-bit). Each row also reports the relative difference between the two folds
(both within the tested budgets of float64 attention; a large value here means a broken row, not a slow one).
Timing: ``bench_kernels.timeit`` (CUDA graph, cold L2, median of ``--reps``); the cuDNN fold is given the host
lengths, so it is graph-capturable; ``eager`` times it without the graph (its ~8 launches per sequence from
Python). Writes JSON and a markdown table.

    PYTHONPATH=. python benchmarks/extend_crossover.py --out $OUT/extend_crossover_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench_kernels import D, HKV, HQ, make_cache, provenance, timeit  # noqa: E402

from oscarkv.kernels import extend_sdpa  # noqa: E402
from oscarkv.kernels.extend_triton import extend_attention_triton  # noqa: E402


def row(batch: int, prefix: int, chunk: int, reps: int) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    _, kp, vp, bt, qlen, k16, v16, len16, n2 = make_cache(batch, prefix)
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(batch, chunk, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
    kn = torch.randn(batch, chunk, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    vn = torch.randn(batch, chunk, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    args = (q, kn, vn, kp, vp, bt, qlen, k16, v16, len16)
    hl = (qlen.tolist(), len16.tolist())
    r = {"batch": batch, "prefix": prefix, "chunk": chunk}
    fused = lambda: extend_attention_triton(*args, fold="fused")  # noqa: E731
    cud = lambda: extend_attention_triton(*args, fold="sdpa", host_lengths=hl)  # noqa: E731
    try:
        a, b = fused(), cud()
        r["fold_rel_diff"] = ((a.float() - b.float()).norm() / b.float().norm()).item()
        r["fused_ms"] = timeit(fused, reps=reps)
        r["sdpa_ms"] = timeit(cud, reps=reps)
        r["sdpa_eager_ms"] = timeit(cud, reps=reps, graph=False)
    except Exception as e:  # one failing row must not hide the rest
        r["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    qs = q.transpose(1, 2)
    ks = torch.randn(batch, HKV, prefix + chunk, D, device="cuda", dtype=torch.bfloat16, generator=g)

    def base():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return torch.nn.functional.scaled_dot_product_attention(qs, ks, ks, enable_gqa=True)
    try:
        r["bf16_cudnn_ms"] = timeit(base, reps=reps)
    except Exception as e:
        r["bf16_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    del args, ks
    torch.cuda.empty_cache()
    return r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefixes", default="8192,32768,131072")
    ap.add_argument("--chunks", default="16,64,128,256,512,2048")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--git-sha", default=os.environ.get("OSCARKV_GIT_SHA", "unknown"))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    res = {"provenance": provenance(args.git_sha), "min_chunk": {b: extend_sdpa.min_chunk(b) for b in (1, 2, 4, 8)},
           "segment_tokens": extend_sdpa.SEGMENT_TOKENS, "rows": []}
    for batch in map(int, args.batches.split(",")):
        for prefix in map(int, args.prefixes.split(",")):
            for chunk in map(int, args.chunks.split(",")):
                if batch * (prefix + chunk) > 140_000:  # the batch rows at the short prefixes only
                    continue
                res["rows"].append(row(batch, prefix, chunk, args.reps))
                print(json.dumps(res["rows"][-1]), flush=True)
    lines = [f"Provenance: {json.dumps(res['provenance'])}", "",
             f"Extend, fused (`fold=\"dequant\"`) vs cuDNN fold (`fold=\"sdpa\"`, segments of "
             f"{res['segment_tokens']} tokens); the launcher's default takes the cuDNN fold from these chunk "
             f"tokens per batch size: {res['min_chunk']}. CUDA graph, cold L2, median (ms).", "",
             "| batch | prefix | chunk | fused | sdpa | sdpa eager | BF16 cuDNN | fused / BF16 | sdpa / BF16 | "
             "sdpa vs fused rel. diff |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    f = lambda x: "n/a" if x is None else f"{x:.4f}"  # noqa: E731
    for r in res["rows"]:
        bf = r.get("bf16_cudnn_ms")
        rat = lambda k: "n/a" if not bf or r.get(k) is None else f"{r[k] / bf:.2f}x"  # noqa: E731
        lines.append(f"| {r['batch']} | {r['prefix']} | {r['chunk']} | {f(r.get('fused_ms'))} | {f(r.get('sdpa_ms'))} "
                     f"| {f(r.get('sdpa_eager_ms'))} | {f(bf)} | {rat('fused_ms')} | {rat('sdpa_ms')} | "
                     f"{r.get('fold_rel_diff', r.get('error', ''))} |")
    md = "\n".join(lines) + "\n"
    print(md)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as fh:
            json.dump(res, fh, indent=1)
        with open(os.path.splitext(args.out)[0] + ".md", "w") as fh:
            fh.write(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
