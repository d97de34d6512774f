"""Per-layer fidelity (task ``fidelity``): relative error of each layer's attention output and of the logits.

Forward hooks on every layer's attention module capture its output (``[1, T, hidden]``, after ``o_proj``) at
up to ``max_positions`` evenly spaced scored positions, once for the unquantized model and once under each
method's ``simulate``. Errors are *propagated*: a layer sees the hidden states the method's earlier layers
produced, as it would in deployment. Recorded per window: ``attn_rel_err`` (list over layers,
``||o_m - o_ref|| / ||o_ref||``) and ``logit_rel_err`` at the same positions.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import Tensor

from .backend import decoder, final_hidden, output_head
from .metrics import relative_error
from .context import EvalContext

TASK = "fidelity"


def attention_modules(model: Any) -> list[Any]:
    """The attention module of each decoder layer (``layers[i].self_attn``)."""
    layers = getattr(decoder(model), "layers", None)
    if layers is None or not all(hasattr(layer, "self_attn") for layer in layers):
        raise ValueError(f"{type(model).__name__}: expected decoder layers with a .self_attn module")
    return [layer.self_attn for layer in layers]


@contextlib.contextmanager
def capture_attention(model: Any, positions: Tensor) -> Iterator[list[Tensor | None]]:
    """Record each layer's attention output at ``positions`` (``[P]`` int64) into the yielded list."""
    mods = attention_modules(model)
    out: list[Tensor | None] = [None] * len(mods)

    def make(i: int):
        def hook(_mod, _args, output):
            o = output[0] if isinstance(output, tuple) else output
            out[i] = o[0, positions.to(o.device)].detach().float().cpu()

        return hook

    handles = [m.register_forward_hook(make(i)) for i, m in enumerate(mods)]
    try:
        yield out
    finally:
        for h in handles:
            h.remove()


def scored_positions(length: int, score_from: int, max_positions: int) -> Tensor:
    """Up to ``max_positions`` evenly spaced positions in ``[score_from, length - 1)``."""
    n = length - 1 - score_from
    if n <= 0:
        raise ValueError(f"no scored positions: length {length}, score_from {score_from}")
    idx = torch.linspace(score_from, length - 2, steps=min(max_positions, n)).round().long()
    return torch.unique(idx)


def run_fidelity(s: EvalContext, methods: list[str], length: int, n_windows: int, *,
                 max_positions: int = 256) -> list[dict]:
    """Per-layer attention-output and logit relative errors of each method on up to ``n_windows`` windows."""
    wins = s.windows(length, n_windows)
    pos = scored_positions(length, s.score_from, max_positions)
    head = output_head(s.model)
    new = []
    for i, ids in enumerate(wins):
        ref_attn = None
        for m in methods:
            run = s.run_id(TASK, m, length, score_from=s.score_from, max_positions=max_positions)
            path = s.store.path(s.model_name, s.text.name, m, TASK, length)
            if f"w{i}" in s.store.done(path, run):
                continue
            if ref_attn is None:
                ref_attn, ref_h = _pass(s, ids, pos, s.reference)
            attn, h = _pass(s, ids, pos, m)
            with torch.inference_mode():
                logit_err = relative_error(head(h), head(ref_h))
            rec = s.base_record(TASK, m, length, run, f"w{i}")
            rec.update(window=i, positions=int(pos.numel()), score_from=s.score_from, logit_rel_err=logit_err,
                       attn_rel_err=[relative_error(a, r) for a, r in zip(attn, ref_attn)])
            s.store.append(path, rec)
            new.append(rec)
    return new


def _pass(s: EvalContext, ids: Tensor, pos: Tensor, method: str) -> tuple[list[Tensor], Tensor]:
    with s.simulate(method), capture_attention(s.model, pos) as attn:
        h = final_hidden(s.model, ids)
    if any(a is None for a in attn):
        raise RuntimeError("an attention module did not run its forward hooks; fidelity cannot be measured here")
    return list(attn), h[pos.to(h.device)]


__all__ = ["run_fidelity", "capture_attention", "attention_modules", "scored_positions", "TASK"]
