"""Batch-1 decode step of the random-weight Qwen3-8B shape at each context, with the pool's block table sized
for that context (max_model_len = context + 64) and for 128K (131136), for whichever oscarkv tree is on
PYTHONPATH (older trees' ``oscarkv bench`` has no ``--max-model-len``, hence this script's own ``build``).
H200 results: docs/results/e2e_capacity_s18_h200.json, docs/results/e2e_h200.md (session 18).

    PYTHONPATH=. python3 benchmarks/capacity_probe.py out.json 32768,102400
"""
import json
import sys

import torch

from oscarkv.cli import bench as B
from oscarkv.engine.model import PRESETS, random_model


def build(model, kv: str, ctx: int, cap: int):
    return B.build(model, kv, 1, ctx, pdl=True, max_model_len=cap or None)


model = random_model(PRESETS["qwen3-8b"], dtype=torch.bfloat16, device="cuda")
rows = []
for ctx in [int(c) for c in sys.argv[2].split(",")]:
    for cap in (0, 131136):
        for kv in ("bf16", "oscar"):
            llm = build(model, kv, ctx, cap)
            seqs = B.fill_random(llm, 1, ctx)
            r = B.time_decode(llm, seqs, 20)
            r.update(kv=kv, context=ctx, max_model_len=llm.engine.max_model_len)
            rows.append(r)
            print(f"{kv:5s} ctx {ctx:6d} max_model_len {r['max_model_len']:6d}: {r['graph_ms']:.3f} ms", flush=True)
            B.release(llm)
json.dump(rows, open(sys.argv[1], "w"), indent=1)
