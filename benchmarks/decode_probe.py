"""Where the CUDA decode kernel's time goes at small batch (Qwen3-8B shapes, the harness of bench_kernels.py:
CUDA-graph replay, cold L2, median): fixed cost against context length, plan and tier choices, and the time of a
layer-after-layer sequence of calls (no L2 flush between them, as in an engine step).

    PYTHONPATH=. python3 benchmarks/decode_probe.py --out decode_probe.json
    PYTHONPATH=. ncu --clock-control none --kernel-name regex:oscar_decode --launch-skip 6 --launch-count 4 \
        --section SpeedOfLight --section WarpStateStats python3 benchmarks/decode_probe.py --ncu 131072x1
    # stall reasons per issued instruction (docs/results/decode_ncu_stalls_131072x1_h200.txt):
    PYTHONPATH=. ncu --clock-control none --kernel-name regex:oscar_decode_split --launch-skip 3 --launch-count 1 \
        --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio \
        python3 benchmarks/decode_probe.py --ncu 131072x1

Experiments (rows of the table):
  sweep       default plan and variant, batch 1 and 8, contexts 4K..128K: the intercept is the fixed cost
  harness     an empty-ish graph (one 1-element fill) under the same timing: the harness's own floor
  ppsm=N      programs per multiprocessor of the plan (the split count)
  tiers       both tiers in one launch (f) or one launch per tier (s); merge kernel or fused last-CTA merge
  no16        the 16-bit tier empty (len16 = 0: its programs exit at once)
  page1       one 2-bit page per sequence (the kernel's fixed cost with the same grid)
  chain=N     N calls on N different caches in one graph, no flush between them: time per call
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks.bench_kernels import HQ, HKV, D, PS, W16, decode_bytes, make_cache, provenance, timeit  # noqa: E402
from oscarkv.kernels.decode_cuda import decode_attention_cuda  # noqa: E402
from oscarkv.kernels.plan import DecodePlan  # noqa: E402


def run_case(batch: int, ctx: int, *, ppsm=None, variant=None, fused=None, merge="kernel", no16=False,
             page1=False, chain=1, reps=30) -> dict:
    caches = [make_cache(batch, ctx, seed=i) for i in range(chain)]
    outs = []
    fns = []
    for q, kp, vp, bt, qlen, k16, v16, len16, n2 in caches:
        if no16:
            len16.zero_()
        if page1:
            qlen.fill_(PS)
        plan = DecodePlan(batch, HQ, HKV, D, PS, bt.shape[1], W16, device="cuda",
                          **({"programs_per_sm": ppsm} if ppsm else {})).update(batch, PS if page1 else None)
        out = torch.empty(batch, HQ, D, device="cuda", dtype=torch.bfloat16)
        outs.append(out)
        kw = {"merge": merge}
        if fused is not None:
            kw["fused"] = fused
        if variant is not None:
            kw["variant"] = variant
        fns.append((lambda q=q, kp=kp, vp=vp, bt=bt, qlen=qlen, k16=k16, v16=v16, len16=len16, plan=plan, out=out:
                    decode_attention_cuda(q, kp, vp, bt, qlen, k16, v16, len16, plan=plan, out=out, **kw)))
        splits = plan.num_splits

    def fn():
        for f in fns:
            f()

    ms = timeit(fn, reps=reps) / chain
    n2 = caches[0][-1]
    nbytes = decode_bytes(batch, PS if page1 else n2, 0 if no16 else min(ctx, W16))
    del caches
    torch.cuda.empty_cache()
    return {"ms": ms, "TBps": nbytes / ms / 1e9, "splits": splits}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="decode_probe.json")
    ap.add_argument("--git-sha", default=os.environ.get("OSCARKV_GIT_SHA", "unknown"))
    ap.add_argument("--ncu", default="", help="BxC: only run that shape a few times (for ncu)")
    args = ap.parse_args()
    if args.ncu:
        ctx, b = (int(x) for x in args.ncu.lower().split("x"))
        for v in (None, "subn+lazy+cpa"):  # the few-unit default, then cpa
            q, kp, vp, bt, qlen, k16, v16, len16, n2 = make_cache(b, ctx)
            plan = DecodePlan(b, HQ, HKV, D, PS, bt.shape[1], W16, device="cuda").update(b)
            for _ in range(4):
                decode_attention_cuda(q, kp, vp, bt, qlen, k16, v16, len16, plan=plan, variant=v)
            torch.cuda.synchronize()
        return 0
    rows = []

    def add(name, batch, ctx, **kw):
        try:
            r = run_case(batch, ctx, **kw)
        except Exception as e:  # one failing case must not hide the others
            r = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        r.update(name=name, batch=batch, context=ctx)
        rows.append(r)
        print(f"{name:28s} bs {batch:3d} ctx {ctx:7d}: " + (f"{r['ms'] * 1e3:8.1f} us  {r['TBps']:5.2f} TB/s  "
              f"splits {r['splits']}" if "ms" in r else r["error"]), flush=True)

    flat = torch.empty(1, device="cuda")
    rows.append({"name": "harness", "ms": timeit(lambda: flat.fill_(1.0))})
    print(f"harness (one fill): {rows[-1]['ms'] * 1e3:.1f} us")
    for b in (1, 8):
        for ctx in (4096, 16384, 32768, 65536, 131072):
            add("sweep", b, ctx)
    for b in (1, 8):
        ctx = 131072
        for ppsm in (2, 3, 6, 8):
            add(f"ppsm={ppsm}", b, ctx, ppsm=ppsm)
        add("tiers s", b, ctx, fused=False)
        add("tiers f", b, ctx, fused=True)
        add("merge fused", b, ctx, merge="fused")
        add("no16", b, ctx, no16=True)
        add("page1", b, ctx, page1=True)
        add("pdl (merge)", b, ctx, variant=("subn+lazy+l2pf+pdl" if b == 1 else "subn+lazy+cpa+pdl"))
        add("cpa", b, ctx, variant="subn+lazy+cpa")
        add("l2pf", b, ctx, variant="subn+lazy+l2pf")
        add("chain=8", b, ctx, chain=8)
    add("chain=8", 1, 102400, chain=8)
    add("sweep", 1, 102400)
    res = {"provenance": provenance(args.git_sha), "rows": rows}
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
