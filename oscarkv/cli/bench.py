"""``oscarkv bench``: end-to-end engine benchmarks (decode latency vs context, throughput vs batch under one KV
budget, KV bytes per token) on random-weight Qwen3-8B/4B-shaped models, plus GPU correctness checks.

Long contexts are not prefilled: the pool is filled with random K/V content directly (random 16-bit rows,
random 2-bit codes with small random scales/offsets) and decode steps are timed through the CUDA graph
(``torch.cuda.Event`` over repeated replays). Physical floor = (weight bytes + KV bytes read) / 4.7 TB/s.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import subprocess
import time

PEAK_BW = 4.7e12  # H200 HBM3e, bytes/s


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", default="qwen3-8b,qwen3-4b", help="presets (random weights)")
    p.add_argument("--contexts", default="4096,32768,65536,102400,131072")
    p.add_argument("--latency-models", default=None, help="presets for the full latency sweep (default: first)")
    p.add_argument("--throughput-context", type=int, default=131072)
    p.add_argument("--budget-gb", type=float, default=90.0, help="KV budget for the throughput sweep (GiB)")
    p.add_argument("--replays", type=int, default=30)
    p.add_argument("--max-model-len", type=int, default=None,
                   help="the latency suite's LLM(max_model_len=...) (default: each context + 64, so the pool's block "
                        "table fits the context); a larger bound measures a server made for longer sequences")
    p.add_argument("--skip-correctness", action="store_true")
    p.add_argument("--gemv", default="auto", choices=("auto", "cublas", "triton"),
                   help="decode GEMV of the engine (LLM(gemv=...)) in the timed suites")
    p.add_argument("--pdl", default="on", type=parse_pdl,
                   help="programmatic dependent launch of the decode step's kernels (LLM(pdl=...)): off, on, or "
                        "off,on to time every latency/throughput row both ways in one run (compared at the end); "
                        "an item may name a one-row GEMV set of gemv_triton.GEMV_SETS, e.g. off,on,on:splitk1")
    p.add_argument("--suites", default="memory,latency,throughput",
                   help="comma-separated subset of memory, latency, throughput")
    p.add_argument("--out", default="e2e.json", help="JSON results file (PNG plots are written next to it)")
    p.add_argument("--plot", metavar="JSON", default=None,
                   help="only draw the plots of an existing results file, next to it (no GPU needed)")


def parse_pdl(text: str) -> list[tuple[bool, str]]:
    """``off`` / ``on`` / ``off,on`` (also 0/1, false/true), each optionally ``:SET`` (a GEMV set of
    ``gemv_triton.GEMV_SETS``) -> the (pdl, set) variants to time, in order."""
    names = {"off": False, "0": False, "false": False, "on": True, "1": True, "true": True}
    out = []
    for item in (v.strip().lower() for v in text.split(",") if v.strip()):
        flag, _, gset = item.partition(":")
        if flag not in names:
            raise argparse.ArgumentTypeError(f"--pdl takes off, on, off,on (items may add :SET); got {text!r}")
        out.append((names[flag], gset or "default"))
    if not out:
        raise argparse.ArgumentTypeError("--pdl needs at least one of off, on")
    return list(dict.fromkeys(out))


def variant_name(pdl: bool, gset: str = "default") -> str:
    return ("on" if pdl else "off") + ("" if gset == "default" else f":{gset}")


@contextlib.contextmanager
def gemv_set(model, name: str):
    """Enter the one-row GEMV set ``name`` (``gemv_triton.GEMV_SETS``) into ``GEMV_CONFIGS`` for ``model``'s
    projection shapes for the duration (builds, captures and replays inside see it)."""
    if name == "default":
        yield
        return
    from oscarkv.kernels import gemv_triton as triton_ops

    if name not in triton_ops.GEMV_SETS:
        raise ValueError(f"unknown GEMV set {name!r}: {sorted(triton_ops.GEMV_SETS)}")
    saved = dict(triton_ops.GEMV_CONFIGS)
    shapes = model.gemv_shapes()
    for proj, cfg in triton_ops.GEMV_SETS[name].items():
        if cfg is not None:
            triton_ops.GEMV_CONFIGS[(1, *shapes[proj])] = cfg
    try:
        yield
    finally:
        triton_ops.GEMV_CONFIGS.clear()
        triton_ops.GEMV_CONFIGS.update(saved)


def provenance() -> dict:
    import torch

    info = {"torch": torch.__version__, "python": platform.python_version(), "time": time.strftime("%F %T")}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    try:  # $OSCARKV_GIT_SHA wins: a copied tree's .git (the GPU machine's) can name another commit
        info["git_sha"] = os.environ.get("OSCARKV_GIT_SHA") or subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        try:
            info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                            capture_output=True, text=True).stdout.strip()
        except OSError:
            pass
    return info


# ------------------------------------------------------------------------------------------- set-up
def store_sizes(model, kv: str) -> tuple[int, int, object]:
    """``(bytes per slot, bytes per page, pages_for(n))`` of the store :func:`build` makes: OSCAR with the default
    spec (2-bit token pages of 64 tokens, sink 64 + window 256), or 16-bit pages of 64 tokens."""
    import torch

    from oscarkv.cache import Paged16Store, PagedStore, PageGeometry, TierPolicy
    from oscarkv.config import QuantSpec
    from oscarkv.formats import LayerFormat, TensorFormat

    cfg, dtype = model.cfg, next(model.parameters()).dtype
    L, H, d = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
    if kv == "bf16":
        return 0, Paged16Store.page_bytes(L, H, d, 64, dtype), lambda n: math.ceil(n / 64)
    spec = QuantSpec()
    policy, geo = TierPolicy(spec.sink, spec.window, spec.page_size), PageGeometry(H, d, spec.page_size)
    fmts = [LayerFormat(TensorFormat("token", 2, "none"), TensorFormat("token", 2, "none"))] * L
    dtype16 = dtype if dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
    return (PagedStore.slot_bytes(L, policy, geo, dtype16), PagedStore.page_bytes(fmts, geo),
            lambda n: math.ceil(policy.quantized(n) / spec.page_size))


def build(model, kv: str, n_seqs: int, ctx: int, extra_tokens: int = 64, gemv: str = "auto", pdl: bool = False,
          max_model_len: int | None = None):
    """An LLM whose store holds exactly ``n_seqs`` sequences of ``ctx + extra_tokens`` tokens; ``max_model_len``
    (default: that length) sets the block table's width, i.e. the bound the decode plans for."""
    from oscarkv.artifact import Calibration
    from oscarkv.config import QuantSpec
    from oscarkv.engine import LLM
    from oscarkv.engine.llm import identity_of

    cfg, n = model.cfg, ctx + extra_tokens
    slot, page, pages_for = store_sizes(model, kv)
    budget = (n_seqs + 1) * slot + (n_seqs * pages_for(n) + 2) * page
    calib = None
    if kv == "oscar":
        spec = QuantSpec(k_clip=0.96, v_clip=0.92, centering=False, composition="none")
        calib = Calibration.identity(identity_of(cfg), spec, clip=0.96)
    return LLM(model, calib, kv=kv, kv_budget_gb=budget / 2**30 + 1e-6, max_num_seqs=n_seqs,
               max_model_len=max(n, max_model_len or 0),
               monitor_every=0, gemv=gemv, pdl=pdl)


def fill_random(llm, n_seqs: int, ctx: int):
    """Put ``n_seqs`` decode-ready sequences of ``ctx`` cached tokens with random K/V into slots ``0..n-1``."""
    import torch

    from oscarkv.cache import PagedStore
    from oscarkv.engine import SamplingParams, Sequence

    eng, st = llm.engine, llm.store
    seqs = []
    for i in range(n_seqs):
        seq = Sequence([1] * (ctx + 1), SamplingParams(max_tokens=1 << 20, ignore_eos=True))
        seq.slot, seq.n_cached = i, ctx
        st.table.add_pages(i, st.allocator.allocate(st.pages_for(ctx + 1)))
        st.lens[i] = ctx
        eng.running.append(seq)
        seqs.append(seq)
    if isinstance(st, PagedStore):
        for i in range(n_seqs):
            st.qlens[i] = st.policy.quantized(ctx)
        for pages in (*st.k_pages, *st.v_pages):
            pages.codes.random_(0, 256)
            pages.scale.uniform_(0.005, 0.05)
            pages.offset.uniform_(-0.1, 0.0)
        st.buf.normal_(0, 0.1)
    else:
        st.kv.normal_(0, 0.1)
    torch.cuda.synchronize()
    return seqs


def time_decode(llm, seqs, replays: int, engine_steps: int = 16) -> dict:
    """Graph replay time of one decode step (ms), and full engine steps (host work, sampling and the OSCAR
    store's demotions included): the median of ``engine_steps`` of them (the first crosses a page boundary at a
    64-aligned context, so it demotes; steady decoding does that once every 64 steps) and the slowest."""
    import torch

    eng, runner = llm.engine, llm.engine.runner
    bs = runner.batch_size(len(seqs))
    runner.decode(seqs, bs)  # fills the batch's inputs and captures its graph
    graph = runner.graphs[bs][0]
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    step_ms = start.elapsed_time(end) / replays
    engine_ms = []
    for _ in range(engine_steps):
        t0 = time.perf_counter()
        eng._decode(list(seqs), [])
        torch.cuda.synchronize()
        engine_ms.append((time.perf_counter() - t0) * 1e3)
    engine_ms.sort()
    return {"graph_ms": step_ms, "engine_step_ms": engine_ms[len(engine_ms) // 2], "engine_step_max_ms": engine_ms[-1],
            "engine_steps": engine_steps, "batch": len(seqs), "graph_batch": bs}


def kv_read_bytes(llm, ctx: int) -> float:
    """KV bytes one decode step reads for one sequence of ``ctx`` tokens (from the store's own geometry)."""
    from oscarkv.cache import Paged16Store, PagedStore

    st, L = llm.store, llm.model.cfg.num_layers
    if isinstance(st, PagedStore):
        q = st.policy.quantized(ctx)
        row16 = 2 * L * st.H * st.d * st.buf.element_size()
        return q * PagedStore.page_bytes(st.formats, st.geo) / st.page_size + (ctx - q) * row16
    return ctx * Paged16Store.page_bytes(L, st.H, st.d, st.page_size, st.dtype) / st.page_size


def release(llm) -> None:
    import gc

    import torch

    llm.engine.graphs.clear()
    del llm
    gc.collect()
    torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------- suites
def _variants(pdls) -> list[tuple[bool, str]]:
    return [v if isinstance(v, tuple) else (bool(v), "default") for v in pdls]


def latency(model, contexts: list[int], replays: int, log, gemv: str = "auto",
            pdls: tuple = (False,), on_row=None, max_model_len: int | None = None) -> list[dict]:
    """Batch-1 step per context, cache and variant; ``on_row(rows)`` after each row (partial results). A row
    that fails (several variants) is recorded with its error and the others go on."""
    rows = []
    wbytes = model.weight_bytes()
    for ctx in contexts:
        for kv in ("bf16", "oscar"):
            for pdl, gset in _variants(pdls):
                llm = None
                try:
                    with gemv_set(model, gset):
                        llm = build(model, kv, 1, ctx, gemv=gemv, pdl=pdl, max_model_len=max_model_len)
                        seqs = fill_random(llm, 1, ctx)
                        r = time_decode(llm, seqs, replays)
                except Exception as e:  # noqa: BLE001
                    if len(pdls) == 1:
                        raise
                    import gc

                    import torch

                    log(f"  latency {kv:5s} ctx {ctx:>6d} pdl {variant_name(pdl, gset):11s}: FAILED "
                        f"{type(e).__name__}: {str(e)[:400]}")
                    rows.append({"kv": kv, "context": ctx, "pdl": pdl, "gemv_set": gset,
                                 "variant": variant_name(pdl, gset), "error": f"{type(e).__name__}: {e}"})
                    if llm is not None:
                        llm.engine.graphs.clear()
                    llm = None
                    gc.collect()
                    torch.cuda.empty_cache()
                    continue
                floor = (wbytes + kv_read_bytes(llm, ctx)) / PEAK_BW * 1e3
                r.update(kv=kv, context=ctx, pdl=pdl, gemv_set=gset, variant=variant_name(pdl, gset),
                         max_model_len=llm.engine.max_model_len,
                         floor_ms=floor, ratio_to_floor=r["graph_ms"] / floor, kv_bytes_read=kv_read_bytes(llm, ctx),
                         weight_bytes=wbytes)
                rows.append(r)
                log(f"  latency {kv:5s} ctx {ctx:>6d} pdl {r['variant']:11s}: {r['graph_ms']:.3f} ms (floor "
                    f"{floor:.3f}, x{r['ratio_to_floor']:.2f}; engine step {r['engine_step_ms']:.2f} ms)")
                release(llm)
                if on_row is not None:
                    on_row(rows)
    return rows


def latency_table(rows: list[dict]) -> list[str]:
    """Markdown rows: per context, BF16 and OSCAR step ms / ratio to floor for each variant (pdl setting and
    GEMV set), the OSCAR speed-up over BF16, and each variant against plain "off"."""
    name = lambda r: r.get("variant") or variant_name(bool(r.get("pdl", False)))  # noqa: E731
    by = {(r["context"], r["kv"], name(r)): r for r in rows if "graph_ms" in r}
    variants = list(dict.fromkeys(name(r) for r in rows if "graph_ms" in r))
    out = ["| context | pdl | BF16 ms | floor | ratio | OSCAR ms | floor | ratio | OSCAR speed-up |",
           "|---|---|---|---|---|---|---|---|---|"]
    for ctx in sorted({k[0] for k in by}):
        for v in variants:
            b, o = by.get((ctx, "bf16", v)), by.get((ctx, "oscar", v))
            if b is None or o is None:
                continue
            out.append(f"| {ctx} | {v} | {b['graph_ms']:.3f} | {b['floor_ms']:.2f} | {b['ratio_to_floor']:.2f} | "
                       f"{o['graph_ms']:.3f} | {o['floor_ms']:.2f} | {o['ratio_to_floor']:.2f} | "
                       f"{b['graph_ms'] / o['graph_ms']:.2f}x |")
    if "off" in variants and len(variants) > 1:
        out += ["", "| context | cache | variant | off ms | variant ms | saved ms | variant / off |",
                "|---|---|---|---|---|---|---|"]
        for ctx in sorted({k[0] for k in by}):
            for kv in ("bf16", "oscar"):
                for v in variants:
                    if v == "off" or (ctx, kv, v) not in by or (ctx, kv, "off") not in by:
                        continue
                    off, r = by[(ctx, kv, "off")]["graph_ms"], by[(ctx, kv, v)]["graph_ms"]
                    out.append(f"| {ctx} | {kv} | {v} | {off:.3f} | {r:.3f} | {off - r:.3f} | {r / off:.3f} |")
    return out


def max_seqs(model, kv: str, ctx: int, budget_gb: float) -> int:
    slot, page, pages_for = store_sizes(model, kv)
    return int(budget_gb * 2**30 // (pages_for(ctx + 64) * page + slot))


def throughput(model, ctx: int, budget_gb: float, replays: int, log, gemv: str = "auto",
               pdls: tuple = (False,)) -> list[dict]:
    rows = []
    for kv in ("bf16", "oscar"):
        top = max_seqs(model, kv, ctx, budget_gb)
        for bs in sorted({b for b in (1, 8, top) if b <= top}):
            for pdl, gset in _variants(pdls):
                with gemv_set(model, gset):
                    llm = build(model, kv, bs, ctx, gemv=gemv, pdl=pdl)
                    r = time_decode(llm, fill_random(llm, bs, ctx), replays)
                r.update(kv=kv, context=ctx, pdl=pdl, gemv_set=gset, variant=variant_name(pdl, gset),
                         max_model_len=llm.engine.max_model_len,
                         budget_gb=budget_gb, max_batch_in_budget=top, tokens_per_s=bs / r["graph_ms"] * 1e3)
                rows.append(r)
                log(f"  throughput {kv:5s} ctx {ctx} bs {bs:>3d} pdl {r['variant']:11s}: "
                    f"{r['graph_ms']:.2f} ms/step, {r['tokens_per_s']:.0f} tok/s")
                release(llm)
    return rows


def memory(model, ctx: int) -> dict:
    """KV bytes per token of the stores :func:`build` makes: the paged tier alone, and per sequence of ``ctx``
    tokens with everything it holds (OSCAR: its 2-bit pages plus its whole 16-bit slot buffer)."""
    out = {}
    for kv in ("bf16", "oscar"):
        slot, page, pages_for = store_sizes(model, kv)
        paged = page / 64
        per_seq = pages_for(ctx) * page + slot
        out[kv] = {"paged_bytes_per_token": paged, "bytes_per_token_at_ctx": per_seq / ctx, "context": ctx}
    out["ratio_paged"] = out["bf16"]["paged_bytes_per_token"] / out["oscar"]["paged_bytes_per_token"]
    out["ratio_at_ctx"] = out["bf16"]["bytes_per_token_at_ctx"] / out["oscar"]["bytes_per_token_at_ctx"]
    return out


def run_checks(log) -> dict:
    """GPU correctness: Triton ops vs PyTorch at Qwen3-8B shapes; a tiny random Qwen3 (float32) through the
    engine (graphs, Triton ops) vs transformers; OSCAR on GPU (kernels) vs the CPU reference path."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from oscarkv.artifact import Calibration
    from oscarkv.config import QuantSpec
    from oscarkv.engine import LLM, SamplingParams
    from oscarkv.kernels import dense_triton
    from oscarkv.kernels import reference as ops
    from oscarkv.engine.attention import PrefillCtx
    from oscarkv.engine.llm import identity_of
    from oscarkv.rotation import random_orthogonal

    dev, res = "cuda", {}
    torch.manual_seed(0)
    x, r, w = (torch.randn(8, 4096, device=dev, dtype=torch.bfloat16) for _ in range(3))
    y, _ = dense_triton.rmsnorm(x, w[0], 1e-6, r)
    res["rmsnorm_max_err"] = (y.float() - ops.rmsnorm_ref(x + r, w[0], 1e-6).float()).abs().max().item()
    qkv = torch.randn(8, 48 * 128, device=dev, dtype=torch.bfloat16)
    ang = torch.rand(8, 64, device=dev)
    cs = [t.to(torch.bfloat16) for t in (torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin())]
    rk = torch.linalg.qr(torch.randn(8, 128, 128, device=dev))[0]
    mu = torch.randn(8, 128, device=dev)
    nw = torch.rand(128, device=dev, dtype=torch.bfloat16) + 0.5
    a = dense_triton.qk_prep(qkv, 32, 8, 128, *cs, nw, nw, 1e-6, rk, mu)
    b = ops.qk_prep_ref(qkv, 32, 8, 128, *cs, nw, nw, 1e-6, rk, mu)
    res["qk_prep_max_err"] = max((a[i].float() - b[i].float()).abs().max().item() for i in range(2))
    cfg = Qwen3Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
                      initializer_range=0.2, tie_word_embeddings=False)
    hf = Qwen3ForCausalLM(cfg).to(dev).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (5, 40, 300)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    with torch.no_grad():
        ref = [hf.generate(torch.tensor([p], device=dev), max_new_tokens=24, min_new_tokens=24,
                           do_sample=False)[0, len(p):].tolist() for p in prompts]
        llm = LLM(hf, kv="bf16", kv_budget_gb=0.05, max_num_seqs=4)
        got = [o.token_ids for o in llm.generate(prompts, params)]
        res["bf16_greedy_token_match"] = sum(a == b for x, y in zip(got, ref) for a, b in zip(x, y)) / (24 * 3)
        res["bf16_used_cuda_graphs"] = bool(llm.engine.graphs)
        toks = torch.tensor(prompts[2], device=dev)
        llm.store.table.add_pages(0, llm.store.allocator.allocate(5))
        ours = llm.model(toks, torch.arange(len(toks), device=dev), PrefillCtx(llm.store, 0, 0, len(toks), 0.125))
        res["bf16_prefill_logits_max_abs_err"] = (ours - hf(toks[None]).logits[0]).abs().max().item()
        spec = QuantSpec(sink=16, window=64, page_size=16, k_clip=0.96, v_clip=0.92)
        ident = identity_of(llm.model.cfg)
        rot = torch.stack([random_orthogonal(64, g) for _ in range(2)])
        calib = Calibration(spec=spec, model=ident, r_k=rot, r_v=rot.flip(0), eig_k=torch.zeros(2, 64),
                            eig_v=torch.zeros(2, 64), mu_k=torch.randn(2, 2, 64) * 0.2,
                            mu_v=torch.randn(2, 2, 64) * 0.2, k_clip=torch.full((2,), 0.96),
                            v_clip=torch.full((2,), 0.92))
        o_gpu = LLM(hf, calib, kv="oscar", kv_budget_gb=0.05, max_num_seqs=4, window_dtype=torch.float32)
        gpu = [o.token_ids for o in o_gpu.generate(prompts, params)]
        res["oscar_used_cuda_graphs"] = bool(o_gpu.engine.graphs)
        o_cpu = LLM(hf.cpu(), calib, kv="oscar", kv_budget_gb=0.05, max_num_seqs=4, window_dtype=torch.float32)
        cpu = [o.token_ids for o in o_cpu.generate(prompts, params)]
        res["oscar_gpu_vs_cpu_token_match"] = sum(a == b for x, y in zip(gpu, cpu) for a, b in zip(x, y)) / 72
    log(f"  correctness: {res}")
    return res


def write_plots(res: dict, out: str, log) -> list:
    """The result's plots next to ``out`` (``<stem>_latency.png`` etc.); a note instead where matplotlib (the
    ``eval`` extra) is missing."""
    from pathlib import Path

    from .bench_plots import plot_results

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
        with open(args.plot) as f:
            write_plots(json.load(f), args.plot, log)
        return 0
    import torch

    from oscarkv.engine.model import PRESETS, random_model

    if not torch.cuda.is_available():
        raise SystemExit("oscarkv bench needs a CUDA GPU (the CPU correctness checks are the test suite); "
                         "--plot JSON redraws an earlier run's plots without one")
    pdls = tuple(args.pdl) if isinstance(args.pdl, list) else tuple(parse_pdl(str(args.pdl)))
    from oscarkv.kernels import gemv_triton as triton_ops

    unknown = [g for _, g in pdls if g not in triton_ops.GEMV_SETS]
    if unknown:
        raise SystemExit(f"--pdl: unknown GEMV set(s) {unknown}: {sorted(triton_ops.GEMV_SETS)}")
    suites = {s.strip() for s in args.suites.split(",") if s.strip()}
    bad = suites - {"memory", "latency", "throughput"}
    if bad:
        raise SystemExit(f"--suites: unknown {sorted(bad)} (memory, latency, throughput)")
    res: dict = {"provenance": provenance(), "gemv": args.gemv, "max_model_len": args.max_model_len,
                 "pdl": [variant_name(*v) for v in pdls],
                 "note": "random weights; long "
                 "contexts filled with random K/V, not prefilled; decode timed as CUDA-graph replays",
                 "peak_bw": PEAK_BW, "models": {}}
    def guarded(name, fn, *a):  # one failing suite must not lose the others' results
        try:
            return fn(*a)
        except Exception as e:  # noqa: BLE001
            import traceback

            log(f"  {name} FAILED: {type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}")
            torch.cuda.empty_cache()
            return {"error": f"{type(e).__name__}: {e}"}

    if not args.skip_correctness:
        res["correctness"] = guarded("correctness", run_checks, log)
    contexts = [int(c) for c in args.contexts.split(",")]
    names = args.models.split(",")
    full = (args.latency_models or names[0]).split(",")
    for name in names:
        log(f"== {name}")
        model = random_model(PRESETS[name], dtype=torch.bfloat16, device="cuda")
        entry = {"weight_bytes": model.weight_bytes()}
        if "memory" in suites:
            entry["memory"] = guarded("memory", memory, model, args.throughput_context)
        ctxs = contexts if name in full else [c for c in contexts if c in (32768, 102400)]
        if "latency" in suites:
            def dump(rows, entry=entry, name=name):  # partial results, should the run be cut short
                res["models"][name] = {**entry, "latency": rows}
                with open(args.out, "w") as f:
                    json.dump(res, f, indent=1)
            entry["latency"] = guarded("latency", latency, model, ctxs, args.replays, log, args.gemv, pdls, dump,
                                        args.max_model_len)
            if isinstance(entry["latency"], list):
                table = latency_table(entry["latency"])
                entry["latency_table"] = table
                log(f"== {name} batch-1 decode step (CUDA-graph replay), gemv={args.gemv}\n" + "\n".join(table))
        if name in full and "throughput" in suites:
            entry["throughput"] = guarded("throughput", throughput, model, args.throughput_context, args.budget_gb,
                                          max(1, args.replays // 3), log, args.gemv, pdls)
        res["models"][name] = entry
        del model
        torch.cuda.empty_cache()
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    log(f"wrote {args.out}")
    write_plots(res, args.out, log)
    return 0
