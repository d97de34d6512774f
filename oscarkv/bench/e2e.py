"""End-to-end engine benchmarks through the engine's public API (``LLM``, ``submit``, ``step``, ``gauges``):
batch-1 decode step against context (with its physical floor), the equal-batch table (BF16 against OSCAR at the
same batch and context), decode throughput under one KV budget, and KV bytes per token, on random-weight models
(:data:`oscarkv.engine.PRESETS`).

Latency and throughput: prompts of random token ids (``HEADROOM`` tokens short of the context) are prefilled for
real, one prompt per step (``prefill_chunk`` = the prompt), so a sequence that already decodes gains one token per
later prompt. The equal-batch table seeds its caches instead (:func:`seed`: pages reserved and counted, no
prefill), because prefilling 16 sequences of 128K tokens would take minutes per cell; a decode step reads the same
bytes either way, and the table repeats the latency suite's batch-1 rows as a check. Decode steps are then timed
as a user sees them: ``steps`` consecutive ``LLM.step()`` calls (scheduling, sampling, demotions and host work
included; the engine launches each step before it reads the previous one's tokens), wall time per step, next to
one replay of the step's CUDA graph. Physical floor = (weight bytes + KV bytes in use) / the GPU's peak
bandwidth (:func:`peak_bandwidth`).

Everything that depends on how the engine is configured sits in :func:`make_llm`, :func:`seed` and
:func:`pages_per_sequence`.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable

import torch

from .harness import CorrectnessError, Timer

PEAK_BW = {"H200": 4.7e12, "H100": 3.35e12}  # HBM read bandwidth, bytes/s (H100: the SXM part's nominal figure)
HEADROOM = 128  # prompt tokens short of the context: room for the tokens decoded while others prefill and timed
WARMUP_STEPS = 2  # the first decode step of a batch size captures its CUDA graph


def peak_bandwidth() -> float:
    """The peak memory bandwidth of the current GPU (bytes/s) for the floors; H200's where the name is unknown."""
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
    return next((bw for key, bw in PEAK_BW.items() if key in name), PEAK_BW["H200"])


# ------------------------------------------------------------------------------- engine coupling
def _tensor(layout: str, bits: int, clip: float) -> dict:
    return {"layout": layout, "bits": bits, "rotation": "none" if layout == "channel" else "calibrated",
            **({} if layout == "channel" else {"clip": clip})}


# The per-layer mix of ``kv="oscar-mix"``, cycled over the layers: every key and value format the selection can
# pick (keys token/channel x 2/4 bits, values 2/4 bits), as a selected artifact mixes them.
MIX = [{"k": _tensor(kl, kb, 0.96), "v": _tensor("token", vb, 0.92)}
       for kl, kb, vb in (("token", 2, 2), ("channel", 2, 2), ("token", 4, 4), ("channel", 4, 2), ("token", 2, 4))]
CACHES = ("bf16", "oscar", "oscar-mix")


def make_llm(model, kv: str, *, max_num_seqs: int, max_model_len: int, kv_budget_gb: float, gemv: str = "auto",
             pdl: bool = True, prefill_chunk: int = 2048):
    """An engine over ``model`` (an engine ``Transformer``) with a ``kv`` pool of ``kv_budget_gb`` GiB: "bf16",
    "oscar" (2-bit token pages in every layer) or "oscar-mix" (per-layer formats, :data:`MIX`). The OSCAR caches
    get an identity calibration (random weights have nothing to calibrate on; rotations do not change the cost
    of a step)."""
    from oscarkv.artifact import Calibration, ModelIdentity
    from oscarkv.config import QuantSpec
    from oscarkv.engine import LLM

    if kv not in CACHES:
        raise ValueError(f"kv must be one of {', '.join(CACHES)}, got {kv!r}")
    calib, method = None, None
    if kv != "bf16":
        c = model.cfg
        ident = ModelIdentity(c.arch, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.hidden_size)
        calib = Calibration.identity(ident, QuantSpec(k_clip=0.96, v_clip=0.92, centering=False, composition="none"),
                                     clip=0.96)
        if kv == "oscar-mix":
            calib.layer_formats = [MIX[i % len(MIX)] for i in range(c.num_layers)]
            method = "oscar-auto"
    return LLM(model, calib, kv="bf16" if kv == "bf16" else "oscar", method=method, kv_budget_gb=kv_budget_gb,
               max_num_seqs=max_num_seqs, max_model_len=max_model_len, prefill_chunk=prefill_chunk,
               monitor_every=0, gemv=gemv, pdl=pdl)


def pages_per_sequence(llm, tokens: int) -> int:
    """KV pages one sequence of ``tokens`` tokens occupies in ``llm``'s pool."""
    return llm.store.pages_for(tokens)


# ---------------------------------------------------------------------------------------- helpers
def free_memory() -> None:
    """Return the memory of engines no longer referenced to the GPU (the caller drops its references first: an
    engine still named in the caller's frame keeps its pool, and the next pool would be allocated beside it)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def bf16_bytes_per_token(model) -> int:
    c = model.cfg
    return 2 * c.num_layers * c.num_kv_heads * c.head_dim * 2


def prefill(llm, n_seqs: int, prompt_len: int, max_tokens: int, seed: int = 0) -> dict:
    """Submit ``n_seqs`` random prompts and step until every admitted one decodes; returns how many run
    (``running``), the wall time of the prefill phase and the sequences."""
    from oscarkv.engine import SamplingParams

    g = torch.Generator().manual_seed(seed)
    vocab = llm.model.cfg.vocab_size
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    seqs = [llm.submit(torch.randint(0, vocab, (prompt_len,), generator=g).tolist(), params) for _ in range(n_seqs)]
    _sync()
    t0 = time.perf_counter()
    while True:
        llm.step()
        running = int(llm.gauges()["running_requests"])
        if running and sum(1 for s in seqs if s.out) >= running:
            break
    _sync()
    return {"running": running, "prefill_s": time.perf_counter() - t0, "seqs": seqs}


def _on_cuda(model) -> bool:
    return next(model.parameters()).device.type == "cuda"


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def seed(llm, n_seqs: int, prompt_len: int, max_tokens: int, seed: int = 0) -> dict:
    """Submit ``n_seqs`` random prompts and mark each admitted one's cache as holding its prompt but the last
    token, without computing it (pages reserved, token counts and 2-bit tier sizes as after a prefill; contents
    as allocated): its next decode step reads exactly the bytes of a prefilled cache of that length. Returns
    ``running`` and the sequences."""
    from oscarkv.engine import SamplingParams

    g = torch.Generator().manual_seed(seed)
    vocab = llm.model.cfg.vocab_size
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    seqs = [llm.submit(torch.randint(0, vocab, (prompt_len,), generator=g).tolist(), params) for _ in range(n_seqs)]
    eng = llm.engine
    eng.scheduler.admit()
    for seq in eng.running:
        llm.store.commit(seq.slot, prompt_len - 1)
        seq.n_cached, seq.in_prefill = prompt_len - 1, False
        eng.runner.set_next_token(seq.slot, seq.prompt[-1])
    _sync()
    return {"running": len(eng.running), "seqs": seqs}


def time_steps(llm, timer: Timer, steps: int) -> dict:
    """``steps`` consecutive ``LLM.step()`` calls of the running batch (which must stay the same): wall time per
    step (median of the intervals between returns, and the mean over the run: the inter-token time a user
    sees), and the median replay of the step's CUDA graph alone (``replay_ms``; cold L2)."""
    before = int(llm.gauges()["running_requests"])
    for _ in range(WARMUP_STEPS):
        llm.step()
    _sync()
    marks = [time.perf_counter()]
    for _ in range(steps):
        llm.step()
        marks.append(time.perf_counter())
    _sync()
    end = time.perf_counter()
    after = llm.gauges()
    if int(after["running_requests"]) != before or int(after["waiting_requests"]):
        raise RuntimeError(f"the batch changed while timed ({before} -> {int(after['running_requests'])} running)")
    gaps = [(b - a) * 1e3 for a, b in zip(marks, marks[1:])]
    out = {"step_ms": statistics.median(gaps), "step_mean_ms": (end - marks[0]) * 1e3 / steps,
           "step_min_ms": min(gaps), "step_max_ms": max(gaps), "steps": steps}
    graphs = llm.engine.graphs
    bs = llm.engine.runner.batch_size(before)
    if bs in graphs:  # replays recompute the last launched step: same inputs, same rows written
        out["replay_ms"] = timer(graphs[bs][0].replay, reps=steps, warmup=1).median_ms
        out["step_to_replay"] = out["step_ms"] / out["replay_ms"]
    return out


def _check_context(ctx: int) -> None:
    if ctx <= 2 * HEADROOM:
        raise ValueError(f"contexts must exceed {2 * HEADROOM} tokens (prompts stop {HEADROOM} short), got {ctx}")


def _max_tokens(steps: int, n_seqs: int) -> int:
    """Tokens each request may generate: those decoded while later prompts prefill, the warm-up and the timed
    steps, and a margin; the prompt plus these stay within the context."""
    need = n_seqs + WARMUP_STEPS + steps + 1
    if need + 8 > HEADROOM:
        raise ValueError(f"steps must be at most {HEADROOM - 9 - WARMUP_STEPS - n_seqs} with {n_seqs} sequences, "
                         f"got {steps}")
    return need + 8


# ----------------------------------------------------------------------------------------- suites
def latency(model, contexts: list[int], timer: Timer, steps: int, log: Callable[[str], None], *, gemv: str = "auto",
            pdls: tuple[bool, ...] = (True,), max_model_len: int | None = None,
            caches: tuple[str, ...] = ("bf16", "oscar")) -> list[dict]:
    """One sequence per context, cache (of :data:`CACHES`) and pdl setting: prefill, then the median decode step
    and its floor."""
    rows = []
    for ctx in contexts:
        _check_context(ctx)
        for kv in caches:
            for pdl in pdls:
                max_tokens = _max_tokens(steps, 1)
                llm = make_llm(model, kv, max_num_seqs=1, max_model_len=max(ctx, max_model_len or 0),
                               kv_budget_gb=1.1 * ctx * bf16_bytes_per_token(model) / 2**30 + 0.01, gemv=gemv,
                               pdl=pdl, prefill_chunk=ctx - HEADROOM)
                pre = prefill(llm, 1, ctx - HEADROOM, max_tokens)
                r = time_steps(llm, timer, steps)
                r["tokens"] = list(pre["seqs"][0].out[:16])  # greedy: equal across engine versions on one GPU
                g, wbytes = llm.gauges(), model.weight_bytes()  # after the OSCAR fold (an o_proj bias for the means)
                kv_bytes = g["kv_pool_used_bytes"]
                floor = (wbytes + kv_bytes) / peak_bandwidth() * 1e3
                r.update(kv=kv, context=ctx, pdl=pdl, prefill_s=pre["prefill_s"], floor_ms=floor,
                         ratio_to_floor=r["step_ms"] / floor, kv_bytes_read=kv_bytes, weight_bytes=wbytes,
                         kv_bits_per_element=g["kv_bits_per_element"],
                         kv_paged_bits_per_element=g["kv_paged_bits_per_element"])
                rows.append(r)
                log(f"  latency {kv:9s} ctx {ctx:>6d} pdl {'on' if pdl else 'off'}: {r['step_ms']:.3f} ms (floor "
                    f"{floor:.3f}, x{r['ratio_to_floor']:.2f}); prefill {pre['prefill_s']:.1f} s")
                del llm
                free_memory()
    return rows


def fit_batch(model, kv: str, ctx: int, budget_gb: float, cap: int, **kw) -> int:
    """The most sequences of ``ctx`` tokens a ``budget_gb`` pool holds (its slots' 16-bit tiers included:
    fewer slots leave more pages), at most ``cap``."""
    def fits(m: int) -> int:
        llm = make_llm(model, kv, max_num_seqs=m, max_model_len=ctx, kv_budget_gb=budget_gb, **kw)
        n = int(llm.gauges()["kv_pages_total"]) // pages_per_sequence(llm, ctx)
        del llm
        free_memory()
        return n

    m = min(cap, fits(cap))
    while m < cap and fits(m + 1) >= m + 1:
        m += 1
    if m < 1:
        raise ValueError(f"not one {ctx}-token sequence fits a {budget_gb} GiB {kv} pool")
    return m


def throughput(model, ctx: int, budget_gb: float, timer: Timer, steps: int, log: Callable[[str], None], *,
               gemv: str = "auto", pdl: bool = True, cap: int = 64) -> list[dict]:
    """Per cache, as many ``ctx``-token sequences as fit under one KV budget, decoding together."""
    _check_context(ctx)
    rows = []
    for kv in ("bf16", "oscar"):
        n = fit_batch(model, kv, ctx, budget_gb, cap, gemv=gemv, pdl=pdl)
        max_tokens = _max_tokens(steps, n)
        llm = make_llm(model, kv, max_num_seqs=n, max_model_len=ctx, kv_budget_gb=budget_gb, gemv=gemv, pdl=pdl,
                       prefill_chunk=ctx - HEADROOM)
        pre = prefill(llm, n, ctx - HEADROOM, max_tokens)
        if pre["running"] != n:
            raise RuntimeError(f"{kv}: {pre['running']} of {n} sequences were admitted under {budget_gb} GiB")
        r = time_steps(llm, timer, steps)
        r.update(kv=kv, context=ctx, batch=n, budget_gb=budget_gb, pdl=pdl, prefill_s=pre["prefill_s"],
                 tokens_per_s=n / r["step_ms"] * 1e3)
        rows.append(r)
        log(f"  throughput {kv:5s} ctx {ctx} batch {n:>3d}: {r['step_ms']:.2f} ms/step, {r['tokens_per_s']:.0f} tok/s")
        del llm
        free_memory()
    return rows


def _pool_gb(model, kv: str, n: int, ctx: int) -> float:
    """A KV budget that holds ``n`` sequences of ``ctx`` tokens in a ``kv`` pool (16-bit tiers included)."""
    bf16 = n * ctx * bf16_bytes_per_token(model) / 2**30
    return 1.02 * bf16 + 0.05 if kv == "bf16" else bf16 / 4 + 0.25


def equal_batch(model, contexts: list[int], batches: list[int], timer: Timer, steps: int,
                log: Callable[[str], None], *, gemv: str = "auto", pdl: bool = True,
                caches: tuple[str, ...] = ("bf16", "oscar")) -> list[dict]:
    """Per context, batch and cache, the decode step of ``batch`` sequences of ``context`` tokens (caches seeded,
    :func:`seed`) and its floor. A pool that does not fit the GPU's free memory is recorded as such, not run."""
    rows = []
    for ctx in contexts:
        _check_context(ctx)
        for bs in batches:
            for kv in caches:
                budget = _pool_gb(model, kv, bs, ctx)
                free = torch.cuda.mem_get_info()[0] / 2**30 if _on_cuda(model) else float("inf")
                row = {"kv": kv, "context": ctx, "batch": bs, "budget_gb": budget}
                if budget > free - 4:  # room for activations, graphs and the decode workspace
                    row.update(fits=False, free_gb=free)
                    rows.append(row)
                    log(f"  equal-batch {kv:9s} ctx {ctx:>6d} batch {bs:>3d}: does not fit ({budget:.1f} GiB of KV, "
                        f"{free:.1f} free)")
                    continue
                llm = make_llm(model, kv, max_num_seqs=bs, max_model_len=ctx, kv_budget_gb=budget, gemv=gemv,
                               pdl=pdl)
                pre = seed(llm, bs, ctx - HEADROOM, _max_tokens(steps, 1))
                if pre["running"] != bs:
                    raise RuntimeError(f"{kv}: {pre['running']} of {bs} sequences fit a {budget:.1f} GiB pool")
                r = time_steps(llm, timer, steps)
                kv_bytes = llm.gauges()["kv_pool_used_bytes"]
                floor = (model.weight_bytes() + kv_bytes) / peak_bandwidth() * 1e3
                row.update(r, fits=True, floor_ms=floor, ratio_to_floor=r["step_ms"] / floor, kv_bytes_read=kv_bytes,
                           tokens_per_s=bs / r["step_ms"] * 1e3)
                rows.append(row)
                log(f"  equal-batch {kv:9s} ctx {ctx:>6d} batch {bs:>3d}: {r['step_ms']:.3f} ms (replay "
                    f"{r.get('replay_ms', float('nan')):.3f}, floor {floor:.3f})")
                del llm
                free_memory()
    return rows


def equal_batch_table(rows: list[dict]) -> list[str]:
    """Markdown: per context and batch, BF16 and OSCAR steps, floors and OSCAR's speed-up (the floors' ratio is
    the bound)."""
    by = {(r["context"], r["batch"], r["kv"]): r for r in rows}
    out = ["| context | batch | BF16 ms | floor | OSCAR ms | replay | floor | OSCAR speed-up | bound (floors) |",
           "|---|---|---|---|---|---|---|---|---|"]
    for ctx, bs in sorted({(c, b) for c, b, _ in by}):
        b, o = by.get((ctx, bs, "bf16")), by.get((ctx, bs, "oscar"))
        if not o or not o.get("fits"):
            continue
        if b and b.get("fits"):
            cells = (f"{b['step_ms']:.3f} | {b['floor_ms']:.2f}", f"{b['step_ms'] / o['step_ms']:.2f}x",
                     f"{b['floor_ms'] / o['floor_ms']:.2f}x")
        else:
            cells = ("does not fit | —", "—", "—")
        out.append(f"| {ctx} | {bs} | {cells[0]} | {o['step_ms']:.3f} | {o.get('replay_ms', float('nan')):.3f} | "
                   f"{o['floor_ms']:.2f} | {cells[1]} | {cells[2]} |")
    return out


def memory(latency_rows: list[dict], model) -> dict | None:
    """KV bytes per token at the longest context both caches ran: the paged tier alone, and per sequence with
    its 16-bit tiers (from the pools' own gauges)."""
    per_elem = model.cfg.num_layers * model.cfg.num_kv_heads * model.cfg.head_dim * 2
    ok = {kv: [r for r in latency_rows if r["kv"] == kv] for kv in ("bf16", "oscar")}
    if not all(ok.values()):
        return None
    out = {}
    for kv, rows in ok.items():
        r = max(rows, key=lambda x: x["context"])
        out[kv] = {"paged_bytes_per_token": r["kv_paged_bits_per_element"] * per_elem / 8,
                   "bytes_per_token_at_ctx": r["kv_bits_per_element"] * per_elem / 8, "context": r["context"]}
    out["ratio_paged"] = out["bf16"]["paged_bytes_per_token"] / out["oscar"]["paged_bytes_per_token"]
    out["ratio_at_ctx"] = out["bf16"]["bytes_per_token_at_ctx"] / out["oscar"]["bytes_per_token_at_ctx"]
    return out


def _pairs(rows: list[dict], first: str, second: str):
    """``(context, pdl, row of first, row of second)`` for every context and pdl setting both caches ran."""
    by = {(r["context"], r["kv"], r["pdl"]): r for r in rows}
    for ctx, pdl in sorted({(k[0], k[2]) for k in by}):
        x, y = by.get((ctx, first, pdl)), by.get((ctx, second, pdl))
        if x and y:
            yield ctx, pdl, x, y


def mix_table(rows: list[dict]) -> list[str]:
    """Markdown: per context and pdl setting, the per-layer mix against plain ``oscar``: steps, and the steps
    relative to each cache's own floor (equal bytes: the mix reads more bytes where it holds 4-bit layers)."""
    out = ["| context | pdl | oscar ms | x floor | oscar-mix ms | x floor | mix / oscar | at equal bytes |",
           "|---|---|---|---|---|---|---|---|"]
    for ctx, pdl, o, m in _pairs(rows, "oscar", "oscar-mix"):
        out.append(f"| {ctx} | {'on' if pdl else 'off'} | {o['step_ms']:.3f} | {o['ratio_to_floor']:.2f} | "
                   f"{m['step_ms']:.3f} | {m['ratio_to_floor']:.2f} | {m['step_ms'] / o['step_ms']:.2f}x | "
                   f"{m['ratio_to_floor'] / o['ratio_to_floor']:.2f}x |")
    return out


def latency_table(rows: list[dict]) -> list[str]:
    """Markdown: per context and pdl setting, BF16 and OSCAR engine step / graph replay / floor and OSCAR's
    speed-up (of the engine steps)."""
    out = ["| context | pdl | BF16 step ms | replay | floor | OSCAR step ms | replay | floor | step / replay | "
           "OSCAR speed-up |", "|---|---|---|---|---|---|---|---|---|---|"]
    nan = float("nan")
    for ctx, pdl, b, o in _pairs(rows, "bf16", "oscar"):
        out.append(f"| {ctx} | {'on' if pdl else 'off'} | {b['step_ms']:.3f} | {b.get('replay_ms', nan):.3f} | "
                   f"{b['floor_ms']:.2f} | {o['step_ms']:.3f} | {o.get('replay_ms', nan):.3f} | {o['floor_ms']:.2f} | "
                   f"{o.get('step_to_replay', nan):.3f} | {b['step_ms'] / o['step_ms']:.2f}x |")
    return out


# ------------------------------------------------------------------------------------ correctness
def check_engine(device: str, log: Callable[[str], None], min_match: float = 0.95) -> dict:
    """The engine against references on a tiny random Qwen3 (float32): BF16 cache, greedy tokens against
    transformers' ``generate``; on CUDA also the OSCAR cache's tokens against the same engine on the CPU
    (reference kernels). Raises :class:`CorrectnessError` below ``min_match`` of tokens equal."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from oscarkv.artifact import Calibration, ModelIdentity
    from oscarkv.config import QuantSpec
    from oscarkv.engine import LLM, SamplingParams
    from oscarkv.rotation import random_orthogonal

    cfg = Qwen3Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
                      initializer_range=0.2, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = Qwen3ForCausalLM(cfg).to(device).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (5, 40, 300)]
    new = 24
    params = SamplingParams(max_tokens=new, ignore_eos=True)

    def match(a: list[list[int]], b: list[list[int]]) -> float:
        return sum(x == y for p, q in zip(a, b) for x, y in zip(p, q)) / (new * len(prompts))

    res = {}
    with torch.no_grad():
        ref = [hf.generate(torch.tensor([p], device=device), max_new_tokens=new, min_new_tokens=new,
                           do_sample=False)[0, len(p):].tolist() for p in prompts]
        got = [o.token_ids for o in LLM(hf, kv="bf16", kv_budget_gb=0.05, max_num_seqs=4).generate(prompts, params)]
        res["bf16_vs_transformers_token_match"] = match(got, ref)
        if device == "cuda":
            spec = QuantSpec(sink=16, window=64, page_size=16, k_clip=0.96, v_clip=0.92)
            rot = torch.stack([random_orthogonal(64, g) for _ in range(2)])
            calib = Calibration(spec=spec, model=ModelIdentity("qwen3", 2, 8, 2, 64, 256), r_k=rot, r_v=rot.flip(0),
                                eig_k=torch.zeros(2, 64), eig_v=torch.zeros(2, 64), mu_k=torch.randn(2, 2, 64) * 0.2,
                                mu_v=torch.randn(2, 2, 64) * 0.2, k_clip=torch.full((2,), 0.96),
                                v_clip=torch.full((2,), 0.92))
            outs = {}
            for dev in ("cuda", "cpu"):
                llm = LLM(hf.to(dev), calib, kv="oscar", kv_budget_gb=0.05, max_num_seqs=4,
                          window_dtype=torch.float32)
                outs[dev] = [o.token_ids for o in llm.generate(prompts, params)]
            hf.to(device)
            res["oscar_cuda_vs_cpu_token_match"] = match(outs["cuda"], outs["cpu"])
    log(f"  correctness: {res}")
    bad = {k: v for k, v in res.items() if v < min_match}
    if bad:
        raise CorrectnessError(f"engine tokens differ from the reference: {bad} (need >= {min_match})")
    return res


__all__ = ["PEAK_BW", "peak_bandwidth", "make_llm", "pages_per_sequence", "prefill", "seed", "time_steps", "latency",
           "equal_batch", "equal_batch_table", "throughput", "memory",
           "fit_batch", "free_memory", "latency_table", "check_engine"]
