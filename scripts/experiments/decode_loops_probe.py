"""The CUDA decode kernel's two quantized-tier loops for 2-bit formats, and token2 against an earlier checkout with
more interleaved rounds than benchmarks/bench_kernels.py takes (a GPU is needed).

    python scripts/experiments/decode_loops_probe.py BEFORE_DIR OUT.json [--ab]

BEFORE_DIR holds an earlier checkout's package as ``oscarkv_before`` (as ``bench_kernels.py --before``). With
``--ab``: token2/token2 decode, ours against before, six rounds in alternating order, 40 cold-L2 graph replays
each (median per round). Then, at 32K and 128K with batch 1 and 8 (8 and 64 (sequence, KV head) pairs):
token2/token2 and channel2/token2 through each loop (``default``: the loop ``decode_cuda`` picks; ``reg_l2``: the
register-prefetch loop with the L2 prefetch; ``cpa_l2`` / ``cpa_nol2``: the cp.async page stages with / without
it; forced by replacing ``decode_cuda._register_loop`` and ``FEW_UNITS`` for the call), the best of three medians
of 50 cold-L2 replays. Every configuration is checked against the float64 reference before it is timed.
"""
import importlib.util
import json
import sys
import time
from pathlib import Path

import torch

from oscarkv.kernels import decode_cuda as dc
from oscarkv.kernels import dispatch
from oscarkv.kernels.plan import DecodePlan

_spec = importlib.util.spec_from_file_location(
    "bench_kernels", Path(__file__).resolve().parents[2] / "benchmarks" / "bench_kernels.py")
bk = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bk)

res = {"gpu": torch.cuda.get_device_name(), "ab": [], "few": []}
before = bk.load_before(sys.argv[1])
bk.prebuild_all(["token2/token2", "channel2/token2"], before)


def ab(batch, ctx, rounds=6):
    q, kp, vp, bt, qlen, k16, v16, len16, n2 = bk.make_cache("token2/token2", batch, ctx)
    out = torch.empty(batch, bk.HQ, bk.D, device="cuda", dtype=torch.bfloat16)
    out_b = torch.empty_like(out)
    plan = DecodePlan(batch, bk.HQ, bk.HKV, bk.D, bk.PS, bt.shape[1], bk.W16, device="cuda").update(batch)
    dcb, pcls = before
    plan_b = pcls(batch, bk.HQ, bk.HKV, bk.D, bk.PS, bt.shape[1], bk.W16, device="cuda").update(batch)
    def ours():
        return dispatch.decode_attention(q, kp, vp, bt, qlen, k16, v16, len16, plan=plan, out=out)

    def bef():
        return dcb.decode_attention_cuda(q, kp, vp, bt, qlen, k16, v16, len16, plan=plan_b, out=out_b)

    ours()
    bef()
    e1 = bk.check_decode(out, q, kp, vp, bt, qlen, k16, v16, len16)
    e2 = bk.check_decode(out_b, q, kp, vp, bt, qlen, k16, v16, len16)
    if max(e1, e2) >= bk.DECODE_BUDGET:
        raise SystemExit(f"decode check failed at {batch}x{ctx}: relative errors {e1:.2e} / {e2:.2e}")
    t = {"ours": [], "before": []}
    for r in range(rounds):
        for name, fn in (("ours", ours), ("before", bef)) if r % 2 == 0 else (("before", bef), ("ours", ours)):
            t[name].append(bk.timeit(fn, reps=40))
    row = {"batch": batch, "ctx": ctx, "err": [e1, e2], "splits": [plan.num_splits, plan_b.num_splits], **t}
    row["ratio_median"] = sorted(t["ours"])[rounds // 2] / sorted(t["before"])[rounds // 2]
    row["ratio_min"] = min(t["ours"]) / min(t["before"])
    print(f"AB {batch}x{ctx}: ours {sorted(t['ours'])} before {sorted(t['before'])} "
          f"median ratio {row['ratio_median']:.3f} min ratio {row['ratio_min']:.3f} err {e1:.1e} {e2:.1e}",
          flush=True)
    res["ab"].append(row)
    torch.cuda.empty_cache()


def few(name, batch, ctx, mode, pps=None):
    orig_reg, orig_few = dc._register_loop, dc.FEW_UNITS
    if mode == "reg_l2":  # the register loop with the L2 prefetch, at any count of pairs
        dc._register_loop = lambda k, v, u: k.bits == 2 and v.bits == 2
        dc.FEW_UNITS = 1 << 20
    elif mode == "cpa_l2":
        dc._register_loop = lambda k, v, u: False
        dc.FEW_UNITS = 1 << 20
    elif mode == "cpa_nol2":
        dc._register_loop = lambda k, v, u: False
        dc.FEW_UNITS = 0
    try:
        q, kp, vp, bt, qlen, k16, v16, len16, n2 = bk.make_cache(name, batch, ctx)
        out = torch.empty(batch, bk.HQ, bk.D, device="cuda", dtype=torch.bfloat16)
        plan = DecodePlan(batch, bk.HQ, bk.HKV, bk.D, bk.PS, bt.shape[1], bk.W16, device="cuda",
                          programs_per_sm=pps).update(batch)
        def fn():
            return dc.decode_attention_cuda(q, kp, vp, bt, qlen, k16, v16, len16, plan=plan, out=out)

        fn()
        err = bk.check_decode(out, q, kp, vp, bt, qlen, k16, v16, len16)
        if err >= bk.DECODE_BUDGET:
            raise SystemExit(f"decode check failed for {name} {batch}x{ctx} {mode}: relative error {err:.2e}")
        ts = [bk.timeit(fn, reps=50) for _ in range(3)]
        nbytes = bk.decode_bytes(name, batch, n2, min(ctx, bk.W16))
        row = {"format": name, "batch": batch, "ctx": ctx, "mode": mode, "pps": pps, "splits": plan.num_splits,
               "ms": min(ts), "runs": ts, "bytes": nbytes, "err": err}
        print(f"FEW {name} {batch}x{ctx} {mode} pps={pps} splits={plan.num_splits}: {min(ts):.4f} ms "
              f"({nbytes / min(ts) / 1e6:.0f} GB/s) runs {['%.4f' % x for x in ts]} err {err:.1e}", flush=True)
        res["few"].append(row)
    finally:
        dc._register_loop, dc.FEW_UNITS = orig_reg, orig_few


t0 = time.time()
if "--ab" in sys.argv:
    for b, c in ((64, 131072), (8, 131072), (64, 32768)):
        ab(b, c)
for ctx in (32768, 131072):
    for batch in (1, 8):
        for name in ("token2/token2", "channel2/token2"):
            for mode in ("default", "reg_l2", "cpa_l2", "cpa_nol2"):
                few(name, batch, ctx, mode)
print(f"probe took {time.time() - t0:.0f} s")
Path(sys.argv[2]).write_text(json.dumps(res, indent=1))
