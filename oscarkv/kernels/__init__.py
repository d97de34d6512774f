"""Kernel ops over the paged quantized cache and the decoder's dense ops. Each op has a PyTorch reference
(``reference.py``); Triton kernels (and a CUDA C++ decode kernel) run on CUDA, the references on CPU, under the
same names (``dispatch.py``). Importing this package needs neither Triton nor a GPU."""

from .dispatch import (
    BACKENDS,
    decode_attention,
    demote,
    extend_attention,
    quantize_write,
    rotate_rows,
    use_reference,
)
from .layout import LAYOUTS, KVDest, PageFormat, QuantPages, slot_mapping
from .plan import DecodePlan
from .reference import (
    channel_page_ids,
    decode_attention_ref,
    demote_ref,
    dequantize_pages_ref,
    extend_attention_ref,
    gather_dequant_ref,
    quantize_write_ref,
)

__all__ = [
    "BACKENDS",
    "LAYOUTS",
    "DecodePlan",
    "KVDest",
    "PageFormat",
    "QuantPages",
    "channel_page_ids",
    "decode_attention",
    "decode_attention_ref",
    "demote",
    "demote_ref",
    "dequantize_pages_ref",
    "extend_attention",
    "extend_attention_ref",
    "gather_dequant_ref",
    "quantize_write",
    "quantize_write_ref",
    "rotate_rows",
    "slot_mapping",
    "use_reference",
]
