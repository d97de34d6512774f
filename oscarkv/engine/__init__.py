"""Batched paged inference engine: plain-PyTorch Llama/Qwen2/Qwen3, BF16 or OSCAR 2-bit paged KV pool,
continuous batching with chunked prefill and preemption, CUDA-graph decode, sampling, streaming.

``from oscarkv import LLM, SamplingParams``; see ``docs/engine.md``. Importing this package loads no model.
"""

from .kv import CacheConfig
from .llm import LLM, Completion
from .model import PRESETS, ModelConfig, Transformer, random_model
from .sampling import SamplingParams

__all__ = ["LLM", "SamplingParams", "Completion", "CacheConfig", "ModelConfig", "Transformer", "PRESETS",
           "random_model"]
