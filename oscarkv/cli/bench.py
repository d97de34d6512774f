"""``oscarkv bench``: end-to-end engine benchmarks on a CUDA GPU (:mod:`oscarkv.bench.e2e`): batch-1 decode step
against context with its floor, BF16 against OSCAR at equal batches, throughput under one KV budget, KV bytes
per token, on random-weight
Qwen3-8B/4B-shaped models. The engine is checked against transformers (and OSCAR on the GPU against the CPU
reference path) first; if that fails nothing is timed and the command exits 1. Writes JSON with provenance
and PNG plots next to it; ``--plot JSON`` redraws an earlier result's plots without a GPU."""

from __future__ import annotations

import argparse
import json
import traceback
from pathlib import Path

SUITES = ("memory", "latency", "batches", "throughput")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", default="qwen3-8b,qwen3-4b", help="presets of oscarkv.engine.PRESETS (random weights)")
    p.add_argument("--contexts", default="32768,102400,131072", help="latency suite contexts")
    p.add_argument("--latency-models", default=None,
                   help="presets that run every context (default: the first; the others run 32K and 100K)")
    p.add_argument("--batches", default="1,4,8,16", help="batches of the equal-batch suite (batches)")
    p.add_argument("--batch-contexts", default="32768,102400,131072", help="contexts of the equal-batch suite")
    p.add_argument("--throughput-context", type=int, default=131072)
    p.add_argument("--budget-gb", type=float, default=90.0, help="KV budget of the throughput suite (GiB)")
    p.add_argument("--steps", type=int, default=16, help="timed decode steps per row (median reported)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="the latency suite's LLM(max_model_len=...) (default: each context + 64); a larger bound "
                        "measures a server made for longer sequences")
    p.add_argument("--gemv", default="auto", choices=("auto", "cublas", "triton"), help="LLM(gemv=...)")
    p.add_argument("--pdl", default="on", type=parse_pdl,
                   help="LLM(pdl=...) of the latency suite: on, off, or off,on to time every row both ways")
    p.add_argument("--suites", default=",".join(SUITES), help=f"comma-separated subset of {', '.join(SUITES)} "
                   "(memory comes from the latency rows)")
    p.add_argument("--caches", default="bf16,oscar",
                   help="caches of the latency suite: bf16, oscar, oscar-mix (per-layer formats, every format mixed)")
    p.add_argument("--git-sha", default=None, help="commit of the code run (default: this checkout's HEAD)")
    p.add_argument("--out", default="e2e.json", help="JSON results file (PNG plots are written next to it)")
    p.add_argument("--plot", metavar="JSON", default=None,
                   help="only draw the plots of an existing results file, next to it (no GPU needed)")


def parse_pdl(text: str) -> tuple[bool, ...]:
    """``on`` / ``off`` / ``off,on`` (also 1/0, true/false) -> the settings to time, in order."""
    names = {"off": False, "0": False, "false": False, "on": True, "1": True, "true": True}
    items = [v.strip().lower() for v in text.split(",") if v.strip()]
    if not items or any(v not in names for v in items):
        raise argparse.ArgumentTypeError(f"--pdl takes on, off or off,on; got {text!r}")
    return tuple(dict.fromkeys(names[v] for v in items))


def write_plots(res: dict, out: str, log) -> list:
    """The result's plots next to ``out`` (``<stem>_latency.png`` etc.); a note instead where matplotlib (the
    ``eval`` extra) is missing."""
    from oscarkv.bench.plots import plot_results

    path = Path(out)
    try:
        written = plot_results(res, path.parent, prefix=path.stem)
    except ImportError as e:
        log(f"no plots ({e}): pip install 'oscar-kv[eval]' for matplotlib")
        return []
    for w in written:
        log(f"wrote {w}")
    return written


def run(args: argparse.Namespace) -> int:
    log = lambda s: print(s, flush=True)  # noqa: E731
    if args.plot:
        write_plots(json.loads(Path(args.plot).read_text()), args.plot, log)
        return 0
    import torch

    from oscarkv.bench import e2e
    from oscarkv.bench.harness import CorrectnessError, Timer, provenance
    from oscarkv.engine import PRESETS, random_model

    if not torch.cuda.is_available():
        raise SystemExit("oscarkv bench needs a CUDA GPU (the CPU checks are the test suite); --plot JSON redraws "
                         "an earlier run's plots without one")
    suites = {s.strip() for s in args.suites.split(",") if s.strip()}
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    if suites - set(SUITES):
        raise SystemExit(f"--suites: unknown {sorted(suites - set(SUITES))} ({', '.join(SUITES)})")
    if set(names) - set(PRESETS):
        raise SystemExit(f"--models: unknown {sorted(set(names) - set(PRESETS))} ({', '.join(PRESETS)})")
    caches = tuple(c.strip() for c in args.caches.split(",") if c.strip())
    if set(caches) - set(e2e.CACHES) or not caches:
        raise SystemExit(f"--caches: one or more of {', '.join(e2e.CACHES)}, got {args.caches!r}")
    pdls = args.pdl if isinstance(args.pdl, tuple) else parse_pdl(str(args.pdl))
    res: dict = {"provenance": provenance(args.git_sha), "gemv": args.gemv, "max_model_len": args.max_model_len,
                 "pdl": ["on" if p else "off" for p in pdls], "peak_bw": e2e.peak_bandwidth(), "steps": args.steps,
                 "note": "random weights; latency and throughput: random-token prompts prefilled; batches: caches "
                         "seeded (oscarkv.bench.e2e.seed); decode step = wall time per LLM.step() over consecutive "
                         "steps with every sequence decoding (median), replay = the step's CUDA graph alone",
                 "models": {}}
    out = Path(args.out)
    save = lambda: out.write_text(json.dumps(res, indent=1) + "\n")  # noqa: E731  (partial results survive a cut)
    try:
        res["correctness"] = e2e.check_engine("cuda", log)
    except CorrectnessError as e:
        res["correctness"] = {"error": str(e)}
        save()
        log(f"correctness check failed, nothing timed: {e}")
        return 1
    timer = Timer("cuda")
    contexts = [int(c) for c in args.contexts.split(",")]
    full = (args.latency_models or names[0]).split(",")
    failed = False
    for name in names:
        log(f"== {name}")
        model = random_model(PRESETS[name], dtype=torch.bfloat16, device="cuda")
        entry = res["models"][name] = {"weight_bytes": model.weight_bytes()}
        ctxs = contexts if name in full else [c for c in contexts if c in (32768, 102400)]
        try:
            if suites & {"latency", "memory"}:
                entry["latency"] = e2e.latency(model, ctxs, timer, args.steps, log, gemv=args.gemv, pdls=pdls,
                                               max_model_len=args.max_model_len, caches=caches)
                entry["latency_table"] = e2e.latency_table(entry["latency"])
                if "oscar-mix" in caches:
                    entry["mix_table"] = e2e.mix_table(entry["latency"])
                    log("\n".join(entry["mix_table"]))
                entry["memory"] = e2e.memory(entry["latency"], model)
                log("\n".join(entry["latency_table"]))
                save()
            if name in full and "batches" in suites:
                entry["batches"] = e2e.equal_batch(model, [int(c) for c in args.batch_contexts.split(",")],
                                                   [int(b) for b in args.batches.split(",")], timer, args.steps, log,
                                                   gemv=args.gemv, pdl=pdls[-1])
                entry["batches_table"] = e2e.equal_batch_table(entry["batches"])
                log("\n".join(entry["batches_table"]))
                save()
            if name in full and "throughput" in suites:
                entry["throughput"] = e2e.throughput(model, args.throughput_context, args.budget_gb, timer,
                                                     max(4, args.steps // 2), log, gemv=args.gemv, pdl=pdls[-1])
        except Exception as e:  # noqa: BLE001 - record it, keep the other models' results
            failed = True
            entry["error"] = f"{type(e).__name__}: {e}"
            log(f"  {name} FAILED: {entry['error']}\n{traceback.format_exc()[-2000:]}")
        del model
        torch.cuda.empty_cache()
        save()
    log(f"wrote {out}")
    write_plots(res, str(out), log)
    return 1 if failed else 0
