"""Teacher-forced language-model metrics (tasks ``kld`` and ``ppl``), one forward pass per window and method.

For each window of held-out text the reference (unquantized) final hidden states are computed once; each
method's pass runs under ``backend.simulate`` so every position sees the context as the method's cache would
hold it during a token-by-token decode. Scored positions are ``score_from .. T-2`` (``score_from`` defaults to
``sink + window``: the positions whose context has left the 16-bit windows), predicting tokens
``score_from+1 .. T-1``. Per window we record mean KL(ref || method) in nats, top-1 agreement, the method's and
the reference's NLL (-> perplexity) and the relative L2 error of the logits.
"""

from __future__ import annotations

import time

from tqdm.auto import tqdm

from .backend import final_hidden, output_head
from .metrics import peak_memory, token_stats
from .context import EvalContext

TASK = "lm"


def run_lm(s: EvalContext, methods: list[str], length: int, n_windows: int, *, chunk: int = 256) -> list[dict]:
    """Evaluate ``methods`` on up to ``n_windows`` windows of ``length`` tokens; returns the new records
    (finished units found in the store are skipped)."""
    wins = s.windows(length, n_windows)
    if s.score_from >= length - 1:
        raise ValueError(f"score_from={s.score_from} leaves no scored position in a {length}-token window; "
                         "use a longer --context or a smaller --score-from")
    protocol = {"score_from": s.score_from, "windows": "consecutive"}
    runs = {m: s.run_id(TASK, m, length, **protocol) for m in methods}
    paths = {m: s.store.path(s.model_name, s.text.name, m, TASK, length) for m in methods}
    done = {m: s.store.done(paths[m], runs[m]) for m in methods}
    todo = [(i, m) for i in range(len(wins)) for m in methods if f"w{i}" not in done[m]]
    head = output_head(s.model)
    new = []
    bar = tqdm(todo, desc=f"{s.model_name} lm@{length}", disable=not s.progress, unit="pass")
    for i, m in bar:
        bar.set_postfix_str(f"w{i} {m}")
        ids = wins[i]
        ref = s.reference_hidden(ids, f"{s.text.name}_{length}_w{i}")
        t0 = time.perf_counter()
        mem: dict = {}
        if m == s.reference:  # the reference's own pass: KLD 0 by definition, no second forward
            h = ref
        else:
            with peak_memory(s.model) as mem, s.simulate(m):
                h = final_hidden(s.model, ids)
        sec = time.perf_counter() - t0
        lo, hi = s.score_from, ids.numel() - 1
        st = token_stats(head, ref[lo:hi], h[lo:hi], ids[lo + 1 :].to(ref.device), chunk=chunk)
        rec = s.base_record(TASK, m, length, runs[m], f"w{i}")
        rec.update(window=i, tokens=int(ids.numel()), score_from=lo, forward_s=round(sec, 2), **mem, **st.means())
        s.store.append(paths[m], rec)
        new.append(rec)
    return new


__all__ = ["run_lm", "TASK"]
