"""One name per kernel op; which implementation runs is decided here, by one rule.

Quantized-cache ops: :func:`quantize_write`, :func:`demote`, :func:`decode_attention`, :func:`extend_attention`,
:func:`rotate_rows`. Dense decoder ops (the engine's): :func:`rmsnorm`, :func:`silu_mul`, :func:`qk_prep`,
:func:`gemv`, :func:`embed_rope`, :func:`paged_decode`.

The rule (``backend`` argument of every op): ``"auto"`` (default) runs the fastest kernel that serves the call
on CUDA tensors, and the PyTorch reference (:mod:`oscarkv.kernels.reference`) on CPU tensors or inside
:func:`use_reference` (thread- and task-local); ``"reference"`` forces the reference; ``"triton"`` forces the
Triton kernel (CUDA tensors, or CPU tensors under Triton's interpreter, ``TRITON_INTERPRET=1``); ``"cuda"`` the
CUDA C++ decode kernel (decode only). On CUDA, a call no kernel can serve (e.g. a page size a format cannot pack,
more than one scale group per row) raises ``ValueError``: the reference is never taken silently. No environment
variable changes numerics or picks a kernel. Kernel modules are imported lazily, so this module imports without
Triton or a GPU.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib.util
from collections.abc import Iterator

import torch
from torch import Tensor

from . import reference as ref
from ._triton_util import interpreting
from .layout import KVDest, PageFormat, QuantPages
from .plan import DecodePlan

BACKENDS = ("auto", "reference", "triton", "cuda")
GEMV_MAX_M = 8  # rows up to which the decode GEMV kernel runs (beyond: cuBLAS, which is compute-efficient there)
_FORCE_REFERENCE: contextvars.ContextVar[bool] = contextvars.ContextVar("oscarkv_force_reference", default=False)


@contextlib.contextmanager
def use_reference(enabled: bool = True) -> Iterator[None]:
    """Inside the block, ops with ``backend="auto"`` run the PyTorch reference even on CUDA."""
    token = _FORCE_REFERENCE.set(enabled)
    try:
        yield
    finally:
        _FORCE_REFERENCE.reset(token)


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


_NO_CUDA = "the op has no CUDA C++ kernel"


def _pick(backend: str, device: torch.device, op: str, why_not: str | None = None,
          cuda_why_not: str | None = _NO_CUDA) -> str:
    """Resolve ``backend`` to "reference", "triton" or "cuda" for op ``op`` on tensors on ``device``.
    ``why_not``: why the Triton kernel cannot serve this call (None: it can); ``cuda_why_not``: the same for the
    CUDA C++ kernel (decode only)."""
    has_cuda = cuda_why_not is not _NO_CUDA
    if backend not in BACKENDS or (backend == "cuda" and not has_cuda):
        allowed = BACKENDS if has_cuda else tuple(b for b in BACKENDS if b != "cuda")
        raise ValueError(f"{op}: backend must be one of {allowed}, got {backend!r}")
    if backend == "reference" or (backend == "auto" and (_FORCE_REFERENCE.get() or device.type != "cuda")):
        return "reference"
    if backend == "cuda" or (backend == "auto" and has_cuda and cuda_why_not is None):
        if device.type != "cuda":
            raise ValueError(f"{op}: backend='cuda' needs CUDA tensors, got {device}; use 'auto' or 'reference'")
        if cuda_why_not:
            raise ValueError(f"{op}: the CUDA decode kernel cannot serve this call ({cuda_why_not}); use "
                             "backend='triton' or 'auto'")
        return "cuda"
    if device.type != "cuda" and not interpreting():
        raise ValueError(f"{op}: backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1), got {device}; use "
                         "'auto' or 'reference'")
    if not triton_available():
        raise ValueError(f"{op} needs the triton package on CUDA: pip install 'oscar-kv[kernels]', or use "
                         "backend='reference'")
    if why_not:
        raise ValueError(f"{op}: no kernel serves this call ({why_not}); use backend='reference' (slow)")
    return "triton"


def _format_why_not(k_fmt: PageFormat, v_fmt: PageFormat, *, write: bool = False) -> str | None:
    """Why the Triton kernels cannot serve pools of these formats (None: they can)."""
    d, ps = k_fmt.head_dim, k_fmt.page_size
    if v_fmt.channel:
        return "values are stored in token pages only"
    if (k_fmt.num_kv_heads, d, ps) != (v_fmt.num_kv_heads, v_fmt.head_dim, v_fmt.page_size):
        return "K and V pools must share num_kv_heads, head_dim and page_size"
    if write:
        if d % 4:
            return f"head_dim {d} is not a multiple of 4"
        if k_fmt.channel and ps & (ps - 1):
            return f"channel-page keys need a power-of-two page_size, got {ps}"
        return None
    if k_fmt.groups != 1 or v_fmt.groups != 1:
        return "attention kernels take one scale/offset group per row (group_size None)"
    if d < 16 or d & (d - 1) or ps < 16 or ps & (ps - 1):
        return f"attention kernels need head_dim and page_size powers of two >= 16, got {d} and {ps}"
    return None


def quantize_write(
    k_pages: QuantPages, v_pages: QuantPages, k: Tensor, v: Tensor, slots: Tensor, *,
    k_rotation: Tensor | None = None, v_rotation: Tensor | None = None,
    k_mean: Tensor | None = None, v_mean: Tensor | None = None,
    k_clip: float = 0.0, v_clip: float = 0.0, backend: str = "auto", check_pages: bool = True,
) -> None:
    """Center (``mean [Hkv, d]``), rotate (``x @ R``, ``R [d, d]`` or ``[Hkv, d, d]``), clip, quantize and pack
    K and V rows ``[N, Hkv, d]`` into ``slots`` ``[N]`` (``page * page_size + row``; negative = skip) of both
    pools, in place, each pool in its own format. Codes and metadata are bit-identical across backends.

    Keys in channel pages (``k_pages.fmt.layout == "channel"``): whole pages only (``N`` a multiple of
    ``page_size``, each run of ``page_size`` slots one page in order, or all negative), ``k_clip = 0``; a
    partial page raises ``ValueError`` (checked on the host; ``check_pages=False`` skips the check on the
    kernel path, e.g. under graph capture). Values always use token pages."""
    which = _pick(backend, k.device, "quantize_write", _format_why_not(k_pages.fmt, v_pages.fmt, write=True))
    if which == "reference":
        ref.quantize_write_ref(k_pages, k, slots, rotation=k_rotation, mean=k_mean, clip_ratio=k_clip)
        ref.quantize_write_ref(v_pages, v, slots, rotation=v_rotation, mean=v_mean, clip_ratio=v_clip)
        return
    from .quantize_triton import quantize_write_triton

    quantize_write_triton(k_pages, v_pages, k, v, slots, k_rotation=k_rotation, v_rotation=v_rotation,
                          k_mean=k_mean, v_mean=v_mean, k_clip=k_clip, v_clip=v_clip, check_pages=check_pages)


def demote(
    k_pages: QuantPages, v_pages: QuantPages, k16: Tensor, v16: Tensor, seq_ids: Tensor, src_index: Tensor,
    slots: Tensor, *, k_clip: float = 0.0, v_clip: float = 0.0, backend: str = "auto", check_pages: bool = True,
) -> None:
    """Demote 16-bit-tier rows ``k16/v16[seq_ids[i], :, src_index[i]]`` (``[B, Hkv, C16, d]``, already centered
    and rotated) into quantized ``slots[i]``, in place. Channel-page keys: whole pages only, as in
    :func:`quantize_write`."""
    which = _pick(backend, k16.device, "demote", _format_why_not(k_pages.fmt, v_pages.fmt, write=True))
    if which == "reference":
        ref.demote_ref(k_pages, v_pages, k16, v16, seq_ids, src_index, slots, k_clip=k_clip, v_clip=v_clip)
        return
    from .quantize_triton import demote_triton

    demote_triton(k_pages, v_pages, k16, v16, seq_ids, src_index, slots, k_clip=k_clip, v_clip=v_clip,
                  check_pages=check_pages)


def _cuda_decode_why_not(q: Tensor, k_pages: QuantPages, v_pages: QuantPages, k16: Tensor) -> str | None:
    if q.device.type != "cuda":
        return "CPU tensors"
    from . import decode_cuda

    return decode_cuda.unsupported(k_pages.fmt, v_pages.fmt, q.shape[1], k16.dtype, q.dtype)


def decode_attention(
    q: Tensor, k_pages: QuantPages, v_pages: QuantPages, block_table: Tensor, qlen: Tensor,
    k16: Tensor, v16: Tensor, len16: Tensor, sm_scale: float | None = None, *,
    plan: DecodePlan | None = None, out: Tensor | None = None, backend: str = "auto", pdl: bool = False,
) -> Tensor:
    """One query per sequence (``q [B, Hq, d]``, rotated) over its 16-bit tiers (``k16/v16 [B, Hkv, C16, d]``,
    ``len16 [B]``) and quantized pages (``block_table [B, max_pages]``, ``qlen [B]``, int32), K and V pools each
    in its own format. Returns ``[B, Hq, d]`` in q's dtype (or written into ``out``), in the rotated V basis.
    ``plan``: see :class:`DecodePlan` (kernel paths; graph-safe when preallocated). "auto" on CUDA: the CUDA C++
    kernel where :func:`oscarkv.kernels.decode_cuda.unsupported` names no reason, else the Triton kernel.
    ``pdl``: the CUDA kernel's programmatic dependent launch (ignored by the other paths)."""
    which = _pick(backend, q.device, "decode_attention", _format_why_not(k_pages.fmt, v_pages.fmt),
                  _cuda_decode_why_not(q, k_pages, v_pages, k16))
    if which == "reference":
        res = ref.decode_attention_ref(q, k_pages, v_pages, block_table, qlen, k16, v16, len16, sm_scale)
        return res.to(q.dtype) if out is None else out.copy_(res)
    if which == "cuda":
        from .decode_cuda import decode_attention_cuda

        return decode_attention_cuda(q, k_pages, v_pages, block_table, qlen, k16, v16, len16, sm_scale, plan=plan,
                                     out=out, pdl=pdl)
    from .decode_triton import decode_attention_triton

    return decode_attention_triton(q, k_pages, v_pages, block_table, qlen, k16, v16, len16, sm_scale, plan=plan,
                                   out=out)


def extend_attention(
    q: Tensor, k_new: Tensor, v_new: Tensor, k_pages: QuantPages, v_pages: QuantPages, block_table: Tensor,
    qlen: Tensor, k16: Tensor, v16: Tensor, len16: Tensor, sm_scale: float | None = None, *,
    out: Tensor | None = None, backend: str = "auto", host_lengths: tuple | None = None,
) -> Tensor:
    """A chunk of ``T`` new tokens per sequence (``q [B, T, Hq, d]``, ``k_new/v_new [B, T, Hkv, d]``) attends
    causally to itself and fully to the stored prefix. Returns ``[B, T, Hq, d]`` in q's dtype.
    ``host_lengths``: ``(qlen, len16)`` as host integers, if the caller has them (the cuDNN fold of the kernel
    path otherwise reads them from the device)."""
    which = _pick(backend, q.device, "extend_attention", _format_why_not(k_pages.fmt, v_pages.fmt))
    if which == "reference":
        res = ref.extend_attention_ref(q, k_new, v_new, k_pages, v_pages, block_table, qlen, k16, v16, len16,
                                       sm_scale)
        return res.to(q.dtype) if out is None else out.copy_(res)
    from .extend_triton import extend_attention_triton

    return extend_attention_triton(q, k_new, v_new, k_pages, v_pages, block_table, qlen, k16, v16, len16,
                                   sm_scale, out=out, host_lengths=host_lengths)


def rotate_rows(
    x: Tensor, r: Tensor, mu: Tensor | None = None, *, out: Tensor | None = None, transpose: bool = False,
    mean_after: bool = False, rows_out: Tensor | None = None, rows: Tensor | None = None, backend: str = "auto",
) -> Tensor | None:
    """Rotate each head's rows in float32: ``(x[n, h] - mu[h // G]) @ R[h // G]`` (``transpose``: ``@ R^T``;
    ``mean_after``: ``+ mu`` after), ``x [N, Hx, d]``, ``r [H, d, d]``, ``mu [H, d]`` float32, ``G = Hx / H``.
    Written, cast to their dtypes, into ``out [N, Hx, d]`` and/or rows ``rows [N]`` of ``rows_out [M, Hx, d]``
    (e.g. a 16-bit ring), in one launch on the kernel path. Returns ``out``."""
    kw = {"out": out, "transpose": transpose, "mean_after": mean_after, "rows_out": rows_out, "rows": rows}
    d = x.shape[-1]
    why = None if d >= 16 and not d & (d - 1) else f"head_dim must be a power of two >= 16, got {d}"
    if _pick(backend, x.device, "rotate_rows", why) == "reference":
        return ref.rotate_rows_ref(x, r, mu, **kw)
    from .rotate_triton import rotate_rows_triton

    return rotate_rows_triton(x, r, mu, **kw)


# ------------------------------------------------------------------------------ dense ops of the decoder
def uses_kernels(x: Tensor, backend: str = "auto") -> bool:
    """Whether an op with this ``backend`` on tensors like ``x`` runs a kernel (not the reference)."""
    return _pick(backend, x.device, "uses_kernels") != "reference"


def pdl_available(x: Tensor, backend: str = "auto") -> bool:
    """Whether the dense ops' kernels on ``x``'s device run as programmatic dependent launches when asked
    (``pdl=True``): the kernel path on CUDA sm_90+ with a Triton that has grid dependency control. Elsewhere
    ``pdl`` is a no-op."""
    if not uses_kernels(x, backend):
        return False
    from .dense_triton import pdl_available as kernel_pdl

    return kernel_pdl(x)


def rmsnorm(x: Tensor, w: Tensor, eps: float, residual: Tensor | None = None, pdl: bool = False, *,
            backend: str = "auto") -> tuple[Tensor, Tensor]:
    """``(rmsnorm(x + residual) * w, x + residual)`` (HF's RMSNorm: normalised in float32, cast back, then
    scaled), ``x [N, D]``; with ``residual=None`` the second output is ``x``. ``pdl`` here and below: the kernel
    as a programmatic dependent launch where :func:`pdl_available`."""
    if _pick(backend, x.device, "rmsnorm") == "reference":
        h = x if residual is None else x + residual
        return ref.rmsnorm_ref(h, w, eps), h
    from .dense_triton import rmsnorm as kernel

    return kernel(x, w, eps, residual, pdl=pdl)


def silu_mul(gu: Tensor, pdl: bool = False, *, backend: str = "auto") -> Tensor:
    """``silu(gate) * up`` for ``gu = [gate | up]`` ``[N, 2I]``."""
    if _pick(backend, gu.device, "silu_mul") == "reference":
        gate, up = gu.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up
    from .dense_triton import silu_mul as kernel

    return kernel(gu, pdl=pdl)


def qk_prep(qkv: Tensor, hq: int, hkv: int, d: int, cos: Tensor, sin: Tensor, qn: Tensor | None, kn: Tensor | None,
            eps: float, r_k: Tensor | None = None, mu_k: Tensor | None = None, out: KVDest | None = None,
            pdl: bool = False, *, backend: str = "auto") -> tuple[Tensor, Tensor | None]:
    """Split fused QKV ``[N, (hq + 2 hkv) d]``, QK-norm (weights ``qn``/``kn``, if given), RoPE (``cos/sin
    [N, d]``), and with ``r_k [hkv, d, d]`` center keys by ``mu_k [hkv, d]`` and rotate queries and keys. Returns
    ``(q [N, hq, d], kv [2, N, hkv, d])``; with ``out`` the kernel stores k/v into the pool itself and returns
    ``kv=None`` (the reference ignores ``out`` and returns kv for the caller's write)."""
    if _pick(backend, qkv.device, "qk_prep") == "reference":
        return ref.qk_prep_ref(qkv, hq, hkv, d, cos, sin, qn, kn, eps, r_k, mu_k)
    from .dense_triton import qk_prep as kernel

    return kernel(qkv, hq, hkv, d, cos, sin, qn, kn, eps, r_k, mu_k, out, pdl=pdl)


def gemv(x: Tensor, w: Tensor, b: Tensor | None = None, residual: Tensor | None = None, norm: Tensor | None = None,
         eps: float = 1e-6, act: str | None = None, out_dtype: torch.dtype | None = None, pdl: bool = False, *,
         backend: str = "auto") -> Tensor:
    """The fused decode GEMV, ``linear(pro(x), w, b)`` rounded to x's dtype ``(+ residual)``, for ``x [M, K]``,
    ``M <= GEMV_MAX_M`` on the kernel path (:func:`oscarkv.kernels.reference.gemv_ref`: ``norm`` fuses an
    RMSNorm, ``act="silu"`` a SiLU gate over ``x = [gate | up]``; ``out_dtype``: the stored dtype)."""
    if _pick(backend, x.device, "gemv") == "reference":
        return ref.gemv_ref(x, w, b, residual, norm, eps, act, out_dtype)
    from .gemv_triton import gemv as kernel

    return kernel(x, w, b, residual, norm, eps, act, out_dtype=out_dtype, pdl=pdl)


def embed_rope(tokens: Tensor, positions: Tensor, emb: Tensor, inv_freq2: Tensor, scaling: float = 1.0,
               pdl: bool = False, *, backend: str = "auto") -> tuple[Tensor, Tensor, Tensor]:
    """A step's embedding rows ``[N, D]`` and RoPE ``cos/sin [N, d]`` (``inv_freq2`` float32 ``[d]``: both halves
    of the frequencies; ``* scaling``), in the embedding dtype; one launch on the kernel path."""
    if _pick(backend, emb.device, "embed_rope") == "reference":
        return ref.embed_rope_ref(tokens, positions, emb, inv_freq2, scaling)
    from .dense_triton import embed_rope as kernel

    return kernel(tokens, positions, emb, inv_freq2, scaling, pdl=pdl)


def paged_decode(q: Tensor, kv: Tensor, block_table: Tensor, lens: Tensor, sm_scale: float,
                 max_len: int | None = None, pdl: bool = False, *, backend: str = "auto") -> Tensor:
    """One query per sequence over 16-bit pages: q ``[B, Hq, d]``, kv ``[2, pages, Hkv, P, d]``, block_table int32
    ``[B, max_pages]``, lens ``[B]``; returns ``[B, Hq, d]`` (zeros for empty sequences). Graph-safe on the kernel
    path (a fixed grid sized from ``max_len``, the most tokens a sequence may hold)."""
    if _pick(backend, q.device, "paged_decode") == "reference":
        return ref.paged_decode_ref(q, kv, block_table, lens, sm_scale)
    from .dense_triton import paged_decode as kernel

    return kernel(q, kv, block_table, lens, sm_scale, max_len, pdl=pdl)


__all__ = [
    "BACKENDS",
    "GEMV_MAX_M",
    "DecodePlan",
    "KVDest",
    "decode_attention",
    "demote",
    "embed_rope",
    "extend_attention",
    "gemv",
    "paged_decode",
    "pdl_available",
    "qk_prep",
    "quantize_write",
    "rmsnorm",
    "rotate_rows",
    "silu_mul",
    "triton_available",
    "use_reference",
    "uses_kernels",
]
