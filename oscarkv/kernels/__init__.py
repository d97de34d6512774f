"""Kernel ops over the paged quantized cache and the decoder's dense ops. Each op has a PyTorch reference
(``reference.py``); Triton kernels (and a CUDA C++ decode kernel) run on CUDA, the references on CPU, under the
same names (``dispatch.py``). Importing this package needs neither Triton nor a GPU."""

from .dispatch import (
    BACKENDS, decode_attention, demote, extend_attention, quantize_write, rotate_rows, use_reference,
)
from .layout import LAYOUTS, KVDest, PageFormat, QuantPages, slot_mapping
from .plan import DecodePlan
from .reference import (
    channel_page_ids, decode_attention_ref, demote_ref, dequantize_pages_ref, extend_attention_ref,
    gather_dequant_ref, quantize_write_ref,
)

__all__ = [
    "LAYOUTS", "PageFormat", "QuantPages", "KVDest", "slot_mapping", "DecodePlan", "BACKENDS", "use_reference",
    "quantize_write", "demote", "decode_attention", "extend_attention", "rotate_rows",
    "quantize_write_ref", "channel_page_ids", "dequantize_pages_ref", "demote_ref", "gather_dequant_ref",
    "decode_attention_ref", "extend_attention_ref",
]
