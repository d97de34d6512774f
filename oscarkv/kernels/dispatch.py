"""One name per kernel op: the Triton (or CUDA C++) kernel on CUDA tensors, the PyTorch reference on CPU.

Ops: :func:`quantize_write`, :func:`demote`, :func:`decode_attention`, :func:`extend_attention`,
:func:`rotate_rows`. Each takes a ``backend`` argument: ``"auto"`` (default: kernels on CUDA when supported,
else the reference), ``"reference"``, ``"triton"`` or, for decode, ``"cuda"`` (the hand-written decode kernel).
:func:`use_reference` forces the reference inside a ``with`` block (thread- and task-local). No environment
variable changes numerics.
Kernel modules are imported lazily, so this module imports without Triton or a GPU.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib.util
from typing import Iterator

import torch
from torch import Tensor

from . import reference as ref
from .layout import QuantPages
from .plan import DecodePlan

BACKENDS = ("auto", "reference", "triton", "cuda")
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


def _kernels_supported(fmt, v_fmt=None) -> bool:
    """The Triton attention kernels handle this (key) format, with values in ``v_fmt`` (token pages)."""
    d = fmt.head_dim
    if v_fmt is not None and (v_fmt.channel or not fmt.same_geometry(v_fmt)):
        return False
    return fmt.bits == 2 and fmt.groups == 1 and d >= 64 and not d & (d - 1) and fmt.page_size >= 16 \
        and not fmt.page_size & (fmt.page_size - 1)


def _write_supported(k_pages: QuantPages, v_pages: QuantPages) -> bool:
    """The Triton quantize kernel handles these pools: K and V of one geometry (bits, groups, ...; else "auto"
    runs the reference, e.g. for 2-bit keys with 4-bit values), channel-page keys with a power-of-two page >= 16."""
    fk, fv = k_pages.fmt, v_pages.fmt
    if fv.channel or not fk.same_geometry(fv):
        return False
    return not fk.channel or (fk.page_size >= 16 and not fk.page_size & (fk.page_size - 1))


def _pick(backend: str, device: torch.device, supported: bool, cuda_fmt=None, dtype16=None, q_dtype=None) -> str:
    """Resolve ``backend`` to "reference", "triton" or "cuda" for tensors on ``device``; ``supported``: the
    kernels handle this format (else "auto" falls back to the reference); ``cuda_fmt``: the page format, for
    ops that have a CUDA C++ kernel, with the dtypes of the 16-bit tiers and the queries it runs on ("auto"
    picks the CUDA kernel only where :func:`decode_cuda.supported` says it can run)."""
    cuda_ok = cuda_fmt is not None
    if backend == "cuda" and cuda_ok:
        from . import decode_cuda

        if cuda_fmt.channel:
            raise ValueError("the CUDA decode kernel does not support keys in channel pages: use backend='triton' "
                             "(or 'auto', which picks it)")
        if decode_cuda.supported(cuda_fmt) and not decode_cuda.supported(cuda_fmt, dtype16, q_dtype):
            raise ValueError(f"the CUDA decode kernel reads float16/bfloat16 16-bit tiers and float32/float16/"
                             f"bfloat16 queries, got {dtype16} tiers and {q_dtype} queries: use backend='triton' "
                             "(or 'auto', which picks it), or keep the 16-bit tiers in float16/bfloat16")
    if backend not in BACKENDS or (backend == "cuda" and not cuda_ok):
        allowed = BACKENDS if cuda_ok else tuple(b for b in BACKENDS if b != "cuda")
        raise ValueError(f"backend must be one of {allowed}, got {backend!r}")
    if backend != "auto":
        if backend != "reference" and device.type != "cuda":
            raise ValueError(f"backend={backend!r} needs CUDA tensors, got {device}; use 'auto' or 'reference'")
        if backend == "triton" and not triton_available():
            raise ValueError("backend='triton' needs the triton package: pip install 'oscar-kv[kernels]'")
        return backend
    if _FORCE_REFERENCE.get() or device.type != "cuda" or not triton_available() or not supported:
        return "reference"
    if cuda_ok:
        from . import decode_cuda

        if decode_cuda.supported(cuda_fmt, dtype16, q_dtype):
            return "cuda"
    return "triton"


def quantize_write(
    k_pages: QuantPages, v_pages: QuantPages, k: Tensor, v: Tensor, slots: Tensor, *,
    k_rotation: Tensor | None = None, v_rotation: Tensor | None = None,
    k_mean: Tensor | None = None, v_mean: Tensor | None = None,
    k_clip: float = 0.0, v_clip: float = 0.0, backend: str = "auto", check_pages: bool = True,
) -> None:
    """Center (``mean [Hkv, d]``), rotate (``x @ R``, ``R [d, d]`` or ``[Hkv, d, d]``), clip, quantize and pack
    K and V rows ``[N, Hkv, d]`` into ``slots`` ``[N]`` (``page * page_size + row``; negative = skip) of both
    pools, in place. The kernel path does K and V in one launch.

    Keys in channel pages (``k_pages.fmt.layout == "channel"``): whole pages only (``N`` a multiple of
    ``page_size``, each run of ``page_size`` slots one page in order, or all negative), ``k_clip = 0``; a
    partial page raises ``ValueError`` (checked on the host; ``check_pages=False`` skips the check on the
    kernel path, e.g. under graph capture). Values always use token pages."""
    if _pick(backend, k.device, _write_supported(k_pages, v_pages)) == "reference":
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
    """Demote 16-bit-tier rows ``k16/v16[seq_ids[i], :, src_index[i]]`` to 2-bit ``slots[i]``, in place.
    Channel-page keys: whole pages only, as in :func:`quantize_write`."""
    if _pick(backend, k16.device, _write_supported(k_pages, v_pages)) == "reference":
        ref.demote_ref(k_pages, v_pages, k16, v16, seq_ids, src_index, slots, k_clip=k_clip, v_clip=v_clip)
        return
    from .quantize_triton import demote_triton

    demote_triton(k_pages, v_pages, k16, v16, seq_ids, src_index, slots, k_clip=k_clip, v_clip=v_clip,
                  check_pages=check_pages)


def decode_attention(
    q: Tensor, k_pages: QuantPages, v_pages: QuantPages, block_table: Tensor, qlen: Tensor,
    k16: Tensor, v16: Tensor, len16: Tensor, sm_scale: float | None = None, *,
    plan: DecodePlan | None = None, out: Tensor | None = None, backend: str = "auto", pdl: bool = False,
) -> Tensor:
    """One query per sequence (``q [B, Hq, d]``, rotated) over its 16-bit tiers (``k16/v16 [B, Hkv, C16, d]``,
    ``len16 [B]``) and 2-bit pages (``block_table [B, max_pages]``, ``qlen [B]``, int32). Returns
    ``[B, Hq, d]`` in q's dtype, in the rotated V basis. ``plan``: see :class:`DecodePlan` (kernel paths).
    Keys in channel pages and float32 16-bit tiers run on the Triton kernel ("auto" never picks the CUDA C++
    kernel for them; ``backend="cuda"`` raises ``ValueError``). ``pdl``: the CUDA kernel's programmatic dependent
    launch (:func:`oscarkv.kernels.decode_cuda.decode_attention_cuda`); ignored by the other paths."""
    which = _pick(backend, q.device, _kernels_supported(k_pages.fmt, v_pages.fmt), cuda_fmt=k_pages.fmt,
                  dtype16=k16.dtype, q_dtype=q.dtype)
    if which == "reference":
        res = ref.decode_attention_ref(q, k_pages, v_pages, block_table, qlen, k16, v16, len16, sm_scale)
        if out is None:
            return res.to(q.dtype)
        return out.copy_(res)
    if which == "cuda":
        from .decode_cuda import decode_attention_cuda

        return decode_attention_cuda(q, k_pages, v_pages, block_table, qlen, k16, v16, len16, sm_scale, plan=plan,
                                     out=out, pdl=pdl)
    from .decode_triton import decode_attention_triton

    return decode_attention_triton(q, k_pages, v_pages, block_table, qlen, k16, v16, len16, sm_scale, plan=plan,
                                   out=out)


def rotate_rows(
    x: Tensor, r: Tensor, mu: Tensor | None = None, *, out: Tensor | None = None, transpose: bool = False,
    mean_after: bool = False, rows_out: Tensor | None = None, rows: Tensor | None = None, backend: str = "auto",
) -> Tensor | None:
    """Rotate each head's rows in float32: ``(x[n, h] - mu[h // G]) @ R[h // G]`` (``transpose``: ``@ R^T``;
    ``mean_after``: ``+ mu`` after), ``x [N, Hx, d]``, ``r [H, d, d]``, ``mu [H, d]`` float32, ``G = Hx / H``.
    Written, cast to their dtypes, into ``out [N, Hx, d]`` and/or rows ``rows [N]`` of ``rows_out [M, Hx, d]``
    (e.g. a 16-bit ring), in one launch on the kernel path. Returns ``out``."""
    kw = dict(out=out, transpose=transpose, mean_after=mean_after, rows_out=rows_out, rows=rows)
    d = x.shape[-1]
    if _pick(backend, x.device, d >= 16 and not d & (d - 1)) == "reference":
        return ref.rotate_rows_ref(x, r, mu, **kw)
    from .rotate_triton import rotate_rows_triton

    return rotate_rows_triton(x, r, mu, **kw)


def extend_attention(
    q: Tensor, k_new: Tensor, v_new: Tensor, k_pages: QuantPages, v_pages: QuantPages, block_table: Tensor,
    qlen: Tensor, k16: Tensor, v16: Tensor, len16: Tensor, sm_scale: float | None = None, *,
    out: Tensor | None = None, backend: str = "auto", host_lengths: tuple | None = None,
) -> Tensor:
    """A chunk of ``T`` new tokens per sequence (``q [B, T, Hq, d]``, ``k_new/v_new [B, T, Hkv, d]``) attends
    causally to itself and fully to the stored prefix. Returns ``[B, T, Hq, d]`` in q's dtype.
    ``host_lengths``: ``(qlen, len16)`` as host integers, if the caller has them (the CUDA path's cuDNN fold
    otherwise reads them from the device)."""
    if _pick(backend, q.device, _kernels_supported(k_pages.fmt, v_pages.fmt)) == "reference":
        res = ref.extend_attention_ref(q, k_new, v_new, k_pages, v_pages, block_table, qlen, k16, v16, len16,
                                       sm_scale)
        if out is None:
            return res.to(q.dtype)
        return out.copy_(res)
    from .extend_triton import extend_attention_triton

    return extend_attention_triton(q, k_new, v_new, k_pages, v_pages, block_table, qlen, k16, v16, len16,
                                   sm_scale, out=out, host_lengths=host_lengths)


__all__ = ["BACKENDS", "DecodePlan", "use_reference", "quantize_write", "demote", "decode_attention",
           "extend_attention", "rotate_rows", "triton_available"]
