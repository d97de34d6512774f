"""Programmatic dependent launch (PDL) on a chain of the Qwen3-8B decode layer's kernels (issue 6).

One row, bfloat16, 36 layers with distinct random weights (13.9 GB: every weight byte comes from HBM, cold),
the whole chain captured in one CUDA graph and replayed, pdl off vs on, for a few GEMV configuration sets:

    gemv:   36 x [qkv (RMSNorm prologue), o_proj (+ residual), gate_up (RMSNorm), down (SiLU gate + residual)]
    layer:  36 x [qkv, qk_prep (K/V into a BF16 pool), paged BF16 decode split + merge over --ctx tokens,
                  o_proj, gate_up, down]   (the engine's BF16 decode layer, seven kernels)

Config sets ("default": the engine's heuristic for every projection; "splitk*": GemvConfig.split_k on the
small projections, gate_up unchanged). Printed per chain: ms per replay, us per layer, weight bytes / time
(TB/s), ratio to the weight floor (weight bytes / 4.7 TB/s), and the pdl gain. The step's other kernels
(prologue, lm_head) are not in the chain; ``bench_e2e.py --pdl off,on`` times the whole step.

    PYTHONPATH=. python3 benchmarks/pdl_probe.py --out pdl_probe.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from oscarkv.cli.bench import PEAK_BW, provenance  # noqa: E402
from oscarkv.kernels import dense_triton, gemv_triton  # noqa: E402
from oscarkv.kernels import dispatch as ops  # noqa: E402
from oscarkv.engine.model import PRESETS  # noqa: E402
from oscarkv.kernels.gemv_triton import GemvConfig  # noqa: E402

PROJ = ("qkv", "o_proj", "gate_up", "down")


def config_sets() -> dict[str, dict[str, GemvConfig | None]]:
    """Named GEMV configurations per projection (None: ``gemv_triton.gemv_config``'s choice)."""
    return gemv_triton.GEMV_SETS


class Layers:
    """Weights of ``n`` layers (distinct tensors) and the static buffers of the chain."""

    def __init__(self, preset: str, n: int, ctx: int, seed: int = 0, device: str = "cuda",
                 dtype: torch.dtype = torch.bfloat16):
        c = PRESETS[preset]
        self.c, self.n, self.ctx = c, n, ctx
        dev, bf = device, dtype
        g = torch.Generator(device=dev).manual_seed(seed)
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.shapes = {"qkv": (q + 2 * kv, c.hidden_size), "o_proj": (c.hidden_size, q),
                       "gate_up": (2 * c.intermediate_size, c.hidden_size), "down": (c.hidden_size, c.intermediate_size)}
        self.w = [{p: torch.empty(*self.shapes[p], dtype=bf, device=dev).normal_(0, 0.02, generator=g) for p in PROJ}
                  for _ in range(n)]
        self.norms = [(torch.rand(c.hidden_size, device=dev, generator=g) + 0.5).to(bf) for _ in range(2)]
        self.qk_norm = (torch.rand(c.head_dim, device=dev, generator=g) + 0.5).to(bf)
        self.x0 = torch.randn(1, c.hidden_size, device=dev, generator=g).to(bf)
        d, P = c.head_dim, 64
        ang = torch.rand(1, d // 2, device=dev, generator=g) * 100
        self.cos, self.sin = (f(torch.cat([ang, ang], -1)).to(bf) for f in (torch.cos, torch.sin))
        pages = -(-(ctx + 1) // P)
        self.kv = [torch.empty(2, pages + 1, c.num_kv_heads, P, d, dtype=bf, device=dev).normal_(0, 0.1, generator=g)
                   for _ in range(n)]
        self.block_table = torch.arange(1, pages + 1, dtype=torch.int32, device=dev)[None]
        self.lens = torch.tensor([ctx + 1], dtype=torch.int32, device=dev)
        kvl = self.kv[0]
        pos = ctx  # the new token's row: page pos // P + 1, row pos % P
        self.off = torch.tensor([(pos // P + 1) * kvl.stride(1) + (pos % P) * kvl.stride(3)], dtype=torch.long,
                                device=dev)
        self.max_len = pages * P

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for lw in self.w for t in lw.values())

    def kv_bytes(self) -> int:  # what the paged decode reads per layer chain
        c = self.c
        return self.n * 2 * (self.ctx + 1) * c.num_kv_heads * c.head_dim * 2

    def chain(self, cfgs: dict, pdl: bool, attn: bool):
        c, eps = self.c, self.c.rms_eps
        q = c.num_heads * c.head_dim

        def run() -> torch.Tensor:
            x = self.x0
            for i, lw in enumerate(self.w):
                qkv = gemv_triton.gemv(x, lw["qkv"], norm=self.norms[0], eps=eps, config=cfgs["qkv"], pdl=pdl)
                if attn:
                    kvl = self.kv[i]
                    dest = ops.KVDest(kvl, self.off, kvl.stride(0), kvl.stride(2))
                    qh, _ = dense_triton.qk_prep(qkv, c.num_heads, c.num_kv_heads, c.head_dim, self.cos, self.sin,
                                               self.qk_norm, self.qk_norm, eps, out=dest, pdl=pdl)
                    o = dense_triton.paged_decode(qh, kvl, self.block_table, self.lens, c.head_dim ** -0.5,
                                                self.max_len, pdl=pdl).reshape(1, -1)
                else:
                    o = qkv[:, :q]  # stands in for the attention output (row stride 6144)
                x = gemv_triton.gemv(o, lw["o_proj"], residual=x, config=cfgs["o_proj"], pdl=pdl)
                gu = gemv_triton.gemv(x, lw["gate_up"], norm=self.norms[1], eps=eps, config=cfgs["gate_up"], pdl=pdl)
                x = gemv_triton.gemv(gu, lw["down"], act="silu", residual=x, config=cfgs["down"], pdl=pdl)
            return x
        return run


def capture(fn):
    if not torch.cuda.is_available():  # CPU smoke test (TRITON_INTERPRET=1): no graph, the function itself
        return fn, fn()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    return g, out


def time_graph(g, replays: int, rounds: int = 5) -> float:
    """Median over ``rounds`` of the mean ms per replay of ``replays`` back-to-back replays."""
    if not torch.cuda.is_available():
        t = time.perf_counter()
        g()
        return (time.perf_counter() - t) * 1e3
    for _ in range(2):
        g.replay()
    torch.cuda.synchronize()
    res = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(replays):
            g.replay()
        b.record()
        b.synchronize()
        res.append(a.elapsed_time(b) / replays)
    return sorted(res)[len(res) // 2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--layers", type=int, default=None, help="default: the model's")
    ap.add_argument("--ctx", type=int, default=4096, help="tokens the layer chain's paged decode reads")
    ap.add_argument("--chains", default="gemv,layer")
    ap.add_argument("--configs", default="default,splitk,splitk1,bn8", help=f"of {list(config_sets())}")
    ap.add_argument("--replays", type=int, default=10)
    ap.add_argument("--budget-s", type=float, default=60.0, help="stop starting new rows after this many seconds")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of this script under TRITON_INTERPRET=1")
    ap.add_argument("--out", default="pdl_probe.json")
    args = ap.parse_args()
    t0 = time.monotonic()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    layers = Layers(args.model, args.layers or PRESETS[args.model].num_layers, args.ctx, device=args.device,
                    dtype=dtype)
    wb = layers.weight_bytes()
    sets = config_sets()
    res = {"provenance": provenance(), "model": args.model, "layers": layers.n, "ctx": args.ctx, "weight_bytes": wb,
           "pdl_available": dense_triton.pdl_available(layers.x0), "peak_bw": PEAK_BW,
           "configs": {k: {p: repr(v) for p, v in sets[k].items()} for k in args.configs.split(",")}, "rows": []}
    print(f"== {args.model}: {layers.n} layers, {wb / 1e9:.2f} GB of weights (floor {wb / PEAK_BW * 1e3:.3f} ms), "
          f"layer chain attends over {args.ctx} tokens; pdl available: {res['pdl_available']}", flush=True)
    print(f"   {'chain':6s} {'configs':8s} {'pdl':3s} | {'ms':>7s} {'us/layer':>8s} {'TB/s':>5s} {'x floor':>7s} | "
          f"pdl gain", flush=True)
    for chain in args.chains.split(","):
        attn = chain == "layer"
        floor = (wb + (layers.kv_bytes() if attn else 0)) / PEAK_BW * 1e3
        ref = {}  # pdl -> the first config set's chain output (split-K sums in another order: close, not equal)
        for name in args.configs.split(","):
            cfgs = sets[name]
            outs = {}
            for pdl in (False, True):
                if time.monotonic() - t0 > args.budget_s:
                    print(f"   (budget of {args.budget_s:.0f} s spent: {chain}/{name}/pdl={pdl} and later rows skipped)")
                    res["truncated"] = True
                    break
                row = {"chain": chain, "configs": name, "pdl": pdl}
                try:
                    g, out = capture(layers.chain(cfgs, pdl, attn))
                    ms = time_graph(g, args.replays)
                    outs[pdl] = out.float().clone()  # the captured output: what the last replay computed
                    del g
                except Exception as e:  # report and go on
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    res["rows"].append(row)
                    print(f"   {chain:6s} {name:8s} {'on' if pdl else 'off':3s} | FAILED {row['error']}", flush=True)
                    continue
                row.update(ms=ms, us_per_layer=ms * 1e3 / layers.n, weight_tbs=wb / (ms * 1e-3) / 1e12,
                           floor_ms=floor, ratio_to_floor=ms / floor)
                gain = ""
                if pdl:
                    off = next((r for r in res["rows"] if r["chain"] == chain and r["configs"] == name
                                and not r["pdl"] and "ms" in r), None)
                    if off is not None:
                        row["saved_ms"] = off["ms"] - ms
                        gain = f"{off['ms'] - ms:+.3f} ms ({ms / off['ms']:.3f}x)"
                    if False in outs:
                        row["out_max_abs_diff_vs_off"] = (outs[True] - outs[False]).abs().max().item()
                        row["out_equal_to_off"] = bool(torch.equal(outs[True], outs[False]))
                        gain += f", output {'bit-equal' if row['out_equal_to_off'] else 'DIFFERS'} vs off"
                ref.setdefault(pdl, outs[pdl])
                if ref[pdl] is not outs[pdl]:
                    rel = ((outs[pdl] - ref[pdl]).norm() / ref[pdl].norm().clamp_min(1e-30)).item()
                    row["out_rel_diff_vs_first_set"] = rel
                    gain += f"; vs {args.configs.split(',')[0]}: rel. diff {rel:.1e}"
                res["rows"].append(row)
                print(f"   {chain:6s} {name:8s} {'on' if pdl else 'off':3s} | {ms:7.3f} {row['us_per_layer']:8.1f} "
                      f"{row['weight_tbs']:5.2f} {row['ratio_to_floor']:7.3f} | {gain}", flush=True)
                with open(args.out, "w") as f:
                    json.dump(res, f, indent=1)
            torch.cuda.empty_cache()
    best = min((r for r in res["rows"] if "ms" in r and r["chain"] == "layer"), key=lambda r: r["ms"], default=None)
    if best:
        print(f"   fastest layer chain: {best['configs']} pdl={'on' if best['pdl'] else 'off'} {best['ms']:.3f} ms "
              f"(x{best['ratio_to_floor']:.3f} of its floor)")
    res["wall_s"] = time.monotonic() - t0
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"wrote {args.out} in {res['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
