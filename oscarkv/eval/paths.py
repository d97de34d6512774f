"""Which code path computed a number, and how many bits the method stored for it.

* :func:`record_kernel_paths` counts, during a block, how :mod:`oscarkv.kernels.dispatch` resolved every op it
  was asked to run ("triton", "cuda" or "reference"); :func:`path_summary` turns the counts of a cache pass into
  the ``path`` recorded with its results: ``kernels`` when every attention call of every quantized layer went
  to a kernel, ``reference`` when all went to the dispatcher's PyTorch reference, ``torch`` when none reached
  the dispatcher (the cache's own PyTorch attention), ``mixed`` otherwise, ``model`` for a cache with no
  quantized layer (the model's own attention). Teacher-forced simulation passes record ``simulate`` (plain
  PyTorch, no cache).
* :func:`physical_bits` gives the bits per stored K/V element of a method's cache after ``T`` tokens, counting
  the 16-bit tiers, from the method's recipe and the tier rule; the tests check it against the bytes of real
  caches (:meth:`oscarkv.hf.OscarCache.nbytes`).
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections import Counter, defaultdict
from typing import Any, Iterator

KERNEL_BACKENDS = ("triton", "cuda")


@contextlib.contextmanager
def record_kernel_paths() -> Iterator[dict[str, Counter]]:
    """Yields ``{op: Counter(backend -> calls)}`` filled while the block runs (op = the dispatch function's name,
    e.g. ``extend_attention``, ``quantize_write``). Wraps the dispatcher's backend resolution for the duration of
    the block; not thread-safe (one evaluation per process)."""
    from ..kernels import dispatch

    counts: dict[str, Counter] = defaultdict(Counter)
    pick = getattr(dispatch, "_pick", None)
    if pick is None:  # the dispatcher changed shape: say so in every record instead of guessing
        warnings.warn("oscarkv.kernels.dispatch has no _pick: kernel paths are not recorded", stacklevel=2)
        counts["unrecorded"]["unrecorded"] += 1
        yield counts
        return

    def counting(*args: Any, **kwargs: Any) -> str:
        backend = pick(*args, **kwargs)
        counts[sys._getframe(1).f_code.co_name][backend] += 1
        return backend

    dispatch._pick = counting
    try:
        yield counts
    finally:
        dispatch._pick = pick


def path_summary(counts: dict[str, Counter], attention_calls: int) -> dict:
    """``{"path": kernels|reference|torch|mixed|model|unrecorded, "attention": {...}, "ops": {...}}`` for a cache
    pass that made ``attention_calls`` attention calls in quantized layers."""
    ops = {op: dict(c) for op, c in counts.items()}
    if "unrecorded" in counts:
        return {"path": "unrecorded", "ops": ops}
    att = Counter()
    for op in ("extend_attention", "decode_attention"):
        att.update(counts.get(op, Counter()))
    att["torch"] = max(0, attention_calls - sum(att.values()))
    att = {k: v for k, v in att.items() if v}
    kern = sum(v for k, v in att.items() if k in KERNEL_BACKENDS)
    if not att:  # no quantized layer: the model's own attention (the native pseudo-method, transformers' caches)
        path = "model"
    elif kern == sum(att.values()):
        path = "kernels"
    elif set(att) == {"reference"}:
        path = "reference"
    elif set(att) == {"torch"}:
        path = "torch"
    else:
        path = "mixed"
    return {"path": path, "attention": att, "ops": ops}


def quantized_layer_count(cache: Any) -> int:
    """Layers of a cache that store through oscarkv (:class:`oscarkv.hf.OscarLayer`), 0 for other caches."""
    return sum(type(layer).__name__ == "OscarLayer" for layer in getattr(cache, "layers", ()))


def layer_bits(recipe: Any, head_dim: int) -> list[tuple[float, float] | None]:
    """Per layer of ``recipe``: nominal bits per element of its quantized tier for K and for V (codes plus scale
    and offset), or ``None`` for a layer the recipe keeps in 16-bit."""
    meta = 32 if recipe.meta_dtype == "float32" else 16
    return [None if f is None else tuple(t.bits_per_element(head_dim, recipe.page_size, recipe.group_size, meta)
                                         for t in f) for f in recipe.formats]


def physical_bits(recipe: Any, head_dim: int, tokens: int, quantized_layers: list[bool] | None = None) -> float:
    """Bits per stored K/V element of one sequence of ``tokens`` tokens under ``recipe`` (a
    :class:`oscarkv.methods.Recipe`): the 16-bit sink and recent window at 16 bits, the quantized tier at each
    layer's nominal bits (codes + scale/offset), averaged over K and V and over layers.
    ``quantized_layers[i]`` False marks a layer the cache keeps in 16-bit (e.g. sliding-window layers)."""
    from ..cache.build import policy_for

    if tokens <= 0:
        raise ValueError(f"tokens must be > 0, got {tokens}")
    if not recipe.quantized:
        return 16.0
    bits = layer_bits(recipe, head_dim)
    mask = quantized_layers if quantized_layers is not None else [True] * len(bits)
    q = policy_for(recipe).quantized(tokens)
    total = 0.0
    for kv, keep in zip(bits, mask):
        if kv is None or not keep:
            total += 2 * 16.0 * tokens
        else:
            total += 2 * 16.0 * (tokens - q) + (kv[0] + kv[1]) * q
    return total / (2 * len(bits) * tokens)


def nominal_bits(recipe: Any, head_dim: int, quantized_layers: list[bool] | None = None) -> float:
    """Nominal bits per element of the quantized tier, averaged over K and V of the quantized layers (16.0 for
    a recipe that quantizes nothing)."""
    bits = layer_bits(recipe, head_dim) if recipe.quantized else []
    mask = quantized_layers if quantized_layers is not None else [True] * len(bits)
    kept = [kv for kv, keep in zip(bits, mask) if kv is not None and keep]
    return sum(k + v for k, v in kept) / (2 * len(kept)) if kept else 16.0


__all__ = ["record_kernel_paths", "path_summary", "layer_bits", "physical_bits", "nominal_bits",
           "quantized_layer_count"]
