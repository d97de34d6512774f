"""Kernel ops over the paged 2-bit cache. Each op has a PyTorch reference (``reference.py``); the Triton
implementations run on CUDA, the references on CPU, under the same names (``dispatch.py``)."""

from .layout import PageFormat, QuantPages, slot_mapping
from .reference import decode_attention_ref, extend_attention_ref, gather_dequant_ref, quantize_write_ref

__all__ = [
    "PageFormat", "QuantPages", "slot_mapping", "quantize_write_ref", "gather_dequant_ref",
    "decode_attention_ref", "extend_attention_ref",
]
