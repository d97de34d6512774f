"""What every process derives from vLLM's config: options, the checked calibration, tiers, window slots.

Resolved once per process and configuration (``runtime(vllm_config)``), so the metadata builder and every layer's
attention implementation agree on the tiers and the 16-bit pool geometry.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

import torch

from .options import OscarOptions, OscarVllmError, ServedModel, Tiering, load_calibration

logger = logging.getLogger("vllm.oscarkv")  # under vLLM's logger, so its handler prints it
_RUNTIMES: dict[str, "Runtime"] = {}


@dataclass
class Runtime:
    opts: OscarOptions
    calib: Any  # oscarkv.artifact.Calibration
    model: ServedModel
    tiers: Tiering
    num_slots: int

    @property
    def windows(self) -> bool:
        return self.opts.quantize and self.tiers.enabled

    def page_format(self, num_kv_heads: int, block_size: int):
        from ...kernels.layout import PageFormat

        s = self.calib.spec
        return PageFormat(num_kv_heads=num_kv_heads, head_dim=self.model.head_dim, page_size=block_size,
                          bits=s.bits, group_size=s.group_size, meta_dtype=s.meta_dtype)


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
        opts = OscarOptions(quantize=False)
    key = json.dumps([additional.get("oscar"), vllm_config.model_config.model, str(vllm_config.model_config.dtype)],
                     sort_keys=True, default=str)
    if key not in _RUNTIMES:
        _RUNTIMES[key] = _resolve(vllm_config, opts)
    return _RUNTIMES[key]


def _resolve(vllm_config: Any, opts: OscarOptions) -> Runtime:
    model = served_model(vllm_config)
    calib = load_calibration(opts, model)
    spec = calib.spec
    sink = spec.sink if opts.sink is None else opts.sink
    window = spec.window if opts.window is None else opts.window
    tiers = Tiering(sink=sink, window=window, page=spec.page_size, enabled=opts.windows and opts.quantize)
    if tiers.enabled:
        if vllm_config.cache_config.enable_prefix_caching:
            raise OscarVllmError(
                "the OSCAR 16-bit windows are per sequence and need prefix caching off: start vLLM with "
                "enable_prefix_caching=False (--no-enable-prefix-caching), or set oscar.windows=false"
            )
        if vllm_config.speculative_config is not None:
            raise OscarVllmError("speculative decoding is not supported with the OSCAR windows")
    num_slots = opts.max_seqs or vllm_config.scheduler_config.max_num_seqs
    logger.info("OSCAR KV cache: %s, %d-bit%s, calibration %s", model.architecture, spec.bits,
                f", 16-bit sink {sink} + window {window} for {num_slots} sequences" if tiers.enabled else
                ("" if opts.quantize else " off (16-bit)"), opts.calibration)
    return Runtime(opts=opts, calib=calib, model=model, tiers=tiers, num_slots=num_slots)


def local_kv_heads(total: int, tp_size: int, tp_rank: int) -> list[int]:
    """KV heads held by one tensor-parallel rank (vLLM shards them, or replicates when ``tp_size > total``)."""
    if tp_size <= total:
        if total % tp_size:
            raise OscarVllmError(f"{total} KV heads cannot be split over tensor_parallel_size={tp_size}")
        h = total // tp_size
        return list(range(tp_rank * h, (tp_rank + 1) * h))
    return [tp_rank // (tp_size // total)]


def layer_params(rt: Runtime, layer: int, heads: list[int], sm_scale: float, device: torch.device):
    """:class:`~.core.LayerParams` of ``layer`` restricted to ``heads``, on ``device``."""
    from .core import LayerParams

    t = rt.calib.layer(layer)
    idx = torch.tensor(heads)

    def pick(x):
        return x[idx].to(device=device, dtype=torch.float32).contiguous()

    mu_k, mu_v = pick(t["mu_k"]), pick(t["mu_v"])
    if not rt.calib.spec.centering:
        mu_k, mu_v = torch.zeros_like(mu_k), torch.zeros_like(mu_v)
    return LayerParams(r_k=pick(t["r_k"]), r_v=pick(t["r_v"]), mu_k=mu_k, mu_v=mu_v,
                       k_clip=t["k_clip"], v_clip=t["v_clip"], sm_scale=sm_scale)


__all__ = ["Runtime", "runtime", "served_model", "local_kv_heads", "layer_params"]
