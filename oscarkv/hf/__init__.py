"""Hugging Face transformers integration: a quantized ``Cache``, an attention function and weight folding.

Quick start::

    handle = oscarkv.hf.apply(model, Calibration.load(calib_dir, model), method="oscar")
    out = model.generate(**inputs, cache=handle.cache(), max_new_tokens=64)
    handle.restore()   # or use `with oscarkv.hf.apply(...) as handle:`

Teacher-forced evaluation (one forward pass, logits as token-by-token decoding through the cache would give)::

    with oscarkv.hf.simulate(model, calib, "oscar"):
        logits = model(ids, use_cache=False).logits

Importing this package needs transformers (``pip install 'oscar-kv[hf]'``); it changes no global state until
:func:`apply` or :func:`simulate` registers the ``"oscar"`` attention function.
"""

from __future__ import annotations

_LAZY = {
    "apply": ("oscarkv.hf.prepare", "apply"),
    "simulate": ("oscarkv.hf.prepare", "simulate"),
    "Applied": ("oscarkv.hf.prepare", "Applied"),
    "OscarCache": ("oscarkv.hf.cache", "OscarCache"),
    "OscarLayer": ("oscarkv.hf.cache", "OscarLayer"),
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'oscarkv.hf' has no attribute {name!r}")


__all__ = list(_LAZY)
