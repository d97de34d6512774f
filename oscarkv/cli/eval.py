"""``oscarkv eval``: quality of KV-cache methods (KLD, PPL, NIAH, greedy agreement, fidelity) and calibration
studies, with resumable JSONL results, a markdown summary and PNG plots under ``--out``.

Examples::

    oscarkv eval --model smollm2-135m --calibration calibrations/smollm2-135m \\
        --methods bf16,naive-int2,quarot-int2,kivi-2,int4-hadamard,oscar --tasks kld,ppl --context 1024,2048
    oscarkv eval --model smollm2-135m --calibration DIR --tasks niah --context 1024,4096 --niah-depths 0.1,0.5,0.9
    oscarkv eval --model smollm2-135m --study calib-tokens --calib-tokens 500,2000,8000
    oscarkv eval --report-only --out results/
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

DEFAULT_METHODS = "bf16,naive-int2,quarot-int2,kivi-2,int4-hadamard,oscar"


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="smollm2-135m | qwen2.5-coder-0.5b | qwen2.5-coder-1.5b | HF folder | .gguf file")
    p.add_argument("--calibration", help="calibration artifact folder (needed by the oscar family and for centering)")
    p.add_argument("--extra-calibration", action="append", default=[], metavar="LABEL=DIR",
                   help="another artifact, used by methods written METHOD@LABEL (e.g. oscar@head); repeatable")
    p.add_argument("--methods", type=_names, default=_names(DEFAULT_METHODS),
                   help=f"comma-separated methods (default {DEFAULT_METHODS}); pseudo-methods: 'fp32' = the unmodified "
                   "float32 model, 'native' = the unmodified model with its own cache in its dtype")
    p.add_argument("--tasks", type=_names, default=["kld", "ppl"],
                   help="kld,ppl,code,niah,greedy,fidelity,longgen (default kld,ppl; code = kld/ppl plus next-line "
                   "exact match of every line, for code text)")
    p.add_argument("--data", default="essays",
                   help="held-out text: essays | shakespeare | kjv | code | docs | a .txt file (default essays)")
    p.add_argument("--context", type=_ints, default=[1024, 2048], help="context lengths (default 1024,2048)")
    p.add_argument("--windows", type=int, default=4, help="windows per context length for kld/ppl/fidelity (default 4)")
    p.add_argument("--score-from", type=int, help="first scored position (default: sink + window of the calibration)")
    p.add_argument("--reference", default=None,
                   help="method the others are compared with: bf16 (default: K/V in the 16-bit cache tiers, "
                   "simulated), "
                   "native (the model and its own cache; on a bfloat16 model the same K/V with the model's attention "
                   "kernels; the suite's default) or fp32")
    p.add_argument("--niah-lengths", type=_ints, help="NIAH context lengths (default: --context)")
    p.add_argument("--niah-depths", type=_floats, default=[0.1, 0.5, 0.9], help="needle depths (default 0.1,0.5,0.9)")
    p.add_argument("--niah-variants", type=_names, default=["single-number-essay", "multikey-word-noise"],
                   help="kind-value-haystack list (kinds single|multikey, values number|word, haystacks essay|noise)")
    p.add_argument("--niah-samples", type=int, default=None,
                   help="seeds per (variant, length, depth) (default 1; 10 in --suite)")
    p.add_argument("--prefill-chunk", type=int, default=256,
                   help="tokens per chunk of every chunked prefill through a cache: NIAH, and --path cache "
                   "(default 256)")
    p.add_argument("--path", choices=("auto", "simulate", "cache"), default="auto",
                   help="teacher-forced tasks (kld, ppl, code, longgen): simulate (exact decode semantics, PyTorch), "
                   "cache (chunked prefill through the real cache: the kernels on CUDA) or auto (default: cache on "
                   "CUDA, simulate elsewhere)")
    p.add_argument("--simulate-chunk", type=int, default=1,
                   help="--path simulate: model a chunked prefill of this many tokens (default 1: token-by-token "
                   "decode; the cache path's --prefill-chunk: its exact semantics, a cross-check)")
    p.add_argument("--batch", type=int, default=1,
                   help="windows, NIAH samples or long-generation prompts per cache batch (default 1)")
    p.add_argument("--bucket", type=int, default=1024, help="positions per bucket of the curves (default 1024)")
    p.add_argument("--longgen-prompts", type=int, default=4, help="long generation: prompts (default 4)")
    p.add_argument("--longgen-tokens", type=int, default=2048, help="long generation: tokens generated (default 2048)")
    p.add_argument("--longgen-context", type=int, help="long generation: prompt length (default: the first --context)")
    p.add_argument("--time-budget", type=float,
                   help="seconds, counted once the model and text are loaded, after which no task starts a new unit (a "
                   "unit started is finished; rerun to resume)")
    p.add_argument("--greedy-prompts", type=int, default=4, help="greedy prompts per context length (default 4)")
    p.add_argument("--greedy-tokens", type=int, default=32, help="greedy continuation length (default 32)")
    p.add_argument("--greedy-mode", choices=("teacher", "decode"), default="teacher",
                   help="teacher: one simulate pass per method (exact for first divergence); decode: real decode")
    p.add_argument("--out", default="results", help="results folder (default results/)")
    p.add_argument("--ref-cache", help="folder for cached reference hidden states (default OUT/.ref; 'none' disables)")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N (default cpu)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                   help="model dtype on any device (default float32: the protocol of docs/evaluation.md, results "
                   "comparable across devices; bfloat16 measures against a bfloat16 model, fingerprinted apart)")
    p.add_argument("--kernels", choices=("auto", "reference"), default="auto",
                   help="attention of the caches NIAH and greedy decode run through: auto (default; on CUDA the "
                   "Triton kernel for 2-bit token pages) or reference (the PyTorch reference on any device)")
    p.add_argument("--study", choices=("calib-tokens", "shift"), help="a calibration study instead of --tasks")
    p.add_argument("--calib-tokens", type=_ints, default=[500, 2000, 8000, 32000],
                   help="calib-tokens study: token budgets (default 500,2000,8000,32000)")
    p.add_argument("--calib-data", type=_names, default=["shakespeare", "kjv", "shakespeare+chat"],
                   help="shift study: calibration corpora; '+chat' wraps chunks in the chat template")
    p.add_argument("--study-method", default="oscar", help="method evaluated by the studies (default oscar)")
    p.add_argument("--suite", choices=("long-context",),
                   help="run the long-context suite (docs/evaluation.md) within --time-budget seconds instead of "
                   "--tasks: the curve and next-line accuracy on code, NIAH, long generation, a cross-check")
    p.add_argument("--suite-context", type=int, default=32768,
                   help="the suite's longest context (default 32768: the model's maximum)")
    p.add_argument("--report-only", action="store_true", help="only rebuild summary.md and plots from --out")
    p.add_argument("--export", metavar="DIR",
                   help="with --report-only: also write the results as a result of record into DIR, as "
                   "<topic>_<date>_<commit>.json (summary, commands, texts, calibrations, versions) and its plots")
    p.add_argument("--topic", help="the topic that names an --export (e.g. curve-smollm2)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads for this run (default: torch's choice); --threads 1 on a shared machine")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    from oscarkv.eval.report import write_report
    from oscarkv.eval.runner import MAIN_METHODS

    out = Path(args.out)
    if getattr(args, "threads", None) is not None:
        if args.threads < 1:
            print("error: --threads must be at least 1", file=sys.stderr)
            return 2
        import torch

        torch.set_num_threads(args.threads)  # the CLI's own process: no library-wide state is touched
    if args.report_only:
        print(f"wrote {write_report(out, order=list(MAIN_METHODS))}")
        if args.export:
            if not args.topic:
                print("error: --export needs --topic NAME", file=sys.stderr)
                return 2
            from oscarkv.eval.report import export

            print(f"wrote {export(out, args.export, args.topic)}")
        return 0
    if not args.model:
        print("error: --model is required (or --report-only)", file=sys.stderr)
        return 2
    if args.reference is None:
        args.reference = "native" if args.suite else "bf16"
    if args.niah_samples is None:
        args.niah_samples = 10 if args.suite else 1
    try:
        ctx, plan = _build(args)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.time_budget is not None:  # counted from here: loading the model is not evaluation time
        import dataclasses

        plan = dataclasses.replace(plan, deadline=time.monotonic() + args.time_budget)
    if args.suite:
        return _run_suite(args, ctx)
    if args.study:
        from oscarkv.eval.studies import run_study

        text = run_study(ctx, args.study, method=args.study_method, tokens=args.calib_tokens,
                         corpora=args.calib_data, contexts=args.context, windows=args.windows,
                         calib_dir=out / "calibrations")
        print(text)
        return 0
    from oscarkv.eval.runner import evaluate

    result = evaluate(ctx, plan)
    print(Path(result["report"]).read_text())
    print(f"new units: {result['new_units']}; report: {result['report']}", file=sys.stderr)
    return 0


def _build(args: argparse.Namespace):
    import torch

    from oscarkv import models
    from oscarkv.artifact import Calibration
    from oscarkv.eval.backend import HFBackend
    from oscarkv.eval.runner import Plan
    from oscarkv.eval.context import EvalContext
    from oscarkv.eval.store import ResultStore
    from oscarkv.eval.texts import load_eval_text

    plan = Plan(methods=args.methods, tasks=args.tasks or ["kld"], contexts=args.context, windows=args.windows,
                niah_lengths=args.niah_lengths, niah_depths=args.niah_depths, niah_variants=args.niah_variants,
                niah_samples=args.niah_samples, greedy_prompts=args.greedy_prompts,
                greedy_tokens=args.greedy_tokens, greedy_mode=args.greedy_mode, prefill_chunk=args.prefill_chunk,
                path=args.path, batch=args.batch, bucket=args.bucket, longgen_prompts=args.longgen_prompts,
                longgen_tokens=args.longgen_tokens, longgen_context=args.longgen_context,
                simulate_chunk=args.simulate_chunk)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda asked for, but torch sees no CUDA device")
    dtype = getattr(torch, args.dtype or "float32")
    if "fp32" in plan.methods and dtype != torch.float32:
        raise ValueError(f"the 'fp32' pseudo-method is the unmodified model in float32: drop it or use --dtype float32 "
                         f"(not {args.dtype})")
    print(f"loading {args.model} ({args.dtype or 'float32'} on {device}) ...", file=sys.stderr)
    model, tok = models.load(args.model, dtype=dtype)
    model.to(device)
    calib = Calibration.load(args.calibration, model=model) if args.calibration else None
    extra = {}
    for item in args.extra_calibration:
        label, sep, folder = item.partition("=")
        if not sep or not label or "@" in label:
            raise ValueError(f"--extra-calibration wants LABEL=DIR, got {item!r}")
        extra[label] = Calibration.load(folder, model=model)
    needs = [m for m in plan.methods if m.split("@")[0].startswith("oscar") and "@" not in m]
    if needs and calib is None:
        raise ValueError(f"methods {needs} need --calibration DIR (run `oscarkv calibrate` first)")
    spec = calib.spec if calib is not None else None
    score_from = args.score_from if args.score_from is not None else (spec.sink + spec.window if spec else 320)
    out = Path(args.out)
    ref = None if args.ref_cache == "none" else Path(args.ref_cache or out / ".ref")
    backend = HFBackend(calib, extra, kernels=getattr(args, "kernels", "auto"))
    ctx = EvalContext(model=model, tokenizer=tok, model_name=_model_name(args.model), backend=backend,
                      store=ResultStore(out), text=load_eval_text(args.data), calibration=calib,
                      score_from=score_from, reference=args.reference, ref_dir=ref, progress=not args.quiet)
    from oscarkv.eval.runner import numerics_info

    print("numerics: " + ", ".join(f"{k} {v}" for k, v in numerics_info(ctx).items()), file=sys.stderr)
    return ctx, plan


def _run_suite(args: argparse.Namespace, ctx) -> int:
    """``--suite long-context``: the steps of :func:`oscarkv.eval.suite.long_context_steps` on the loaded model."""
    import dataclasses

    from oscarkv.eval.backend import HFBackend
    from oscarkv.eval.report import write_report
    from oscarkv.eval.runner import MAIN_METHODS
    from oscarkv.eval.suite import long_context_steps, run_suite
    from oscarkv.eval.texts import load_eval_text

    if args.time_budget is None:
        print("error: --suite needs --time-budget SECONDS", file=sys.stderr)
        return 2
    texts = {}

    def make_context(data: str, kernels: str):
        if data not in texts:
            texts[data] = load_eval_text(data)
        backend = HFBackend(ctx.backend.calibration, ctx.backend.extra, kernels=kernels)
        return dataclasses.replace(ctx, text=texts[data], backend=backend, _tokens=None, _tokens_all=False)

    steps = long_context_steps(args.suite_context, args.prefill_chunk, args.niah_samples)
    run_suite(make_context, steps, args.out, args.time_budget, log=lambda m: print(m, file=sys.stderr))
    print(f"wrote {write_report(args.out, order=list(MAIN_METHODS))}")
    return 0


def _model_name(name: str) -> str:
    from oscarkv import models

    try:
        return models.resolve_name(name)
    except ValueError:
        return Path(name).name.removesuffix(".gguf")
