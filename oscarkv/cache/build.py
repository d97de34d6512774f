"""A store for a method :class:`~oscarkv.methods.Recipe`: its tier policy, its page geometry, its per-layer
formats."""

from __future__ import annotations

import torch

from ..methods import Recipe
from .formats import PageGeometry
from .paged import PagedStore
from .tiers import TierPolicy

NO_QUANTIZATION = TierPolicy(sink=0, window=2**62, unit=1)


def policy_for(recipe: Recipe) -> TierPolicy:
    """The tier policy of a recipe (a never-demoting one for the 16-bit reference)."""
    if not recipe.quantized:
        return NO_QUANTIZATION
    return TierPolicy(sink=recipe.sink, window=recipe.window, unit=recipe.unit)


def geometry_for(recipe: Recipe, num_kv_heads: int, head_dim: int) -> PageGeometry:
    return PageGeometry(num_kv_heads, head_dim, recipe.page_size, recipe.group_size, recipe.meta_dtype)


def growable_store(recipe: Recipe, layers: list[int], num_slots: int, num_kv_heads: int, head_dim: int,
                   dtype16: torch.dtype, device: torch.device | str) -> PagedStore:
    """An empty, growable :class:`PagedStore` for ``layers`` of ``recipe`` (the transformers cache, tests)."""
    formats = [recipe.layers[i].format if recipe.quantized else None for i in layers]
    return PagedStore(formats, policy_for(recipe), geometry_for(recipe, num_kv_heads, head_dim),
                      num_slots=num_slots, num_pages=1, max_pages=1, dtype16=dtype16, device=device, growable=True)


__all__ = ["NO_QUANTIZATION", "geometry_for", "growable_store", "policy_for"]
