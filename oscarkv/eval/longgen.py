"""Long generation (task ``longgen``): how far a method's greedy decode follows the reference's, and the KL along
the reference's trajectory.

For each prompt (a window of held-out text) the model decodes ``new_tokens`` tokens greedily with its own
16-bit cache (transformers' cache in the model's dtype: BF16 generation as users run it); several prompts decode
as one batch. Then every method (the ``bf16`` method included, which measures the floor: the same tokens
through another attention code path) is run teacher-forced over prompt + trajectory, through its real cache
(``path="cache"``, chunks of ``prefill_chunk`` tokens, the kernels on CUDA) or the simulation (``"simulate"``:
the prompt prefilled in one pass, then token by token, exactly). Recorded per prompt and method, over the
generated positions: ``first_div`` (the first generated token where the method's argmax differs from the
trajectory: while they agree, the method's own greedy decode *is* the trajectory, so this is where it would
first diverge), the mean KL(reference || method) with the reference = the ``bf16`` method's teacher-forced
simulation on the same tokens, top-1 agreement, and the KL per ``bucket`` generated tokens.
"""

from __future__ import annotations

import time

import torch
from torch import Tensor
from tqdm.auto import tqdm

from .backend import final_hidden, greedy_generate_batch, output_head
from .context import EvalContext
from .lm import cache_pass
from .metrics import compare_heads, peak_memory
from .store import read_jsonl

TASK = "longgen"


def run_longgen(ctx: EvalContext, methods: list[str], length: int, n_prompts: int, *, new_tokens: int = 2048,
                bucket: int = 256, path: str = "cache", prefill_chunk: int = 64, batch: int = 1,
                chunk: int = 256, deadline: float | None = None) -> list[dict]:
    """Trajectories of ``new_tokens`` tokens after ``n_prompts`` prompts of ``length`` tokens, and every method
    teacher-forced along them; resumable per prompt (trajectories are stored as the ``longgen-ref`` task)."""
    if path not in ("cache", "simulate"):
        raise ValueError(f"path must be 'cache' or 'simulate', got {path!r}")
    prompts = ctx.windows(length, n_prompts)
    ref_run = ctx.run_id(TASK + "-ref", "model", length, new_tokens=new_tokens)
    ref_path = ctx.store.path(ctx.model_name, ctx.text.name, "model", TASK + "-ref", length)
    trajs = {r["key"]: r["tokens"] for r in read_jsonl(ref_path) if r.get("run") == ref_run}
    missing = [i for i in range(len(prompts)) if f"p{i}" not in trajs]
    for j in tqdm(range(0, len(missing), batch), desc=f"{ctx.model_name} longgen trajectories",
                  disable=not ctx.progress):
        if deadline is not None and time.monotonic() > deadline:
            break
        group = missing[j: j + batch]
        t0 = time.perf_counter()
        with peak_memory(ctx.model) as mem:
            outs = greedy_generate_batch(ctx.model, [prompts[i] for i in group], _model_cache(ctx), new_tokens,
                                         chunk=prefill_chunk * 16)
        sec = time.perf_counter() - t0
        for i, toks in zip(group, outs):
            rec = ctx.base_record(TASK + "-ref", "model", length, ref_run, f"p{i}")
            rec.update(prompt=i, tokens=toks, seconds=round(sec / len(group), 2), batch=len(group), **mem)
            ctx.store.append(ref_path, rec)
            trajs[f"p{i}"] = toks
    protocol = {"new_tokens": new_tokens, "path": path,
                **({"prefill_chunk": prefill_chunk, **ctx.cache_protocol(force=True)} if path == "cache" else {})}
    head = output_head(ctx.model)
    new = []
    ready = [i for i in range(len(prompts)) if f"p{i}" in trajs]
    for j in range(0, len(ready), batch):
        if deadline is not None and time.monotonic() > deadline:
            break
        group = ready[j: j + batch]
        seqs = [torch.cat([prompts[i], torch.tensor(trajs[f"p{i}"], dtype=torch.long)]) for i in group]
        hidden: dict[str, Tensor] = {}
        info: dict[str, dict] = {}
        runs = {m: ctx.run_id(TASK, m, length, **protocol) for m in methods}
        files = {m: ctx.store.path(ctx.model_name, ctx.text.name, m, TASK, length) for m in methods}
        todo = [m for m in methods if any(f"p{i}" not in ctx.store.done(files[m], runs[m]) for i in group)]
        for m in list(todo):
            if deadline is not None and time.monotonic() > deadline:
                todo = todo[: todo.index(m)]
                break
            t0 = time.perf_counter()
            if path == "cache":
                hs, extra = cache_pass(ctx, m, torch.stack(seqs), prefill_chunk)
            else:
                hs, extra = torch.stack([_simulated(ctx, m, x, length) for x in seqs]), {"path": "simulate"}
            hidden[m] = hs
            info[m] = {"forward_s": round((time.perf_counter() - t0) / len(group), 2), **extra}
        for k, i in enumerate(group):
            ids = seqs[k]
            ref = _simulated(ctx, ctx.reference, ids, length, cache_label=f"{ctx.text.name}_longgen{length}_p{i}")
            lo, hi = length - 1, ids.numel() - 1  # predictions of the generated tokens
            stats = compare_heads(head, ref[lo:hi], {m: hidden[m][k][lo:hi].to(ref.device) for m in todo},
                                  ids[lo + 1:].to(ref.device), chunk=chunk)
            for m, st in stats.items():
                if f"p{i}" in ctx.store.done(files[m], runs[m]):
                    continue
                traj = ids[lo + 1:]
                miss = (st.pred != traj).nonzero()
                bk = st.buckets(torch.arange(st.kl.numel()), bucket, traj)
                rec = ctx.base_record(TASK, m, length, runs[m], f"p{i}")
                rec.update(prompt=i, new_tokens=int(traj.numel()),
                           first_div=int(miss[0]) if miss.numel() else int(traj.numel()),
                           ref_first_div=_first_miss(st.pred_ref, traj), **st.totals().means(), buckets=bk,
                           **info[m])
                ctx.store.append(files[m], rec)
                new.append(rec)
    return new


def _first_miss(pred: Tensor, traj: Tensor) -> int:
    miss = (pred != traj).nonzero()
    return int(miss[0]) if miss.numel() else int(traj.numel())


def _model_cache(ctx: EvalContext):
    """The model's own 16-bit cache (transformers' dynamic cache in the model's dtype)."""
    from transformers import DynamicCache

    return DynamicCache(config=ctx.model.config)


def _simulated(ctx: EvalContext, method: str, ids: Tensor, prompt_len: int, cache_label: str | None = None) -> Tensor:
    """Final hidden states of ``ids`` under ``method``'s simulation: the prompt prefilled in one pass, then token
    by token. The reference's are cached on disk like the LM task's."""
    if cache_label is not None and method == ctx.reference:
        return ctx.reference_hidden(ids, cache_label, prompt_len=prompt_len)
    with ctx.simulate(method, prompt_len=prompt_len):
        return final_hidden(ctx.model, ids)


__all__ = ["run_longgen", "TASK"]
