"""Greedy-continuation agreement with the unquantized model (task ``greedy``).

The reference continuation is the unquantized model's greedy decode of ``new_tokens`` tokens after a prompt
(a window of held-out text). Two ways to get a method's agreement:

* ``mode="teacher"`` (default, one forward pass per method): run the method under ``simulate`` over the prompt
  followed by the reference continuation. While the method agrees with the reference its greedy prefix *is*
  the reference prefix, so its next greedy token is the argmax at that position: the first position where the
  argmax differs from the reference token is exactly the first divergence of the method's own greedy decode.
* ``mode="decode"``: prefill the prompt through the method's cache in one pass and decode greedily, token by
  token, then compare (slower; also exercises the real decode path).

In both modes the prompt is prefilled in one pass (``simulate(..., prompt_len=T)`` models exactly that).

Recorded per prompt: ``first_div`` (index of the first differing token, ``new_tokens`` if none), ``exact`` (1 if
all tokens agree) and ``agree`` (= first_div / new_tokens).
"""

from __future__ import annotations

import torch
from tqdm.auto import tqdm

from .backend import final_hidden, greedy_generate, output_head
from .metrics import first_divergence
from .context import EvalContext
from .store import read_jsonl

TASK = "greedy"


def run_greedy(
    s: EvalContext, methods: list[str], length: int, n_prompts: int, *, new_tokens: int = 32, mode: str = "teacher",
) -> list[dict]:
    """Greedy agreement of ``methods`` with the reference on ``n_prompts`` prompts of ``length`` tokens."""
    if mode not in ("teacher", "decode"):
        raise ValueError(f"greedy mode must be 'teacher' or 'decode', got {mode!r}")
    prompts = s.windows(length, n_prompts)
    protocol = {"new_tokens": new_tokens, "mode": mode, **(s.cache_protocol() if mode == "decode" else {})}
    REF = s.reference
    ref_run = s.run_id(TASK + "-ref", REF, length, new_tokens=new_tokens)
    ref_path = s.store.path(s.model_name, s.text.name, REF, TASK + "-ref", length)
    refs = {r["key"]: r["tokens"] for r in _records(s, ref_path, ref_run)}
    new = []
    todo = [i for i in range(len(prompts)) if f"p{i}" not in refs]
    if todo:
        with s.cache(REF) as new_cache:
            for i in tqdm(todo, desc=f"{s.model_name} greedy-ref@{length}", disable=not s.progress):
                toks = greedy_generate(s.model, prompts[i], new_cache(), new_tokens, chunk=length)
                rec = s.base_record(TASK + "-ref", REF, length, ref_run, f"p{i}")
                rec.update(prompt=i, tokens=toks)
                s.store.append(ref_path, rec)
                refs[f"p{i}"] = toks
    head = output_head(s.model)
    for m in methods:
        run = s.run_id(TASK, m, length, **protocol)
        path = s.store.path(s.model_name, s.text.name, m, TASK, length)
        done = s.store.done(path, run)
        todo = [i for i in range(len(prompts)) if f"p{i}" not in done]
        for i in tqdm(todo, desc=f"{s.model_name} greedy@{length} {m}", disable=not s.progress):
            ref = refs[f"p{i}"]
            got = _method_tokens(s, m, prompts[i], ref, head, mode)
            div = first_divergence(ref, got)
            rec = s.base_record(TASK, m, length, run, f"p{i}")
            rec.update(prompt=i, new_tokens=len(ref), first_div=div, exact=int(div == len(ref)),
                       agree=div / max(len(ref), 1), mode=mode)
            s.store.append(path, rec)
            new.append(rec)
    return new


def _method_tokens(s: EvalContext, method: str, prompt, ref: list[int], head, mode: str) -> list[int]:
    T = prompt.numel()
    if mode == "decode":
        with s.cache(method) as new_cache:
            return greedy_generate(s.model, prompt, new_cache(), len(ref), chunk=T)
    ids = torch.cat([prompt, torch.tensor(ref[:-1], dtype=torch.long)])
    with s.simulate(method, prompt_len=T):
        h = final_hidden(s.model, ids)
    return head(h[T - 1 :]).argmax(-1).tolist()


def _records(s: EvalContext, path, run) -> list[dict]:
    return [r for r in read_jsonl(path) if r.get("run") == run]


__all__ = ["run_greedy", "TASK"]
