"""The OSCAR attention backend for vLLM 0.26.0: backend class, KV cache spec, metadata builder, implementation.

Imported only inside vLLM processes (it imports vLLM). Registered by :func:`oscarkv.integrations.vllm.register`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import numpy as np
import torch

from vllm.config import VllmConfig, get_current_vllm_config
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec

from ...kernels.plan import DecodePlan
from .core import StepMeta, build_step, carve, decode_plan, dense_step, page_bytes, prebuild_decode_kernels, quant_step
from .graphs import LayerGraphs, SharedInputs, StaticDecode
from .monitor import PluginMonitor, monitor
from .options import OscarOptions, OscarVllmError, check_served
from .runtime import layer_params, local_kv_heads, runtime
from .windows import WindowSlots

logger = logging.getLogger("vllm.oscarkv")  # under vLLM's logger, so its handler prints it


@dataclass(frozen=True, kw_only=True)
class OscarAttentionSpec(FullAttentionSpec):
    """A full-attention spec whose page holds OSCAR's packed K/V (codes + fp16 scale/offset) in uint8."""

    oscar_page_bytes: int = 0

    @property
    def real_page_size_bytes(self) -> int:
        return self.oscar_page_bytes

    @classmethod
    def merge(cls, specs):
        # layers in different formats have different page bytes: vLLM's convention for "not one spec" is an
        # AssertionError, after which it keeps every layer's own page size in one KV-cache group (one block table;
        # UniformTypeKVCacheSpecs), so each layer's tensor holds exactly its own format (docs/vllm.md)
        assert all(s.oscar_page_bytes == specs[0].oscar_page_bytes for s in specs), "OSCAR layers differ in format"
        merged = super().merge(specs)
        return replace(merged, oscar_page_bytes=specs[0].oscar_page_bytes)


def _is_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


class OscarAttentionBackend(AttentionBackend):
    accept_output_buffer: bool = True
    forward_includes_kv_cache_update: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto"]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type["OscarAttentionImpl"]:
        return OscarAttentionImpl

    @staticmethod
    def get_builder_cls() -> type["OscarMetadataBuilder"]:
        return OscarMetadataBuilder

    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str="auto"):
        # Block-major; the page's byte layout is the backend's own (core.carve), sized by OscarAttentionSpec.
        return (num_blocks, -1)

    @staticmethod
    def get_supported_kernel_block_sizes() -> list[int | MultipleOf]:
        return [MultipleOf(16)]

    @classmethod
    def get_preferred_block_size(cls, default_block_size: int) -> int:
        cfg = get_current_vllm_config()
        if OscarOptions.from_additional_config(cfg.additional_config) is None:
            return default_block_size
        rt = runtime(cfg, require=False)
        return rt.policy.unit if rt.windows else default_block_size

    @staticmethod
    def use_cascade_attention(*args, **kwargs) -> bool:
        return False


@dataclass
class OscarMetadata(AttentionMetadata):
    step: StepMeta
    block_size: int


class OscarMetadataBuilder(AttentionMetadataBuilder[OscarMetadata]):
    """Per step: the tiers of every token (:func:`.core.build_step`). Decode-only steps on CUDA go into persistent
    buffers (:class:`.graphs.StaticDecode`), so vLLM's full CUDA graphs of decode batches capture the attention
    of every layer with the rest of the model, and a replay needs only this host-side build; steps with prefill
    chunks run in vLLM's piecewise graphs with attention eager."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    @classmethod
    def get_cudagraph_support(cls, vllm_config: VllmConfig, kv_cache_spec) -> AttentionCGSupport:
        """Full graphs of single-token decode batches where decode steps use the persistent buffers: CUDA, a
        quantized cache with 16-bit windows, ``oscar.decode_graphs`` on."""
        if _is_cpu():
            return AttentionCGSupport.NEVER
        rt = runtime(vllm_config, require=True)
        if rt.quantized and rt.windows and rt.opts.decode_graphs:
            return AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
        return AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec, layer_names, vllm_config: VllmConfig, device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self._init_reorder_batch_threshold(1)
        self.rt = runtime(vllm_config, require=not _is_cpu())
        self.block_size = kv_cache_spec.block_size
        self.slots = WindowSlots(self.rt.num_slots) if self.rt.windows else None
        self.pages = self.rt.channel_layers  # list the pages each step completes (channel-page layers write them)
        self._warned = 0
        self.device = torch.device(device)
        self.num_kv_heads = kv_cache_spec.num_kv_heads
        tp = vllm_config.parallel_config.tensor_parallel_size
        self.num_q_heads = self.rt.model.num_q_heads // tp  # this rank's query heads
        self.max_seqs = vllm_config.scheduler_config.max_num_seqs
        # vLLM's full graphs: decode batches padded to a capture size, at most this (0: none)
        cc = vllm_config.compilation_config
        full = self.device.type == "cuda" and cc.cudagraph_mode is not None and cc.cudagraph_mode.has_full_cudagraphs()
        self.full_graph_rows = (cc.max_cudagraph_capture_size or 0) if full else 0
        self.rows = max(self.max_seqs, self.full_graph_rows)  # rows of the persistent buffers and the plans
        self._plan: DecodePlan | None = None
        self._static_decode: StaticDecode | None = None
        if self.device.type == "cuda" and self.rt.quantized and self.rt.windows:  # decode rows take the decode kernel
            from vllm.model_executor.models.utils import extract_layer_index

            layers = sorted({extract_layer_index(name) for name in layer_names})
            for k_fmt, v_fmt in dict.fromkeys(self.rt.page_formats(i, self.num_kv_heads, self.block_size)
                                              for i in layers):
                prebuild_decode_kernels(k_fmt, v_fmt, self.num_q_heads, vllm_config.model_config.dtype,
                                        self.rt.window_dtype, self.max_seqs, logger.warning)

    def _new_plan(self, width: int) -> DecodePlan:
        """A decode plan for this rank's heads, every sequence slot and block tables ``width`` pages wide."""
        return DecodePlan(max_batch=self.rows, num_q_heads=self.num_q_heads, num_kv_heads=self.num_kv_heads,
                          head_dim=self.rt.model.head_dim, page_size=self.block_size, max_pages=width,
                          max_len16=self.rt.rows16, device=self.device)

    def _static(self, width: int) -> StaticDecode:
        """The persistent buffers of padded decode steps (built once, for the block table's width)."""
        if self._static_decode is None or self._static_decode.width < width:
            rows16 = self.rt.rows16
            self._static_decode = StaticDecode(self.rows, width, rows16, self.rt.num_slots * rows16,
                                               self._new_plan(width), self.device,
                                               self.block_size if self.pages else 0)
        return self._static_decode

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> OscarMetadata:
        cam = common_attn_metadata
        padded = cam.num_reqs
        qsl = cam.query_start_loc_cpu[: padded + 1].numpy().astype(np.int64)
        # rows of no tokens at the end are vLLM's padding of a batch to a full-graph capture size
        B = int(np.flatnonzero(np.diff(qsl))[-1]) + 1 if qsl[-1] > qsl[0] else 0
        qsl = qsl[: B + 1]
        seq_src = cam.seq_lens_cpu_upper_bound if cam.seq_lens_cpu_upper_bound is not None else cam.seq_lens.cpu()
        seq = seq_src[:B].numpy().astype(np.int64)
        bt = cam.block_table_tensor[:B]
        keys = bt[:, 0].cpu().numpy().astype(np.int64) if self.slots is not None else None
        step = build_step(self.rt.policy, self.slots, self.rt.num_slots, qsl, seq, keys, bt,
                          cam.slot_mapping[: int(qsl[-1])], self.block_size, pages=self.pages)
        if self.rt.windows and self.device.type == "cuda":
            if self.rt.opts.decode_graphs and step.num_decodes == B and B:  # decode only: padded for graphs
                # to vLLM's capture size where its full graph replays this step, else to the backend's bucket
                rows = padded if padded <= self.full_graph_rows else None
                step = self._static(cam.block_table_tensor.shape[1]).fill(step, rows)
            else:  # one split plan per step, shared by the layers
                self._plan = decode_plan(self._plan, step, self._new_plan)
                step.plan = self._plan if step.num_decodes else None
        if self.slots is not None and self.slots.degraded > self._warned:
            self._monitor().window_misses(self.slots.degraded - self._warned)
            self._warned = self.slots.degraded
            logger.warning("OSCAR: %d sequence step(s) read without 16-bit windows (raise oscar.max_seqs)",
                           self.slots.degraded)
        return OscarMetadata(step=step, block_size=self.block_size)

    def _monitor(self) -> PluginMonitor:
        from vllm.distributed import get_tensor_model_parallel_rank

        return monitor(get_tensor_model_parallel_rank(), self.rt.model.num_layers, self.rt.opts.monitor_every)


class OscarAttentionImpl(AttentionImpl[OscarMetadata]):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 alibi_slopes=None, sliding_window=None, kv_cache_dtype: str = "auto", logits_soft_cap=None,
                 attn_type: str = AttentionType.DECODER, kv_sharing_target_layer_name=None, **kwargs):
        for bad, what in ((attn_type != AttentionType.DECODER, f"attention type {attn_type}"),
                          (alibi_slopes is not None, "ALiBi"), (sliding_window is not None, "sliding windows"),
                          (bool(logits_soft_cap), "logit soft-capping"), (kwargs.get("sinks") is not None, "sinks"),
                          (kv_sharing_target_layer_name is not None, "cross-layer KV sharing"),
                          (kv_cache_dtype != "auto", f"kv_cache_dtype={kv_cache_dtype} (use auto)")):
            if bad:
                raise OscarVllmError(f"the OSCAR attention backend does not support {what}")
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        vllm_config = get_current_vllm_config()
        self.rt = runtime(vllm_config, require=not _is_cpu())
        if head_size != self.rt.model.head_dim:
            raise OscarVllmError(f"layer head size {head_size} != model head_dim {self.rt.model.head_dim}")
        self.pools = None
        if self.rt.windows:
            shape = (self.rt.num_slots + 1, self.rt.rows16, self.num_kv_heads, head_size)
            dtype = self.rt.window_dtype
            self.pools = (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
        self.params = None
        self.monitor: PluginMonitor | None = None
        self.layer_idx = -1
        self.formats: dict[int, tuple] = {}  # block size -> (K, V) PageFormat of this layer
        self.graphs: LayerGraphs | None = None

    def bind(self, layer: Any) -> None:
        """Load this layer's rotations and means for this rank's KV heads (once)."""
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
        from vllm.model_executor.models.utils import extract_layer_index

        idx = self.layer_idx = extract_layer_index(layer.layer_name)
        heads = local_kv_heads(self.rt.model.num_kv_heads, get_tensor_model_parallel_world_size(),
                               get_tensor_model_parallel_rank())
        if len(heads) != self.num_kv_heads:
            raise OscarVllmError(f"rank holds {self.num_kv_heads} KV heads, expected {len(heads)}")
        device = self.pools[0].device if self.pools is not None else layer._k_scale.device
        self.params = layer_params(self.rt, idx, heads, self.scale, device)
        if self.rt.quantized:
            rank = get_tensor_model_parallel_rank()
            self.monitor = monitor(rank, self.rt.model.num_layers, self.rt.opts.monitor_every)
            policy = self.rt.policy
            self.monitor.set_tiers(policy.sink if policy.windows else 0, policy.window if policy.windows else 0,
                                   self.rt.num_slots if self.rt.windows else 0)

    def kv_cache_spec(self, layer: Any, vllm_config: VllmConfig, original) -> FullAttentionSpec:
        """The spec vLLM sizes pages with: packed OSCAR pages, or vLLM's own 16-bit pages when quantization is
        off (the backend then keeps rotated K/V in them)."""
        if self.params is None:
            self.bind(layer)
        block_size = vllm_config.cache_config.block_size
        check_served(self.rt.recipe, self.rt.policy, block_size, self.rt.num_slots,
                     vllm_config.scheduler_config.max_num_seqs)
        if not self.rt.quantized:
            return original(layer, vllm_config)
        nbytes = page_bytes(*self._formats(block_size))
        ring = sum(t.numel() * t.element_size() for t in self.pools) if self.pools is not None else 0
        self.monitor.set_layer(self.layer_idx, nbytes / block_size, ring)
        return OscarAttentionSpec(block_size=block_size, num_kv_heads=self.num_kv_heads, head_size=self.head_size,
                                  dtype=torch.uint8, oscar_page_bytes=nbytes)

    def _formats(self, block_size: int) -> tuple:
        if block_size not in self.formats:
            try:
                self.formats[block_size] = self.rt.page_formats(self.layer_idx, self.num_kv_heads, block_size)
            except ValueError as e:
                raise OscarVllmError(f"layer {self.layer_idx}: {e}") from None
        return self.formats[block_size]

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None, output_block_scale_dummy=None):
        if output_scale is not None or output_block_scale is not None:
            raise OscarVllmError("fused output quantization is not supported by the OSCAR backend")
        if attn_metadata is None:  # profiling run
            return output
        if self.params is None:
            self.bind(layer)
        m = attn_metadata.step
        T = m.graph_rows or m.num_tokens
        q, k, v = query[:T], key[:T], value[:T]
        if self.rt.quantized:
            kv = carve(kv_cache, *self._formats(attn_metadata.block_size))
            # written straight into vLLM's output buffer (one rounding of the float32 result, as a copy would)
            out = output[:T].view(T, self.num_heads, self.head_size)
            if m.graph_rows and torch.cuda.is_current_stream_capturing():  # inside vLLM's full-graph capture
                quant_step(q, k, v, kv, self.pools, self.params, m, out=out)
            elif m.graph_rows:
                if self.graphs is None:
                    self.rt.graph_inputs = self.rt.graph_inputs or SharedInputs()
                    self.graphs = LayerGraphs(self.rt.graph_inputs)
                self.graphs.run(m, q, k, v, out, lambda qq, kk, vv, mm, oo: quant_step(
                    qq, kk, vv, kv, self.pools, self.params, mm, out=oo))
            else:
                quant_step(q, k, v, kv, self.pools, self.params, m, out=out)
                if self.monitor.due(self.layer_idx):
                    self.monitor.observe(self.layer_idx, self.params, kv, k, v, m.slot_mapping)
        else:
            kv16 = kv_cache.view(kv_cache.shape[0], 2, self.num_kv_heads, attn_metadata.block_size, self.head_size)
            out = dense_step(q, k, v, kv16, self.params, m)
            output[:T].copy_(out.view(output[:T].shape).to(output.dtype))
        return output


__all__ = ["OscarAttentionBackend", "OscarAttentionImpl", "OscarMetadataBuilder", "OscarAttentionSpec"]
