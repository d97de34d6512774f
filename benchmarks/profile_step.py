"""Where a decode step's time goes on the GPU: per-kernel times of one CUDA-graph decode step of the engine
(random-weight Qwen3 shapes, pools filled with random K/V like ``oscarkv bench``), grouped by kernel, next to
the graph replay time and the physical floor.

    PYTHONPATH=. python3 benchmarks/profile_step.py --contexts 32768,131072 --gemv cublas,triton --out profile.json
    PYTHONPATH=. python3 benchmarks/profile_step.py --contexts 32768,102400 --gemv auto --pdl off,on

The kernel times come from torch.profiler (CUPTI) over graph replays; "gaps" is replay time minus the summed
kernel time (launch latency between the graph's nodes, idle tails). With ``--pdl on`` kernels overlap (a
programmatic dependent starts while its predecessor drains), so the summed kernel time can exceed the replay
time (negative gaps) and per-kernel times include the time a kernel spends waiting for its predecessor.
Each group is marked "ours" (Triton / CUDA kernels of this project, able to take part in PDL) or "torch"
(elementwise, index, copy, embedding, cuBLAS: ordinary launches that break a PDL chain).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from collections import defaultdict

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from oscarkv.cli import bench  # noqa: E402


OURS = (("oscar_decode_split", "oscar decode split (cuda)"), ("oscar_decode_merge", "oscar merge (cuda)"),
        ("_gemv_", "gemv (triton)"), ("_embed_rope", "embed + rope (triton)"), ("_qk_prep", "qk_prep (triton)"),
        ("_paged_decode", "bf16 decode split (triton)"), ("_merge_kernel", "bf16 decode merge (triton)"),
        ("_rmsnorm", "rmsnorm (triton)"), ("_silu_mul", "silu_mul (triton)"), ("decode_", "decode (triton)"))
TORCH = (("gemv", "gemv (cublas)"), ("gemm", "gemm (cublas)"), ("nvjet", "gemm (cublas nvjet)"),
         ("cutlass", "gemm (cutlass)"), ("index", "index/scatter (torch)"), ("embedding", "embedding (torch)"),
         ("elementwise", "elementwise (torch)"), ("reduce", "reduce (torch)"), ("copy", "copy (torch)"),
         ("cat", "cat (torch)"))


def short(name: str) -> str:
    """A readable group for a kernel name (cuBLAS GEMV/GEMM, our Triton/CUDA kernels, torch elementwise)."""
    n = name.lower()
    for key, label in OURS + TORCH:
        if key in n:
            return label
    return name[:60]


def origin(name: str) -> str:
    """"ours" (can be a programmatic dependent launch) or "torch" (anything else in the graph)."""
    n = name.lower()
    return "ours" if any(key in n for key, _ in OURS) and not any(k in n for k in ("gemm", "nvjet", "cutlass")) \
        else "torch"


def profile_replays(graph, n: int = 5) -> tuple[dict, float]:
    """(per-kernel {name: (calls per replay, total us per replay)}, summed kernel us per replay)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            graph.replay()
        torch.cuda.synchronize()
    per: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type.name != "CUDA":
            continue
        per[ev.name][0] += 1 / n
        per[ev.name][1] += ev.device_time / n if hasattr(ev, "device_time") else ev.cuda_time / n
    return {k: tuple(v) for k, v in per.items()}, sum(v[1] for v in per.values())


def step_profile(model, kv: str, ctx: int, bs: int, replays: int, gemv: str = "cublas", pdl: bool = False) -> dict:
    llm = bench.build(model, kv, bs, ctx, pdl=pdl)
    llm.model.set_gemv(gemv)  # before the graph is captured (time_decode)
    seqs = bench.fill_random(llm, bs, ctx)
    r = bench.time_decode(llm, seqs, replays)
    eng = llm.engine
    graph = eng.graphs[r["graph_batch"]][0]
    kernels, busy = profile_replays(graph)
    groups: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for name, (calls, us) in kernels.items():
        g = groups[short(name)]
        g[0] += calls
        g[1] += us
    floor = (model.weight_bytes() + bench.kv_read_bytes(llm, ctx) * bs) / bench.PEAK_BW * 1e3
    calls = {o: sum(c for k, (c, _) in kernels.items() if origin(k) == o) for o in ("ours", "torch")}
    out = {"kv": kv, "gemv": gemv, "pdl": pdl, "context": ctx, "batch": bs, "graph_ms": r["graph_ms"],
           "floor_ms": floor, "kernel_busy_ms": busy / 1e3, "kernels_per_step": sum(c for c, _ in kernels.values()),
           "launches_ours": calls["ours"], "launches_torch": calls["torch"],
           "groups": {k: {"calls": c, "ms": us / 1e3} for k, (c, us) in sorted(groups.items(), key=lambda x: -x[1][1])},
           "kernels": {k: {"calls": c, "ms": us / 1e3} for k, (c, us) in sorted(kernels.items(), key=lambda x: -x[1][1])}}
    bench.release(llm)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--contexts", default="32768,131072")
    ap.add_argument("--batches", default="1")
    ap.add_argument("--kv", default="bf16,oscar")
    ap.add_argument("--gemv", default="cublas", help="comma-separated: auto, cublas, triton (LLM(gemv=...))")
    ap.add_argument("--pdl", default="on", type=bench.parse_pdl,
                    help="off, on or off,on (LLM(pdl=...)); items may add :SET, a GEMV set of gemv_triton.GEMV_SETS")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--out", default="profile_step.json")
    args = ap.parse_args()
    from oscarkv.engine.model import PRESETS, random_model

    model = random_model(PRESETS[args.model], dtype=torch.bfloat16, device="cuda")
    res = {"provenance": bench.provenance(), "model": args.model, "weight_bytes": model.weight_bytes(), "rows": []}
    for ctx in (int(c) for c in args.contexts.split(",")):
        for bs in (int(b) for b in args.batches.split(",")):
            for kv, gemv, (pdl, gset) in ((k, g, p) for k in args.kv.split(",") for g in args.gemv.split(",")
                                          for p in args.pdl):
                tag = f"{args.model} {kv} gemv={gemv} pdl={bench.variant_name(pdl, gset)} ctx {ctx} bs {bs}"
                try:
                    with bench.gemv_set(model, gset):
                        row = step_profile(model, kv, ctx, bs, args.replays, gemv, pdl)
                    row["gemv_set"] = gset
                except Exception as e:  # one failing configuration must not cost the others' rows
                    print(f"== {tag}: FAILED {type(e).__name__}: {e}")
                    res["rows"].append({"kv": kv, "gemv": gemv, "pdl": pdl, "context": ctx, "batch": bs,
                                        "error": repr(e)})
                    gc.collect()
                    torch.cuda.empty_cache()
                    continue
                res["rows"].append(row)
                print(f"== {tag}: replay {row['graph_ms']:.3f} ms, floor {row['floor_ms']:.3f}, kernels "
                      f"{row['kernel_busy_ms']:.3f} ms busy in {row['kernels_per_step']:.0f} launches ("
                      f"{row['launches_ours']:.0f} ours, {row['launches_torch']:.0f} torch; gaps "
                      f"{row['graph_ms'] - row['kernel_busy_ms']:.3f})")
                for name, g in list(row["groups"].items())[:16]:
                    print(f"   {g['ms']:8.3f} ms  {g['calls']:6.0f}x  {name}")
                with open(args.out, "w") as f:
                    json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
