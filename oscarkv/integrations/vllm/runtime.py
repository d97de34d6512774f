"""What every process derives from vLLM's config: options, the checked calibration, the tier rule
(:class:`~oscarkv.cache.TierPolicy`, the one every front-end uses), per-layer page formats, window slots.

Resolved once per process and configuration (``runtime(vllm_config)``), so the metadata builder and every layer's
attention implementation agree on the tiers and the 16-bit pool geometry.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

import torch

from ...cache import TierPolicy, geometry_for
from .options import (OscarOptions, OscarVllmError, ServedModel, load_calibration, resolve_recipe, serving_policy,
                      windows_of)

logger = logging.getLogger("vllm.oscarkv")  # under vLLM's logger, so its handler prints it
_RUNTIMES: dict[str, Runtime] = {}


@dataclass
class Runtime:
    opts: OscarOptions
    calib: Any  # oscarkv.artifact.Calibration
    recipe: Any  # oscarkv.methods.Recipe
    model: ServedModel
    policy: TierPolicy
    num_slots: int
    window_dtype: torch.dtype  # the 16-bit tiers: the model's dtype if 16-bit, else bfloat16 (as oscarkv.hf)
    graph_inputs: Any = None  # graphs.SharedInputs of this process's layers (created on the first decode graph)

    @property
    def quantized(self) -> bool:
        return self.recipe.quantized

    @property
    def windows(self) -> bool:
        return self.recipe.quantized and self.policy.windows

    @property
    def ring(self) -> int:
        return windows_of(self.policy)[0] if self.quantized else 0

    @property
    def rows16(self) -> int:
        """16-bit rows per sequence slot (sink + ring), 0 without windows."""
        return windows_of(self.policy)[1] if self.quantized else 0

    @property
    def channel_layers(self) -> bool:
        """Some layer stores keys in channel pages (written when a page is complete, from the 16-bit rows)."""
        return any(f is not None and f.k.channel for f in self.recipe.formats)

    def page_formats(self, layer: int, num_kv_heads: int, block_size: int):
        """``(K, V)`` :class:`~oscarkv.kernels.layout.PageFormat` of ``layer`` for this rank's KV heads: the
        layer's :class:`~oscarkv.formats.LayerFormat` in pages of one vLLM block."""
        from dataclasses import replace

        geo = replace(geometry_for(self.recipe, num_kv_heads, self.model.head_dim), page_size=block_size)
        return geo.page_formats(self.recipe.formats[layer])


def served_model(vllm_config: Any) -> ServedModel:
    mc = vllm_config.model_config
    cfg = mc.hf_text_config
    return ServedModel(
        architecture=getattr(cfg, "model_type", "?"),
        num_layers=cfg.num_hidden_layers,
        num_q_heads=cfg.num_attention_heads,
        num_kv_heads=mc.get_total_num_kv_heads(),
        head_dim=mc.get_head_size(),
        hidden_size=cfg.hidden_size,
        dtype=str(mc.dtype).replace("torch.", ""),
        sliding_window=mc.get_sliding_window(),
    )


def runtime(vllm_config: Any, *, require: bool) -> Runtime:
    """The runtime for ``vllm_config``. Without an ``"oscar"`` section: an error when ``require`` (the user
    selected the backend explicitly), else the 16-bit pass-through (vLLM CPU, where the plugin owns the slot)."""
    additional = vllm_config.additional_config or {}
    opts = OscarOptions.from_additional_config(additional)
    if opts is None:
        if require:
            raise OscarVllmError(
                "the OSCAR attention backend is selected but --additional-config has no \"oscar\" section; pass "
                '--additional-config \'{"oscar": {"calibration": "DIR"}}\''
            )
        opts = OscarOptions(method="bf16")
    key = json.dumps([additional.get("oscar"), vllm_config.model_config.model, str(vllm_config.model_config.dtype)],
                     sort_keys=True, default=str)
    if key not in _RUNTIMES:
        _RUNTIMES[key] = _resolve(vllm_config, opts)
    return _RUNTIMES[key]


def _resolve(vllm_config: Any, opts: OscarOptions) -> Runtime:
    model = served_model(vllm_config)
    calib = load_calibration(opts, model)
    recipe = resolve_recipe(opts, calib)
    policy = serving_policy(recipe)
    if recipe.quantized and policy.windows:
        if vllm_config.cache_config.enable_prefix_caching:
            raise OscarVllmError(
                "the 16-bit windows are per sequence and need prefix caching off: start vLLM with "
                "enable_prefix_caching=False (--no-enable-prefix-caching), or use oscar.method 'oscar-nowindow'"
            )
        if vllm_config.speculative_config is not None:
            raise OscarVllmError("speculative decoding is not supported with the OSCAR windows")
    if recipe.quantized and getattr(vllm_config, "use_v2_model_runner", False):
        # vLLM 0.26 picks V2 by default for dense models; the backend has run on no GPU engine under it yet
        raise OscarVllmError("the OSCAR backend is validated with vLLM's V1 model runner only (V2 is vLLM's default "
                             "for dense models): start vLLM with VLLM_USE_V2_MODEL_RUNNER=0")
    num_slots = opts.max_seqs or vllm_config.scheduler_config.max_num_seqs
    dt = vllm_config.model_config.dtype
    window_dtype = dt if dt in (torch.float16, torch.bfloat16) else torch.bfloat16
    from ...formats import describe_layers

    fmts = sorted({f.label for f in recipe.formats if f is not None})
    logger.info("OSCAR KV cache: method %s, %s%s, calibration %s", opts.method,
                f"quantized layers {describe_layers(recipe.quantized_layers, model.num_layers)} in "
                f"{', '.join(fmts)}" if recipe.quantized else "16-bit",
                f", 16-bit sink {policy.sink} + window {policy.window} (pages of {policy.unit}) for {num_slots} "
                "sequences" if recipe.quantized and policy.windows else "", opts.calibration)
    return Runtime(opts=opts, calib=calib, recipe=recipe, model=model, policy=policy, num_slots=num_slots,
                   window_dtype=window_dtype)


def local_kv_heads(total: int, tp_size: int, tp_rank: int) -> list[int]:
    """KV heads held by one tensor-parallel rank (vLLM shards them, or replicates when ``tp_size > total``)."""
    if tp_size <= total:
        if total % tp_size:
            raise OscarVllmError(f"{total} KV heads cannot be split over tensor_parallel_size={tp_size}")
        h = total // tp_size
        return list(range(tp_rank * h, (tp_rank + 1) * h))
    return [tp_rank // (tp_size // total)]


def layer_params(rt: Runtime, layer: int, heads: list[int], sm_scale: float, device: torch.device):
    """:class:`~.core.LayerParams` of ``layer`` restricted to ``heads``, on ``device`` (identity rotation and
    zero means where the method has none)."""
    from .core import LayerParams

    lr = rt.recipe.layers[layer]
    d = rt.model.head_dim
    idx = torch.tensor(heads)

    def pick(x, default):
        x = default if x is None else x
        return x[idx].to(device=device, dtype=torch.float32).contiguous()

    H = rt.model.num_kv_heads
    eye, zeros = torch.eye(d).expand(H, d, d), torch.zeros(H, d)
    return LayerParams(r_k=pick(lr.r_k, eye), r_v=pick(lr.r_v, eye), mu_k=pick(lr.mu_k, zeros),
                       mu_v=pick(lr.mu_v, zeros), k_clip=lr.k_clip, v_clip=lr.v_clip, sm_scale=sm_scale,
                       dtype16=rt.window_dtype, channel=lr.format is not None and lr.format.k.channel)


__all__ = ["Runtime", "layer_params", "local_kv_heads", "runtime", "served_model"]
