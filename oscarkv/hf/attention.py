"""The ``"oscar"`` attention function registered with transformers' ``AttentionInterface``.

Three cases, decided per call:

* the layer's cache is an :class:`~oscarkv.hf.cache.OscarLayer` (it put itself in the keyword arguments):
  attention over the stored tiers and the new chunk, then commit (:meth:`OscarLayer.attend`);
* the model runs under :func:`oscarkv.hf.simulate`: the teacher-forced simulation (:mod:`.simulation`);
* anything else (no cache, a plain DynamicCache, a sliding-window layer): exact full-precision attention
  (transformers' sdpa). The folded weights keep the model's outputs unchanged there.
"""

from __future__ import annotations

import logging

from torch import Tensor

from .plan import PLAN_ATTR
from .simulation import simulate_attention

log = logging.getLogger(__name__)
_warned = set()


def oscar_attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                    scaling: float | None = None, dropout: float = 0.0, **kwargs) -> tuple[Tensor, None]:
    """transformers attention interface: ``query`` ``[B, Hq, T, d]``, ``key``/``value`` ``[B, Hkv, N, d]``;
    returns ``([B, T, Hq, d], None)``."""
    layer = kwargs.pop("oscar_layer", None)
    plan = getattr(module, PLAN_ATTR, None)
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    softcap = kwargs.get("softcap")
    if (layer is not None or plan is not None) and module.training and dropout:
        raise RuntimeError("oscarkv attention is inference-only: call model.eval()")
    if layer is not None:
        return layer.attend(module, query, key, value, attention_mask, scaling, softcap), None
    if plan is not None and plan.mode == "simulate":
        return simulate_attention(plan, query, key, value, attention_mask, scaling, softcap), None
    if plan is not None and plan.layer not in _warned:
        _warned.add(plan.layer)
        log.warning("oscarkv: layer %d runs without an OscarCache, in full precision (pass cache=handle.cache() "
                    "to generate/forward to use the quantized cache)", plan.layer)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


__all__ = ["oscar_attention"]
