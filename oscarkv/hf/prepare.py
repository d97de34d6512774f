"""``apply(model, calibration, method)``: fold the value rotation into the weights, install the ``"oscar"``
attention function and return a handle that builds caches and undoes everything.

OSCAR covers the model's full-attention layers. Sliding-window layers (Gemma3's local layers, Qwen2 with
``use_sliding_window``) keep transformers' own bounded 16-bit cache and standard attention: they hold at most
``sliding_window`` tokens each, so quantizing them would save little, and their window stays enforced by the mask.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from .. import methods as _methods
from ..artifact import Calibration
from .attention import oscar_attention
from .cache import OscarCache
from .fold import fold_values, unfold
from .plan import ATTN_NAME, HANDLE_ATTR, PLAN_ATTR, LayerPlan, fingerprint, full_attention_layers


def _require_transformers():
    try:
        import transformers  # noqa: F401
    except ImportError as e:  # pragma: no cover
        raise ImportError("oscarkv.hf needs transformers: pip install 'oscar-kv[hf]'") from e


def register() -> None:
    """Register the ``"oscar"`` attention function and its (sdpa-style boolean) mask with transformers.
    Idempotent; called by :func:`apply`."""
    _require_transformers()
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask

    if AttentionInterface._global_mapping.get(ATTN_NAME) is not oscar_attention:
        AttentionInterface.register(ATTN_NAME, oscar_attention)
    if ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.get(ATTN_NAME) is not sdpa_mask:
        AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    body = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", model)
    layers = getattr(body, "layers", None)
    if layers is None:
        raise TypeError(f"{type(model).__name__}: cannot find the decoder layers (expected .get_decoder().layers)")
    return [layer.self_attn for layer in layers]


def _text_config(model: nn.Module):
    cfg = model.config
    return cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg


def default_window_dtype(model: nn.Module) -> torch.dtype:
    """The model's dtype where it is 16-bit, else bfloat16 (what a 16-bit tier means on a float32 CPU model)."""
    dt = next(model.parameters()).dtype
    return dt if dt in (torch.float16, torch.bfloat16) else torch.bfloat16


class Applied:
    """A model with OSCAR applied (returned by :func:`apply` / :func:`simulate`); a context manager.

    ``cache()`` builds a fresh :class:`~oscarkv.hf.cache.OscarCache` for this model and method; ``restore()``
    (or leaving the ``with`` block) puts back the original weights, attention implementation and nothing else.
    """

    def __init__(self, model: nn.Module, calibration: Calibration, method: str, mode: str,
                 window_dtype: torch.dtype | None, prompt_len: int = 0, chunk: int = 1):
        _require_transformers()
        if getattr(model, HANDLE_ATTR, None) is not None:
            prev = getattr(model, HANDLE_ATTR)
            raise RuntimeError(f"OSCAR ({prev.method.name}) is already applied to this model; call .restore() on "
                               "that handle (or leave its `with` block) first")
        if not isinstance(calibration, Calibration):
            raise TypeError(f"calibration must be an oscarkv Calibration, got {type(calibration).__name__}")
        calibration.check_model(model)
        self.model, self.calibration, self.mode = model, calibration, mode
        self.method = _methods.get(method)
        self.recipe = _methods.resolve(self.method, calibration)
        self.fingerprint = fingerprint(calibration, self.method.name)
        self.window_dtype = window_dtype or default_window_dtype(model)
        if not (isinstance(prompt_len, int) and prompt_len >= 0 and isinstance(chunk, int) and chunk >= 1):
            raise ValueError(f"prompt_len must be an int >= 0 and chunk an int >= 1, got {prompt_len!r}, {chunk!r}")
        self.prompt_len, self.chunk = prompt_len, chunk
        self._saved: list = []
        self._prev_attn = model.config._attn_implementation
        self.plans: dict[int, LayerPlan] = {}
        self._install()

    def _install(self) -> None:
        model, ident = self.model, self.calibration.model
        if hasattr(model, "_can_set_attn_implementation") and not model._can_set_attn_implementation():
            raise TypeError(f"{type(model).__name__} does not dispatch attention through transformers' "
                            "AttentionInterface; oscarkv cannot install its attention function")
        attns = _decoder_layers(model)
        full = full_attention_layers(_text_config(model))
        register()
        me = weakref.ref(self)
        try:
            for i, (attn, is_full) in enumerate(zip(attns, full)):
                if not is_full:
                    continue
                lr = self.recipe.layers[i]
                self._saved += fold_values(attn, lr.r_v, lr.mu_v, ident.num_q_heads, ident.num_kv_heads,
                                           ident.head_dim)
                plan = LayerPlan(i, self.recipe, lr, ident.num_q_heads, ident.num_kv_heads, ident.head_dim,
                                 self.mode, self.window_dtype, self.prompt_len, self.chunk, me)
                setattr(attn, PLAN_ATTR, plan)
                self.plans[i] = plan
            model.set_attn_implementation(ATTN_NAME)
        except Exception:
            self._undo()
            raise
        setattr(model, HANDLE_ATTR, self)

    def _undo(self) -> None:
        unfold(self._saved)
        self._saved = []
        for attn in _decoder_layers(self.model):
            if hasattr(attn, PLAN_ATTR):
                delattr(attn, PLAN_ATTR)
        if self.model.config._attn_implementation == ATTN_NAME:
            self.model.set_attn_implementation(self._prev_attn)

    def restore(self) -> None:
        """Undo :func:`apply`: original weights (the same Parameter objects), attention implementation."""
        if getattr(self.model, HANDLE_ATTR, None) is not self:
            return
        self._undo()
        delattr(self.model, HANDLE_ATTR)
        self.plans = {}

    remove = restore

    @property
    def active(self) -> bool:
        return getattr(self.model, HANDLE_ATTR, None) is self

    def cache(self, window_dtype: torch.dtype | None = None, kernel_backend: str | None = None):
        """A fresh, empty :class:`~oscarkv.hf.cache.OscarCache` for this model and method."""
        if self.mode != "cache":
            raise RuntimeError("this handle comes from oscarkv.hf.simulate (one full forward pass, no cache); "
                               "use oscarkv.hf.apply for generation with a cache")
        if not self.active:
            raise RuntimeError("this handle was restored; apply OSCAR again to build a cache")
        return OscarCache(self, window_dtype=window_dtype, kernel_backend=kernel_backend)

    new_cache = cache

    def __enter__(self) -> Applied:
        return self

    def __exit__(self, *exc) -> None:
        self.restore()

    def __repr__(self) -> str:
        state = "active" if self.active else "restored"
        return f"Applied(method={self.method.name!r}, mode={self.mode!r}, layers={len(self.plans)}, {state})"


def apply(model: nn.Module, calibration: Calibration, method: str = "oscar", *,
          window_dtype: torch.dtype | None = None) -> Applied:
    """Prepare ``model`` for generation with a quantized cache under ``method`` (see :mod:`oscarkv.methods`).

    Folds ``R_V`` and the value mean into ``v_proj``/``o_proj`` of every full-attention layer, installs the
    ``"oscar"`` attention function, and returns an :class:`Applied` handle (a context manager that restores the
    model exactly). Raises ``ArtifactError`` if the calibration belongs to another model.
    """
    return Applied(model, calibration, method, "cache", window_dtype)


def simulate(model: nn.Module, calibration: Calibration, method: str = "oscar", *,
             window_dtype: torch.dtype | None = None, prompt_len: int = 0, chunk: int = 1) -> Applied:
    """Teacher-forced simulation: inside ``with simulate(model, calib, method):`` ONE forward pass over ``ids``
    ``[B, N]`` (no padding, no past) gives at every position ``i`` the logits that decoding the text token by
    token through an :class:`~oscarkv.hf.cache.OscarCache` would give (equal to float tolerance).

    Query ``i`` attends to its own key and value in full precision and to each earlier token ``j`` as the cache
    held it when ``i`` was decoded: quantized if ``S <= j < S + q(i)`` (the demotion rule of
    :class:`oscarkv.cache.TierPolicy`, pages included), else 16-bit. With ``prompt_len = P`` the first ``P``
    tokens are a prompt prefilled in one pass (they attend to each other in full precision), as in generation;
    with ``chunk = C`` the rest arrive ``C`` tokens at a time (chunked prefill: a chunk attends to earlier
    chunks as stored and to itself in full precision). ``window_dtype``: dtype of the 16-bit tiers (default: the
    model's if 16-bit, else bfloat16), as for :func:`apply`.
    """
    return Applied(model, calibration, method, "simulate", window_dtype, prompt_len, chunk)


__all__ = ["ATTN_NAME", "Applied", "LayerPlan", "apply", "full_attention_layers", "register", "simulate"]
