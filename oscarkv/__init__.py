"""oscarkv: 2-bit KV-cache quantization with offline spectral covariance-aware rotations (OSCAR).

Importing the package changes no global state; heavy submodules (transformers integration, kernels, engine)
load on first use.
"""

from __future__ import annotations

__version__ = "0.1.0"

from .config import QuantSpec  # noqa: E402  (light: stdlib only)

_LAZY = {
    "Calibration": ("oscarkv.artifact", "Calibration"),
    "quantize": ("oscarkv.quant", "quantize"),
    "dequantize": ("oscarkv.quant", "dequantize"),
    "LLM": ("oscarkv.engine", "LLM"),
    "SamplingParams": ("oscarkv.engine", "SamplingParams"),
    "EngineConfig": ("oscarkv.engine", "EngineConfig"),
    "LayerFormat": ("oscarkv.formats", "LayerFormat"),
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'oscarkv' has no attribute {name!r}")


__all__ = ["QuantSpec", "__version__", *_LAZY]
