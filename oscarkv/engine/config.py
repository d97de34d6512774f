"""``EngineConfig``: every option of :class:`oscarkv.LLM`, typed, frozen and validated. Unknown keys are errors.

No environment variable changes what the engine does: programmatic dependent launch, the decode GEMV and CUDA
graphs are fields here.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .model import GEMV_BACKENDS

KV_KINDS = ("oscar", "bf16")
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def _dtype(name: str, value: Any) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        if value is not None and value not in _DTYPES.values():
            raise ValueError(f"{name} must be one of {list(_DTYPES)}, got {value}")
        return value
    if value not in _DTYPES:
        raise ValueError(f"{name} must be one of {list(_DTYPES)} (or a torch dtype), got {value!r}")
    return _DTYPES[value]


def _int(name: str, value: Any, low: int, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}{' or None' if allow_none else ''}, got {value!r}")


@dataclass(frozen=True)
class EngineConfig:
    """Options of :class:`oscarkv.LLM`.

    Attributes:
        kv: "oscar" (2-bit pages, 16-bit sink + recent window) or "bf16" (16-bit pages in the model's dtype).
        method: the OSCAR method the cache stores (:mod:`oscarkv.methods`): default "oscar-auto" when the
            calibration has per-layer formats (``layer_formats``), else "oscar".
        kv_budget_gb: bytes of the KV store (all layers; 16-bit windows included), in GiB.
        max_num_seqs: concurrent sequences (slots). max_model_len: longest sequence (default: the model's).
        prefill_chunk: prompt tokens run per step (chunked prefill).
        dtype, device: the engine model's (default: the given model's).
        window_dtype: dtype of OSCAR's 16-bit tiers (default: the model's if 16-bit, else bfloat16, as in
            :mod:`oscarkv.hf`).
        cuda_graphs: capture the decode step per batch size on CUDA.
        gemv: "auto" (single-sequence decode steps on CUDA run the fused Triton GEMV, larger ones cuBLAS, as
            measured fastest), "cublas" or "triton" (decode steps of up to 8 sequences run the fused GEMV).
        pdl: programmatic dependent launch of the decode step's kernels on CUDA sm_90+ (a no-op elsewhere).
        monitor_every: sample every n-th demotion for the quantization monitors (0 = off).
        eos_token_ids: end-of-sequence ids (default: the model's generation config, else the tokenizer's).
    """

    kv: str = "oscar"
    method: str | None = None
    kv_budget_gb: float = 1.0
    max_num_seqs: int = 16
    max_model_len: int | None = None
    prefill_chunk: int = 2048
    dtype: Any = None
    device: str | None = None
    window_dtype: Any = None
    cuda_graphs: bool = True
    gemv: str = "auto"
    pdl: bool = True
    monitor_every: int = 4
    eos_token_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.kv not in KV_KINDS:
            raise ValueError(f"kv must be one of {list(KV_KINDS)}, got {self.kv!r}")
        if self.gemv not in GEMV_BACKENDS:
            raise ValueError(f"gemv must be one of {list(GEMV_BACKENDS)}, got {self.gemv!r}")
        b = self.kv_budget_gb
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b) or b <= 0:
            raise ValueError(f"kv_budget_gb must be a finite number > 0, got {b!r}")
        _int("max_num_seqs", self.max_num_seqs, 1)
        _int("max_model_len", self.max_model_len, 2, allow_none=True)
        _int("prefill_chunk", self.prefill_chunk, 1)
        _int("monitor_every", self.monitor_every, 0)
        for name in ("cuda_graphs", "pdl"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.method is not None and not isinstance(self.method, str):
            raise ValueError(f"method must be a method name, got {self.method!r}")
        if self.device is not None and not isinstance(self.device, (str, torch.device)):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        object.__setattr__(self, "dtype", _dtype("dtype", self.dtype))
        object.__setattr__(self, "window_dtype", _dtype("window_dtype", self.window_dtype))
        if self.eos_token_ids is not None:
            ids = tuple(self.eos_token_ids)
            if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
                raise ValueError(f"eos_token_ids must be token ids (ints >= 0), got {self.eos_token_ids!r}")
            object.__setattr__(self, "eos_token_ids", ids)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EngineConfig:
        """Build from a mapping; unknown keys are an error that lists the valid ones."""
        if not isinstance(data, Mapping):
            raise ValueError(f"an engine config must be a mapping of options, got {type(data).__name__}")
        unknown = sorted(set(data) - set(valid_keys()))
        if unknown:
            raise ValueError(f"unknown engine option(s) {unknown}; valid options: {valid_keys()}")
        return cls(**data)

    def replace(self, **changes: Any) -> EngineConfig:
        unknown = sorted(set(changes) - set(valid_keys()))
        if unknown:
            raise ValueError(f"unknown engine option(s) {unknown}; valid options: {valid_keys()}")
        return dataclasses.replace(self, **changes)


def valid_keys() -> list[str]:
    return [f.name for f in dataclasses.fields(EngineConfig)]


__all__ = ["GEMV_BACKENDS", "KV_KINDS", "EngineConfig", "valid_keys"]
