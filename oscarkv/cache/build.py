"""Build a layer's store (policy + pools) from a method :class:`~oscarkv.methods.Recipe`."""

from __future__ import annotations

import torch

from ..formats import LayerFormat
from ..kernels.layout import PageFormat
from ..methods import Recipe
from .pools import TokenPool
from .store import LayerStore
from .tiers import TierPolicy

NO_QUANTIZATION = TierPolicy(sink=0, window=2**62, unit=1)


def policy_for(recipe: Recipe) -> TierPolicy:
    """The tier policy of a recipe (a never-demoting one for the 16-bit reference)."""
    if not recipe.quantized:
        return NO_QUANTIZATION
    return TierPolicy(sink=recipe.sink, window=recipe.window, unit=recipe.unit)


def build_store(recipe: Recipe, layer: int, batch_size: int, num_kv_heads: int, head_dim: int,
                dtype16: torch.dtype, device: torch.device | str) -> LayerStore:
    """An empty :class:`LayerStore` for layer ``layer`` of ``recipe``, in that layer's
    :class:`~oscarkv.formats.LayerFormat`: token pages for values and token or channel pages for keys."""
    policy = policy_for(recipe)
    k_pool = v_pool = None
    fmt = recipe.layers[layer].format
    if recipe.quantized and fmt is not None:
        kf, vf = page_formats(fmt, num_kv_heads, head_dim, recipe.page_size, recipe.group_size, recipe.meta_dtype)
        k_pool = TokenPool(kf, fmt.k.clip, batch_size, device)
        v_pool = TokenPool(vf, fmt.v.clip, batch_size, device)
    return LayerStore(policy, batch_size, num_kv_heads, head_dim, dtype16, device, k_pool, v_pool)


def page_formats(fmt: LayerFormat, num_kv_heads: int, head_dim: int, page_size: int, group_size: int | None,
                 meta_dtype: str | torch.dtype) -> tuple[PageFormat, PageFormat]:
    """The kernels' page geometry of a layer's K and V pools: ``fmt`` plus the store's geometry (channel pages
    have one scale/offset per channel per page, so no row groups)."""
    return tuple(PageFormat(num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size, bits=f.bits,
                            group_size=None if f.channel else group_size, meta_dtype=meta_dtype, layout=f.layout)
                 for f in fmt)


__all__ = ["NO_QUANTIZATION", "build_store", "page_formats", "policy_for"]
