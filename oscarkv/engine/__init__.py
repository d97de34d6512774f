"""Batched paged inference engine: plain-PyTorch Llama/Qwen2/Qwen3 over the OSCAR store (2-bit pages, 16-bit
sink + recent window) or a BF16 paged store, continuous batching with chunked prefill and preemption, CUDA-graph
decode, sampling, streaming, per-request fault isolation.

Pieces (nano-vllm's shape): :mod:`.sequence`, :mod:`.block_manager`, :mod:`.scheduler`, :mod:`.model_runner`
(CUDA graphs), :mod:`.core` (the engine step), :mod:`.llm` (the API), :mod:`.config` (:class:`EngineConfig`).
``from oscarkv import LLM, SamplingParams``; see ``docs/engine.md``. Importing this package loads no model.
"""

from .config import EngineConfig
from .llm import LLM, Completion
from .model import PRESETS, ModelConfig, Transformer, random_model
from .sampling import SamplingParams
from .sequence import Sequence

__all__ = ["LLM", "PRESETS", "Completion", "EngineConfig", "ModelConfig", "SamplingParams", "Sequence", "Transformer",
           "random_model"]
