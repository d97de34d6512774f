"""Teacher-forced language-model metrics (tasks ``kld``, ``ppl`` and ``code``): one pass per window and method.

For each window of held-out text the reference's final hidden states are computed once (cached on disk); each
method's hidden states come from one of two paths:

* ``simulate`` (default): one forward pass under ``backend.simulate``: every position sees the context exactly
  as the method's cache would hold it during a token-by-token decode (plain PyTorch, any device);
* ``cache``: the text goes through the method's real cache in chunks of ``prefill_chunk`` tokens (chunked
  prefill: a chunk attends to the earlier chunks as stored and to itself in full precision), several windows
  in one batch. On CUDA this runs the kernels the cache dispatches to; each record says which path served its
  attention calls (:mod:`oscarkv.eval.paths`). It equals ``simulate`` with the same chunking
  (``simulate(..., chunk=prefill_chunk)``) to the kernels' tolerance, and differs from the decode semantics only
  in that a position also sees the up to ``prefill_chunk - 1`` earlier tokens of its own chunk unquantized.

Scored positions are ``score_from .. T-2`` (``score_from`` defaults to ``sink + window``), predicting tokens
``score_from+1 .. T-1``. Per window and method we record mean KL(ref || method) in nats, top-1 agreement, NLL of
method and reference (-> perplexity), the relative L2 error of the logits, the same sums per position bucket of
``bucket`` tokens (the error-versus-context curve), the physical bits per stored element at the end of each
bucket, and with ``lines=True`` the next-line exact match of every line (:mod:`oscarkv.eval.lines`).
The output head runs once per position for the reference and once per method (:func:`compare_heads`).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

from .backend import cache_kwarg, decoder, final_hidden, output_head
from .context import EvalContext
from .lines import score_lines
from .metrics import compare_heads, peak_memory
from .paths import path_summary, quantized_layer_count, record_kernel_paths

TASK = "lm"
PATHS = ("simulate", "cache")


def run_lm(ctx: EvalContext, methods: list[str], length: int, n_windows: int, *, chunk: int = 256,
           bucket: int = 1024, path: str = "simulate", prefill_chunk: int = 64, batch: int = 1, lines: bool = False,
           simulate_chunk: int = 1, deadline: float | None = None) -> list[dict]:
    """Evaluate ``methods`` on up to ``n_windows`` windows of ``length`` tokens; returns the new records (finished
    units found in the store are skipped; ``methods`` run in the given order). ``simulate_chunk``: the
    simulation's chunk (1: decode semantics; the cache path's ``prefill_chunk``: the same semantics as the cache
    path, a cross-check). ``deadline`` (``time.monotonic()`` value): start no new window (batch
    of windows on the cache path), nor a new method on it, after it; every unit on file is complete."""
    if path not in PATHS:
        raise ValueError(f"path must be one of {list(PATHS)}, got {path!r}")
    if prefill_chunk < 1 or batch < 1 or bucket < 1:
        raise ValueError(f"prefill_chunk, batch and bucket must be >= 1, got {prefill_chunk}, {batch}, {bucket}")
    wins = ctx.windows(length, n_windows)
    if ctx.score_from >= length - 1:
        raise ValueError(f"score_from={ctx.score_from} leaves no scored position in a {length}-token window; "
                         "use a longer --context or a smaller --score-from")
    protocol: dict[str, Any] = {"score_from": ctx.score_from, "windows": "consecutive"}
    if path == "cache":
        protocol.update(path="cache", prefill_chunk=prefill_chunk, **ctx.cache_protocol(force=True))
    if lines:
        protocol["lines"] = True
    if path == "simulate" and simulate_chunk != 1:
        protocol["simulate_chunk"] = simulate_chunk
    runs = {m: ctx.run_id(TASK, m, length, **protocol) for m in methods}
    paths = {m: ctx.store.path(ctx.model_name, ctx.text.name, m, TASK, length) for m in methods}
    done = {m: ctx.store.done(paths[m], runs[m]) for m in methods}
    todo = {i: [m for m in methods if f"w{i}" not in done[m]] for i in range(len(wins))}
    todo = {i: ms for i, ms in todo.items() if ms}
    head = output_head(ctx.model)
    size = batch if path == "cache" else 1
    groups = [list(todo)[j: j + size] for j in range(0, len(todo), size)]
    new: list[dict] = []
    bar = tqdm(total=sum(len(ms) for ms in todo.values()), desc=f"{ctx.model_name} lm@{length} ({path})",
               disable=not ctx.progress, unit="pass")
    for group in groups:
        if deadline is not None and time.monotonic() > deadline:
            break
        hidden: dict[int, dict[str, Tensor]] = {i: {} for i in group}
        info: dict[tuple[int, str], dict] = {}
        for m in dict.fromkeys(m for i in group for m in todo[i]):
            if deadline is not None and time.monotonic() > deadline and m != ctx.reference:
                break  # the methods that ran are scored; the others resume on the next run
            idx = [i for i in group if m in todo[i]]
            bar.set_postfix_str(f"w{idx[0]}{'..' if len(idx) > 1 else ''} {m}")
            t0 = time.perf_counter()
            if m == ctx.reference:  # the reference's own pass: KLD 0 by definition, no second forward
                for i in idx:
                    hidden[i][m] = ctx.reference_hidden(wins[i], _ref_label(ctx, length, i))
                extra: dict = {"path": "self"}  # the reference itself: no pass of its own
            elif path == "simulate":
                chunking = {"chunk": simulate_chunk} if simulate_chunk > 1 else {}
                with peak_memory(ctx.model) as mem, ctx.simulate(m, **chunking):
                    hidden[idx[0]][m] = final_hidden(ctx.model, wins[idx[0]])
                extra = {"path": "simulate", **mem}
            else:
                hs, extra = cache_pass(ctx, m, torch.stack([wins[i] for i in idx]), prefill_chunk)
                for k, i in enumerate(idx):
                    hidden[i][m] = hs[k]
            sec = time.perf_counter() - t0
            for i in idx:
                info[i, m] = {"forward_s": round(sec / len(idx), 2), **extra}
            bar.update(len(idx))
        for i in group:
            new += _score_window(ctx, head, wins[i], i, length, hidden[i], info, runs, paths, chunk, bucket, lines)
    bar.close()
    return new


def _ref_label(ctx: EvalContext, length: int, i: int) -> str:
    return f"{ctx.text.name}_{length}_w{i}"


def _score_window(ctx: EvalContext, head: Any, ids: Tensor, i: int, length: int, hidden: dict[str, Tensor],
                  info: dict, runs: dict, paths: dict, chunk: int, bucket: int, lines: bool) -> list[dict]:
    """Compare every method's hidden states of window ``i`` with the reference and append one record each."""
    ref = ctx.reference_hidden(ids, _ref_label(ctx, length, i))
    lo, hi = ctx.score_from, ids.numel() - 1
    t0 = time.perf_counter()
    targets = ids[lo + 1:]
    stats = compare_heads(head, ref[lo:hi], {m: h[lo:hi].to(ref.device) for m, h in hidden.items()},
                          targets.to(ref.device), chunk=chunk)
    stats_s = (time.perf_counter() - t0) / max(len(stats), 1)
    positions = torch.arange(lo, hi)
    out = []
    for m, st in stats.items():
        rec = ctx.base_record(TASK, m, length, runs[m], f"w{i}")
        bk = st.buckets(positions, bucket, targets)
        ends = [min((b + 1) * bucket, ids.numel()) for b in range(len(bk["n"]))]
        rec.update(window=i, tokens=int(ids.numel()), score_from=lo, stats_s=round(stats_s, 2), **info[i, m],
                   **st.totals().means(), buckets=bk, bits_physical_at=ctx.physical_bits(m, ends))
        if lines:
            sc = score_lines(ctx.line_table(), ids, lo, st.pred, st.pred_ref)
            rec["lines"] = {"min_chars": 3, **sc.buckets(bucket, len(bk["n"]))}
        ctx.store.append(paths[m], rec)
        out.append(rec)
    return out


@torch.inference_mode()
def cache_pass(ctx: EvalContext, method: str, ids: Tensor, prefill_chunk: int) -> tuple[Tensor, dict]:
    """Final hidden states ``[B, T, D]`` (float32) of windows ``ids`` ``[B, T]`` fed through a fresh cache of
    ``method`` ``prefill_chunk`` tokens at a time, and the record of the path its attention took."""
    model = ctx.model
    dev = next(model.parameters()).device
    body = decoder(model)
    kw = cache_kwarg(body)
    B, T = ids.shape
    ids = ids.to(dev)
    out = torch.empty(B, T, model.config.get_text_config().hidden_size, dtype=torch.float32, device=dev)
    calls = 0
    with peak_memory(model) as mem, ctx.cache(method) as new_cache, record_kernel_paths() as counts:
        cache = new_cache()
        for s in range(0, T, prefill_chunk):
            h = body(input_ids=ids[:, s: s + prefill_chunk], **{kw: cache}, use_cache=True).last_hidden_state
            out[:, s: s + h.shape[1]] = h.float()
            calls += 1
        layers = quantized_layer_count(cache)
    # the cache hands each layer's attention to the dispatcher once per chunk, for the whole batch
    return out, {**path_summary(counts, calls * layers), **mem}


__all__ = ["run_lm", "cache_pass", "TASK", "PATHS"]
