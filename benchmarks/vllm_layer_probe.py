"""Host and device time of the vLLM plugin's per-layer work (``core.quant_step``) for one decode step, outside vLLM.

    PYTHONPATH=. python3 benchmarks/vllm_layer_probe.py --batch 34 --context 32000 --out probe.json

Shapes of ``benchmarks/bench_vllm.py``'s model (16 query / 8 KV heads, d = 128, pages of 64, sink 64 + window 256).
The cache holds random bytes (timing only). It times ``build_step`` (once per step), then ``layers`` calls of
``quant_step`` back to back as a step makes them: the host time of issuing them (no synchronisation) and the
device time (CUDA events), with the step's shared decode plan and without one; then the profiler's top host ops.
If the host time exceeds the device time, an eager vLLM step is bound by Python, not by the kernels.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from oscarkv.integrations.vllm.core import LayerParams, build_step, carve, decode_plan, page_bytes, quant_step
from oscarkv.cache import TierPolicy
from oscarkv.integrations.vllm.options import windows_of
from oscarkv.integrations.vllm.windows import WindowSlots
from oscarkv.kernels.layout import PageFormat
from oscarkv.kernels.plan import DecodePlan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=34)
    ap.add_argument("--context", type=int, default=32000)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--hq", type=int, default=16)
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--out", default="")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script itself (reference ops)")
    a = ap.parse_args()
    dev, B, n, H, d, blk = torch.device(a.device), a.batch, a.context, a.hkv, 128, 64
    tiers = TierPolicy(sink=64, window=256, unit=blk)
    rows16 = windows_of(tiers)[1]
    fmt = PageFormat(H, d, page_size=blk)
    per_seq = -(-(n + 1) // blk)
    kv = torch.randint(0, 255, (B * per_seq + 1, page_bytes(fmt, fmt)), dtype=torch.uint8, device=dev)
    pages = carve(kv, fmt, fmt)
    for pool in pages:  # finite fp16 scales/offsets
        pool.scale.copy_(torch.rand_like(pool.scale, dtype=torch.float32).to(pool.scale.dtype) * 0.1)
        pool.offset.copy_(torch.randn_like(pool.offset, dtype=torch.float32).to(pool.offset.dtype) * 0.1)
    slots = WindowSlots(B)
    shape = (B + 1, rows16, H, d)
    pools = tuple(torch.randn(shape, device=dev).to(torch.bfloat16) for _ in range(2))
    bt = (1 + torch.arange(B * per_seq, dtype=torch.int32, device=dev)).view(B, per_seq)
    keys = bt[:, 0].cpu().numpy().astype(np.int64)
    slots.assign(keys, fresh=np.ones(B, dtype=bool))
    g = torch.Generator().manual_seed(0)
    rot = lambda: torch.linalg.qr(torch.randn(H, d, d, generator=g))[0].to(dev)  # noqa: E731
    p = LayerParams(r_k=rot(), r_v=rot(), mu_k=torch.zeros(H, d, device=dev), mu_v=torch.zeros(H, d, device=dev),
                    k_clip=0.96, v_clip=0.92, sm_scale=d**-0.5)
    qsl, seq = np.arange(B + 1, dtype=np.int64), np.full(B, n + 1, dtype=np.int64)
    slot_map = (bt[:, n // blk].long() * blk + n % blk).contiguous()
    q = torch.randn(B, a.hq, d, device=dev, dtype=torch.bfloat16)
    k = torch.randn(B, H, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn(B, H, d, device=dev, dtype=torch.bfloat16)

    def step_meta():
        return build_step(tiers, slots, B, qsl, seq, keys, bt, slot_map, blk)

    res: dict = {"batch": B, "context": n, "layers": a.layers,
                 "gpu": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"}
    if dev.type != "cuda":
        m = step_meta()
        print("cpu smoke:", quant_step(q, k, v, pages, pools, p, m).shape)
        return
    t0 = time.perf_counter()
    for _ in range(10):
        m = step_meta()
    res["build_step_ms"] = (time.perf_counter() - t0) * 100
    plan = decode_plan(None, m, lambda width: DecodePlan(B, a.hq, H, d, blk, width, rows16, device=dev))
    for name, use_plan in (("with_plan", True), ("without_plan", False)):
        m.plan = plan if use_plan else None
        for _ in range(2):  # warm-up (kernel builds)
            quant_step(q, k, v, pages, pools, p, m)
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        e0.record()
        for _ in range(a.layers):
            quant_step(q, k, v, pages, pools, p, m)
        e1.record()
        host = (time.perf_counter() - t0) * 1e3
        torch.cuda.synchronize()
        res[name] = {"host_ms_per_layer": host / a.layers, "wall_ms_per_layer": e0.elapsed_time(e1) / a.layers}
        # device-only time: the same calls captured in a CUDA graph (no host overhead)
        try:
            graph = torch.cuda.CUDAGraph()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                quant_step(q, k, v, pages, pools, p, m)
                with torch.cuda.graph(graph, stream=s):
                    for _ in range(a.layers):
                        quant_step(q, k, v, pages, pools, p, m)
            torch.cuda.current_stream().wait_stream(s)
            graph.replay()
            torch.cuda.synchronize()
            e0.record()
            graph.replay()
            e1.record()
            torch.cuda.synchronize()
            res[name]["graph_ms_per_layer"] = e0.elapsed_time(e1) / a.layers
        except Exception as e:  # noqa: BLE001 - recorded
            res[name]["graph_error"] = repr(e)[:300]
        print(name, json.dumps(res[name]), flush=True)
    # one fresh prefill chunk of `context` tokens (a prompt in one chunk, as bench_vllm.py schedules them)
    pslots = WindowSlots(1)
    qk = torch.randn(n, a.hq, d, device=dev, dtype=torch.bfloat16)
    kk, vk = (torch.randn(n, H, d, device=dev, dtype=torch.bfloat16) for _ in range(2))
    pos = torch.arange(n, device=dev)
    pmap = (bt[0, pos // blk].long() * blk + pos % blk).contiguous()
    pkeys = keys[:1]
    pools1 = tuple(x[:2].clone() for x in pools)
    times = []
    for _ in range(3):
        pslots.key_of_slot[:] = -1
        pslots.slot_of_key.clear()
        pm = build_step(tiers, pslots, 1, np.array([0, n]), np.array([n]), pkeys, bt[:1], pmap, blk)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        quant_step(qk, kk, vk, pages, pools1, p, pm)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    sdpa(qk.transpose(0, 1)[None], kk.transpose(0, 1).repeat_interleave(a.hq // H, 0)[None],
         vk.transpose(0, 1).repeat_interleave(a.hq // H, 0)[None], is_causal=True)
    torch.cuda.synchronize()
    res["prefill_chunk"] = {"tokens": n, "quant_step_ms": min(times), "sdpa_alone_ms": (time.perf_counter() - t0) * 1e3}
    print("prefill", json.dumps(res["prefill_chunk"]), flush=True)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        quant_step(qk, kk, vk, pages, pools1, p, pm)
        torch.cuda.synchronize()
    res["prefill_chunk"]["profile_gpu_top"] = prof.key_averages().table(sort_by="self_device_time_total",
                                                                        row_limit=15)
    print(res["prefill_chunk"]["profile_gpu_top"])
    res["mixed"] = mixed_steps(a, tiers, pages, pools, p, bt, keys, slot_map, n, H, d, blk, dev)
    m.plan = plan
    import cProfile
    import io
    import pstats

    prof_py = cProfile.Profile()
    prof_py.enable()
    for _ in range(5 * a.layers):
        quant_step(q, k, v, pages, pools, p, m)
    prof_py.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof_py, stream=buf).sort_stats("tottime").print_stats(30)
    res["python_profile"] = buf.getvalue()
    print(buf.getvalue()[:6000])
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            quant_step(q, k, v, pages, pools, p, m)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20)
    gpu_table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=15)
    print(table)
    print(gpu_table)
    res["profile_top"], res["profile_gpu_top"] = table, gpu_table
    print("build_step_ms", res["build_step_ms"])
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


def _triton_cache_entries() -> int:
    import os

    root = os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton", "cache")
    return len(os.listdir(root)) if os.path.isdir(root) else -1


def mixed_steps(a, tiers, pages, pools, p, bt, keys, slot_map, n, H, d, blk, dev) -> dict:
    """Steps as a vLLM prefill phase makes them: one fresh ``n``-token prompt plus ``k`` decode rows (sequences
    at ``n`` tokens), per layer: the first call of each ``k`` (kernel builds included; Triton cache entries
    added) and the best of 3 after it."""
    out = {}
    for k in sorted({1, min(8, a.batch - 1), a.batch - 1}):
        slots = WindowSlots(k + 1)
        slots.assign(keys[:k], fresh=np.ones(k, dtype=bool))
        qsl = np.concatenate([np.arange(k + 1), [k + n]]).astype(np.int64)
        seq = np.array([n + 1] * k + [n], dtype=np.int64)
        pos = torch.arange(n, device=dev)
        smap = torch.cat([slot_map[:k], bt[k, pos // blk].long() * blk + pos % blk]).contiguous()
        T = k + n
        q = torch.randn(T, a.hq, d, device=dev, dtype=torch.bfloat16)
        kk, vv = (torch.randn(T, H, d, device=dev, dtype=torch.bfloat16) for _ in range(2))
        pl = tuple(x[:k + 2].clone() for x in pools)
        times, first, added = [], None, 0
        for i in range(4):
            slots.key_of_slot[k] = -1  # the prompt's slot fresh again
            slots.slot_of_key.pop(int(keys[k]), None)
            m = build_step(tiers, slots, k + 1, qsl, seq, keys[:k + 1], bt[:k + 1], smap, blk)
            m.plan = decode_plan(None, m, lambda w: DecodePlan(k, a.hq, H, d, blk, w, windows_of(tiers)[1], device=dev))
            c0 = _triton_cache_entries()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            quant_step(q, kk, vv, pages, pl, p, m)
            torch.cuda.synchronize()
            dt = (time.perf_counter() - t0) * 1e3
            if i == 0:
                first, added = dt, _triton_cache_entries() - c0
            else:
                times.append(dt)
        out[str(k)] = {"first_ms": first, "triton_cache_entries_added": added, "best_ms": min(times)}
        print("mixed", k, json.dumps(out[str(k)]), flush=True)
    return out


if __name__ == "__main__":
    main()
