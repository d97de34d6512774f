"""The engine's decode GEMV (``gemv_triton.gemv``) against cuBLAS (``F.linear``) at the decode projections of
Qwen3-8B and Qwen3-4B, M = 1, 4, 8 rows, bfloat16, cold L2 (``bench_kernels.timeit``: CUDA-graph replays, a
256 MiB write before each, median). TB/s counts weight + input + output bytes.

Three numbers per shape: the plain GEMV (heuristic config) vs ``F.linear``; the GEMV as the model fuses it
(RMSNorm or SiLU-gate prologue, bias, residual epilogue) vs cuBLAS plus the separate Triton op it replaces; and
with ``--sweep`` the best of a list of tilings (printed as ``GEMV_CONFIGS`` entries to paste into
``oscarkv/kernels/gemv_triton.py``).

    PYTHONPATH=. python3 benchmarks/gemv_probe.py --sweep --out gemv_probe.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench_kernels import READ_CEILING_TBS, timeit  # noqa: E402

from oscarkv.kernels import dense_triton, gemv_triton  # noqa: E402
from oscarkv.engine.model import PRESETS  # noqa: E402
from oscarkv.kernels.gemv_triton import GemvConfig  # noqa: E402


def shapes(name: str) -> list[tuple[str, int, int, str]]:
    """(projection, N, K, fusion as in Block.forward_gemv) of one preset."""
    c = PRESETS[name]
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return [("qkv", q + 2 * kv, c.hidden_size, "norm"), ("o_proj", c.hidden_size, q, "residual"),
            ("gate_up", 2 * c.intermediate_size, c.hidden_size, "norm"),
            ("down", c.hidden_size, c.intermediate_size, "silu+residual"),
            ("lm_head", c.vocab_size, c.hidden_size, "norm")]


def sweep_configs(M: int) -> list[GemvConfig]:
    """Tilings to time: "fma" (one row only: block_k = 256 or 512 per warp; split-K over 2 / 4 / 12 slices of
    K, clamped to the K tiles there are) and "dot" (any rows)."""
    fma = [(8, 1024, 4, 1), (16, 1024, 4, 1), (32, 1024, 4, 1), (64, 1024, 4, 1), (16, 2048, 8, 1), (32, 2048, 8, 1),
           (16, 512, 2, 1), (32, 512, 2, 1), (16, 1024, 8, 1), (32, 1024, 4, 2)] if M == 1 else []
    split = [(16, 1024, 4, 1, 2), (16, 1024, 4, 1, 4), (16, 1024, 4, 1, 12), (8, 1024, 4, 1, 2),
             (32, 1024, 4, 1, 4), (16, 512, 4, 1, 8)] if M == 1 else []
    dot = [(16, 128, 4, 4), (16, 256, 4, 3), (16, 256, 4, 4), (16, 512, 4, 3), (16, 256, 8, 4), (32, 128, 4, 4),
           (32, 256, 4, 3), (64, 128, 4, 3), (64, 128, 8, 4)]
    return ([GemvConfig("fma", *c) for c in fma] + [GemvConfig("fma", *c[:4], split_k=c[4]) for c in split]
            + [GemvConfig("dot", *c) for c in dot])


def tbs(nbytes: float, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e12


def probe_shape(M: int, N: int, K: int, fusion: str, sweep: bool, budget: dict) -> dict:
    """One shape; ``budget["left_s"]``: sweep seconds left (shared by all shapes, decremented here)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(N, K, device="cuda", generator=g).mul_(0.02).bfloat16()
    x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
    nbytes = (N * K + M * K + M * N) * 2
    row = {"M": M, "N": N, "K": K, "weight_mb": N * K * 2 / 1e6}
    row["cublas_ms"] = timeit(lambda: F.linear(x, w))
    cfg = gemv_triton.gemv_config(M, N, K)
    row["triton_config"] = repr(cfg)
    row["triton_ms"] = timeit(lambda: gemv_triton.gemv(x, w))
    row["cublas_tbs"], row["triton_tbs"] = tbs(nbytes, row["cublas_ms"]), tbs(nbytes, row["triton_ms"])
    # as the model runs it (fused) vs cuBLAS + the separate op (Block.forward)
    nw = (torch.rand(K, device="cuda", generator=g) + 0.5).bfloat16()
    res = torch.randn(M, N, device="cuda", generator=g).bfloat16()
    if fusion == "norm":
        fused = lambda: gemv_triton.gemv(x, w, norm=nw)  # noqa: E731
        unfused = lambda: F.linear(dense_triton.rmsnorm(x, nw, 1e-6, x)[0], w)  # noqa: E731  (norm with residual add)
    elif fusion == "residual":
        fused = lambda: gemv_triton.gemv(x, w, residual=res)  # noqa: E731
        unfused = lambda: F.linear(x, w)  # noqa: E731  (the add runs inside the next RMSNorm)
    else:
        gu = torch.randn(M, 2 * K, device="cuda", generator=g).bfloat16()
        fused = lambda: gemv_triton.gemv(gu, w, act="silu", residual=res)  # noqa: E731
        unfused = lambda: F.linear(dense_triton.silu_mul(gu), w)  # noqa: E731
    row["fusion"] = fusion
    row["fused_ms"], row["unfused_ms"] = timeit(fused), timeit(unfused)
    err = (gemv_triton.gemv(x, w).float() - F.linear(x.float(), w.float())).abs().max().item()
    row["max_abs_err_vs_fp32"] = err
    if sweep:
        best = (row["triton_ms"], repr(cfg))
        tried = []
        for c in sweep_configs(M):
            if budget["left_s"] <= 0:
                row["sweep_truncated"] = True
                break
            t = time.monotonic()
            try:
                ms = timeit(lambda: gemv_triton.gemv(x, w, config=c))
            except Exception as e:  # a tiling that does not compile or fit: skip it, keep the reason
                tried.append({"config": repr(c), "error": f"{type(e).__name__}: {str(e)[:120]}"})
                continue
            finally:
                budget["left_s"] -= time.monotonic() - t
            tried.append({"config": repr(c), "ms": ms, "tbs": tbs(nbytes, ms)})
            if ms < best[0]:
                best = (ms, repr(c))
        row["sweep"] = tried
        row["best_ms"], row["best_config"] = best
        row["best_tbs"] = tbs(nbytes, best[0])
    del w, x
    torch.cuda.empty_cache()
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--models", default="qwen3-8b,qwen3-4b")
    ap.add_argument("--rows", default="1,4,8")
    ap.add_argument("--sweep", action="store_true", help="also time a list of tilings (first model only)")
    ap.add_argument("--sweep-budget-s", type=float, default=300.0, help="seconds of sweeping in all (then stop)")
    ap.add_argument("--out", default="gemv_probe.json")
    args = ap.parse_args()
    t0 = time.monotonic()
    budget = {"left_s": args.sweep_budget_s}
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "ceiling_tbs": READ_CEILING_TBS,
           "rows": []}
    import triton

    res["triton"] = triton.__version__
    suggestions = {}
    models = args.models.split(",")
    for name in models:
        layers = PRESETS[name].num_layers
        for M in (int(m) for m in args.rows.split(",")):
            step = {"cublas": 0.0, "triton": 0.0, "fused": 0.0, "unfused": 0.0}
            print(f"== {name} M={M}: {'proj':8s} {'N':>6s} {'K':>6s} | cublas us TB/s | triton us TB/s | "
                  f"fused vs cublas+op us | max err vs fp32 | best (sweep)")
            for proj, N, K, fusion in shapes(name):
                try:
                    row = probe_shape(M, N, K, fusion, args.sweep and name == models[0], budget)
                except Exception as e:  # report and go on: the other shapes still tell something
                    print(f"   {proj:8s} {N:6d} {K:6d} | FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                    res["rows"].append({"model": name, "proj": proj, "M": M, "N": N, "K": K, "error": repr(e)})
                    torch.cuda.empty_cache()
                    continue
                row.update(model=name, proj=proj)
                res["rows"].append(row)
                n = 1 if proj == "lm_head" else layers
                for k in step:
                    step[k] += n * row[f"{k}_ms"]
                best = ""
                if "best_ms" in row:
                    best = f"{row['best_ms'] * 1e3:7.1f} us {row['best_tbs']:.2f} TB/s {row['best_config']}"
                    mp = gemv_triton._p2(M)
                    if row["best_config"] != row["triton_config"]:
                        suggestions[(mp, N, K)] = row["best_config"]
                print(f"   {proj:8s} {N:6d} {K:6d} | {row['cublas_ms'] * 1e3:7.1f} {row['cublas_tbs']:.2f} | "
                      f"{row['triton_ms'] * 1e3:7.1f} {row['triton_tbs']:.2f} | {row['fused_ms'] * 1e3:7.1f} vs "
                      f"{row['unfused_ms'] * 1e3:7.1f} | err {row['max_abs_err_vs_fp32']:.1e} | {best}", flush=True)
            print(f"   per step ({layers} layers + lm_head): cublas {step['cublas']:.3f} ms, triton {step['triton']:.3f}"
                  f" ms; as fused in the model {step['fused']:.3f} ms vs cublas + separate ops {step['unfused']:.3f} ms")
            res.setdefault("per_step_ms", {})[f"{name}/M{M}"] = step
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1)
    if suggestions:
        print("GEMV_CONFIGS entries (paste into oscarkv/kernels/gemv_triton.py; key = (padded rows, N, K)):")
        for k, v in sorted(suggestions.items()):
            print(f"    {k}: {v},")
    res["suggestions"] = {str(k): v for k, v in suggestions.items()}
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"wrote {args.out} in {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
