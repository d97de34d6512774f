"""One engine decode step at batch 1, timed the same way for this checkout and an earlier one (a GPU is needed).

    python scripts/experiments/engine_step_probe.py OUT.jsonl [--context 131072] [--caches bf16,oscar] [--tag T]
    PYTHONPATH=BEFORE_DIR python scripts/experiments/engine_step_probe.py OUT.jsonl --tag before

BEFORE_DIR holds the earlier checkout's package as ``oscarkv``; the script uses only what both trees offer
(``LLM(...)``, ``submit``, ``step``, ``gauges``, ``Calibration.identity``), so the two are timed by one timer:
each ``LLM.step()`` (scheduling, the captured decode graph, sampling, bookkeeping) between CUDA events, after
writing a 256 MiB buffer so that no step finds the previous one's data in L2; the median of ``--steps``.
``oscar-mix``: the per-layer mix of ``oscarkv bench`` (every format, cycled over the layers). Random-weight
Qwen3-8B shape, a random prompt of ``context - 128`` tokens prefilled for real, identity
calibration for the OSCAR cache (rotations do not change a step's cost). Before timing, greedy tokens of the
decoded steps are recorded so that two trees' outputs can be compared. Appends one JSON line per cache to OUT.
"""
import argparse
import gc
import json
import statistics
import time

import torch

from oscarkv.artifact import Calibration
from oscarkv.config import QuantSpec
from oscarkv.engine import LLM, PRESETS, SamplingParams, random_model


def identity(cfg) -> Calibration:
    spec = QuantSpec(k_clip=0.96, v_clip=0.92, centering=False, composition="none")
    try:
        from oscarkv.artifact import ModelIdentity

        ident = ModelIdentity(cfg.arch, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                              cfg.hidden_size)
    except ImportError:  # the earlier tree names it through the engine
        from oscarkv.engine.llm import identity_of

        ident = identity_of(cfg)
    return Calibration.identity(ident, spec, clip=0.96)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--caches", default="bf16,oscar", help="bf16, oscar, oscar-mix (this checkout only)")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--budget-gb", type=float, default=24.0)
    ap.add_argument("--tag", default="after")
    args = ap.parse_args()
    model = random_model(PRESETS["qwen3-8b"], dtype=torch.bfloat16, device="cuda")
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.cfg.vocab_size, (args.context - 128,), generator=g).tolist()
    for kv in args.caches.split(","):
        calib, extra = (None, {}) if kv == "bf16" else (identity(model.cfg), {})
        if kv == "oscar-mix":  # this checkout only: every per-layer format, cycled over the layers
            from oscarkv.bench.e2e import MIX

            calib.layer_formats = [MIX[i % len(MIX)] for i in range(model.cfg.num_layers)]
            kv, extra = "oscar", {"method": "oscar-auto"}
        llm = LLM(model, calib, kv=kv, kv_budget_gb=args.budget_gb, max_num_seqs=1, max_model_len=args.context + 64,
                  monitor_every=0, gemv="auto", pdl=True, **extra)
        kv = "oscar-mix" if extra else kv
        seq = llm.submit(prompt, SamplingParams(max_tokens=args.steps + 16, ignore_eos=True))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        while not seq.out:
            llm.step()
        torch.cuda.synchronize()
        prefill_s = time.perf_counter() - t0
        for _ in range(3):  # the first decode steps capture the batch's graph
            llm.step()
        times = []
        for _ in range(args.steps):
            flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            llm.step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        if int(llm.gauges()["running_requests"]) != 1:
            raise RuntimeError("the sequence stopped while timed")
        row = {"tag": args.tag, "cache": kv,
               "context": args.context, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
               "step_ms": statistics.median(times), "step_min_ms": min(times), "step_max_ms": max(times),
               "steps": args.steps, "prefill_s": prefill_s, "tokens": list(seq.out)[:8]}
        print(json.dumps(row), flush=True)
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")
        del llm, seq
        gc.collect()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
