"""Build a layer's store (policy + pools) from a method :class:`~oscarkv.methods.Recipe`."""

from __future__ import annotations

import torch

from ..kernels.layout import PageFormat
from ..methods import Recipe
from ..quant import resolve_meta_dtype
from .pools import ChannelPool, TokenPool
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
    """An empty :class:`LayerStore` for layer ``layer`` of ``recipe``, in that layer's formats
    (:meth:`~oscarkv.methods.Recipe.layer_format`): token pages for values and, by the key layout, token pages,
    channel pages (``PageFormat(layout="channel")``: one scale/offset per channel per page, oscar-auto) or KIVI's
    per-channel groups of ``recipe.unit`` = 32 tokens (:class:`ChannelPool`)."""
    policy = policy_for(recipe)
    k_pool = v_pool = None
    if recipe.quantized:
        lr = recipe.layers[layer]
        k_bits, v_bits, key_layout = recipe.layer_format(layer)

        def fmt(bits: int, layout: str = "token") -> PageFormat:
            return PageFormat(num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=recipe.page_size, bits=bits,
                              group_size=None if layout == "channel" else recipe.group_size,
                              meta_dtype=recipe.meta_dtype, layout=layout)

        v_pool = TokenPool(fmt(v_bits), lr.v_clip, batch_size, device)
        if key_layout == "channel" and recipe.unit == recipe.page_size:  # channel pages (oscar-auto)
            k_pool = TokenPool(fmt(k_bits, "channel"), 0.0, batch_size, device)
        elif key_layout == "channel":  # KIVI: groups of recipe.unit tokens
            k_pool = ChannelPool(num_kv_heads, head_dim, recipe.unit, k_bits, resolve_meta_dtype(recipe.meta_dtype),
                                 batch_size, device)
        else:
            k_pool = TokenPool(fmt(k_bits), lr.k_clip, batch_size, device)
    return LayerStore(policy, batch_size, num_kv_heads, head_dim, dtype16, device, k_pool, v_pool)


__all__ = ["build_store", "policy_for", "NO_QUANTIZATION"]
