"""Reference quantizers in plain PyTorch (CPU and GPU). This file is the specification the kernels match.

The normative format is section 3 of ``docs/method.md`` (copied to the repository's ``docs/method.md``):

* clip each row to the ``idx``-th smallest ``|x|`` with ``idx = min(floor(ratio * d), d - 1)``;
* per group of ``G`` elements: ``lo = min``, ``scale = (max - lo) / (2**bits - 1)`` in float32, both stored in
  the metadata dtype (round to nearest); codes computed from the *stored* values upcast to float32:
  ``q = clamp(floor((x - lo_s) / scale_s + 0.5), 0, 2**bits - 1)``, all codes 0 where ``scale_s == 0``;
* pack "quartered": byte ``c`` holds elements ``c, c + d/4, c + d/2, c + 3d/4`` in bits [1:0], [3:2], [5:4],
  [7:6] (4-bit: ``c`` in [3:0], ``c + d/2`` in [7:4]).

Also here: the KIVI per-channel key quantizer and the optional Lloyd-Max (non-uniform) quantizer.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

META_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}

# Lloyd-Max quantizer for a unit Gaussian, 4 levels: decision thresholds 0, +-t and reconstruction levels.
_LLOYD_MAX_T = 0.9816
_LLOYD_MAX_LEVELS = (-1.5104, -0.4528, 0.4528, 1.5104)


@dataclass
class QuantizedRows:
    """Rows quantized to ``bits`` bits in groups of ``group_size``.

    ``packed``: uint8 ``[..., dim * bits / 8]``; ``scale`` and ``offset``: metadata dtype ``[..., dim / group_size]``.
    ``kind`` is "uniform" (offset = group minimum, scale = step) or "lloyd-max" (offset = mean, scale = std).
    """

    packed: Tensor
    scale: Tensor
    offset: Tensor
    bits: int
    group_size: int
    dim: int
    kind: str = "uniform"

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.packed.shape[:-1]) + (self.dim,)

    def nbytes(self) -> int:
        """Physical bytes held by the three tensors."""
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scale, self.offset))


def resolve_meta_dtype(meta_dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(meta_dtype, str):
        if meta_dtype not in META_DTYPES:
            raise ValueError(f"meta_dtype must be one of {list(META_DTYPES)}, got {meta_dtype!r}")
        return META_DTYPES[meta_dtype]
    if meta_dtype not in META_DTYPES.values():
        raise ValueError(f"meta_dtype must be float16, bfloat16 or float32, got {meta_dtype}")
    return meta_dtype


def check_clip_ratio(ratio: float) -> float:
    """``ratio`` as a float in [0, 1] (0 and 1 both mean no clipping); ``TypeError`` for a non-number,
    ``ValueError`` for a number outside the interval (NaN included)."""
    if isinstance(ratio, bool) or not isinstance(ratio, (numbers.Real, Tensor)):
        raise TypeError(f"clip_ratio must be a number in [0, 1] (0 or 1: no clipping), got {ratio!r}")
    r = float(ratio)
    if not 0.0 <= r <= 1.0:  # NaN fails the comparison too
        what = "NaN" if math.isnan(r) else repr(ratio)
        raise ValueError(f"clip_ratio must be a number in [0, 1] (0 or 1: no clipping), got {what}")
    return r


def clip_index(ratio: float, dim: int) -> int | None:
    """0-based order statistic used as the clip threshold, or None where ``ratio`` disables clipping. Raises
    ``ValueError`` for a ratio outside [0, 1] (:func:`check_clip_ratio`)."""
    ratio = check_clip_ratio(ratio)
    if ratio <= 0.0 or ratio >= 1.0:
        return None
    return min(math.floor(ratio * dim), dim - 1)


def clip_rows(x: Tensor, ratio: float) -> Tensor:
    """Clamp each row (last dim) to ``[-tau, tau]``, ``tau`` the ``clip_index``-th smallest ``|x|``."""
    idx = clip_index(ratio, x.shape[-1])
    if idx is None:
        return x
    tau = torch.kthvalue(x.abs(), idx + 1, dim=-1, keepdim=True).values
    return torch.minimum(torch.maximum(x, -tau), tau)


def clip_rows_grid(x: Tensor, ratios: Sequence[float]) -> Iterator[Tensor]:
    """:func:`clip_rows` of ``x`` for each ratio in ``ratios``, with one sort of ``|x|`` serving them all
    (clip fitting and format selection try a grid of ratios on the same rows)."""
    sorted_abs = x.abs().sort(dim=-1).values
    for ratio in ratios:
        idx = clip_index(ratio, x.shape[-1])
        if idx is None:
            yield x
            continue
        tau = sorted_abs[..., idx: idx + 1]
        yield torch.minimum(torch.maximum(x, -tau), tau)


def _check_rows(x: Tensor, bits: int, group_size: int | None) -> int:
    if bits not in (2, 4):
        raise ValueError(f"bits must be 2 or 4, got {bits}")
    if x.ndim < 1 or x.shape[-1] == 0:
        raise ValueError(f"x must have a non-empty last dimension (a row), got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"x must be a floating-point tensor, got {x.dtype}")
    d = x.shape[-1]
    g = d if group_size is None else group_size
    per_byte = 8 // bits
    if d % per_byte:
        raise ValueError(f"row length {d} must be a multiple of {per_byte} for {bits}-bit packing")
    if g <= 0 or d % g:
        raise ValueError(f"group_size {g} must divide the row length {d}")
    return g


def pack(codes: Tensor, bits: int) -> Tensor:
    """Pack integer codes ``[..., d]`` (values < 2**bits) into uint8 ``[..., d * bits / 8]``, quartered layout."""
    per_byte = 8 // bits
    d = codes.shape[-1]
    parts = codes.to(torch.uint8).reshape(*codes.shape[:-1], per_byte, d // per_byte)
    out = torch.zeros(parts.shape[:-2] + parts.shape[-1:], dtype=torch.uint8, device=codes.device)
    for j in range(per_byte):
        out |= parts[..., j, :] << (bits * j)
    return out


def unpack(packed: Tensor, bits: int) -> Tensor:
    """Inverse of :func:`pack`: uint8 ``[..., n]`` -> uint8 codes ``[..., n * 8 / bits]``."""
    per_byte = 8 // bits
    mask = (1 << bits) - 1
    parts = [(packed >> (bits * j)) & mask for j in range(per_byte)]
    return torch.cat(parts, dim=-1)


def _finite_or_raise(x: Tensor, what: str) -> None:
    if not torch.isfinite(x).all():
        raise ValueError(f"{what} contains NaN or Inf; quantization needs finite input")


def quantize(
    x: Tensor,
    *,
    bits: int = 2,
    group_size: int | None = None,
    clip_ratio: float = 0.0,
    meta_dtype: torch.dtype | str = torch.float16,
    check_finite: bool = True,
) -> QuantizedRows:
    """Quantize every row (last dim) of ``x`` with the normative uniform asymmetric format.

    Deterministic bit for bit on CPU and CUDA. ``x`` is not modified. Raises ``ValueError`` for NaN/Inf input
    (``check_finite=False`` skips that host sync in hot paths) or for a range the metadata dtype cannot hold.
    """
    g = _check_rows(x, bits, group_size)
    mdt = resolve_meta_dtype(meta_dtype)
    if check_finite:
        _finite_or_raise(x, "x")
    d = x.shape[-1]
    xf = clip_rows(x.to(torch.float32), clip_ratio)
    grouped = xf.reshape(*xf.shape[:-1], d // g, g)
    lo = grouped.amin(dim=-1)
    hi = grouped.amax(dim=-1)
    levels = (1 << bits) - 1
    # Divide by a tensor: torch on CUDA turns division by a Python scalar into a multiply by its reciprocal,
    # which is not the correctly rounded quotient the format prescribes (and differs from the CPU result).
    scale = (hi - lo) / torch.full_like(hi, float(levels))
    scale_s = scale.to(mdt)
    lo_s = lo.to(mdt)
    if check_finite and not (torch.isfinite(scale_s).all() and torch.isfinite(lo_s).all()):
        raise ValueError(
            f"a row's range does not fit the {mdt} metadata dtype (max |x| = {x.abs().max().item():.4g}); "
            "use meta_dtype='bfloat16' or 'float32'"
        )
    codes = _uniform_codes(grouped, lo_s, scale_s, levels)
    return QuantizedRows(
        packed=pack(codes.reshape(*xf.shape), bits), scale=scale_s, offset=lo_s, bits=bits, group_size=g, dim=d
    )


def _uniform_codes(grouped: Tensor, lo_s: Tensor, scale_s: Tensor, levels: int) -> Tensor:
    lo32 = lo_s.to(torch.float32).unsqueeze(-1)
    s32 = scale_s.to(torch.float32).unsqueeze(-1)
    zero = s32 == 0
    q = torch.floor((grouped - lo32) / torch.where(zero, torch.ones_like(s32), s32) + 0.5)
    q = q.clamp_(0, levels)
    return torch.where(zero, torch.zeros_like(q), q).to(torch.uint8)


def dequantize(q: QuantizedRows, dtype: torch.dtype = torch.float32) -> Tensor:
    """Reconstruct ``x^ = offset + code * scale`` (uniform) or ``mean + std * level[code]`` (Lloyd-Max)."""
    codes = unpack(q.packed, q.bits).to(torch.float32)
    grouped = codes.reshape(*codes.shape[:-1], q.dim // q.group_size, q.group_size)
    s = q.scale.to(torch.float32).unsqueeze(-1)
    o = q.offset.to(torch.float32).unsqueeze(-1)
    if q.kind == "lloyd-max":
        levels = torch.tensor(_LLOYD_MAX_LEVELS, dtype=torch.float32, device=codes.device)
        grouped = levels[grouped.long()]
    elif q.kind != "uniform":
        raise ValueError(f"unknown quantizer kind {q.kind!r}")
    return (o + grouped * s).reshape(codes.shape).to(dtype)


def fake_quantize(x: Tensor, **kwargs) -> Tensor:
    """``dequantize(quantize(x, **kwargs))`` in the dtype of ``x``: simulated quantization."""
    return dequantize(quantize(x, **kwargs), dtype=x.dtype)


# ------------------------------------------------------------------------------------------- Lloyd-Max
def quantize_lloyd_max(
    x: Tensor, *, group_size: int | None = None, clip_ratio: float = 0.0, meta_dtype: torch.dtype | str = torch.float16
) -> QuantizedRows:
    """2-bit non-uniform quantizer for Gaussian-like rows: offset = group mean, scale = group std (stored in
    the metadata dtype), codes = the Lloyd-Max bucket of ``(x - mean) / std``. Same packing as uniform."""
    g = _check_rows(x, 2, group_size)
    mdt = resolve_meta_dtype(meta_dtype)
    _finite_or_raise(x, "x")
    d = x.shape[-1]
    xf = clip_rows(x.to(torch.float32), clip_ratio)
    grouped = xf.reshape(*xf.shape[:-1], d // g, g)
    mean_s = grouped.mean(dim=-1).to(mdt)
    std_s = grouped.std(dim=-1, unbiased=False).to(mdt)
    z = (grouped - mean_s.float().unsqueeze(-1)) / torch.where(std_s == 0, 1.0, std_s.float()).unsqueeze(-1)
    codes = (z >= -_LLOYD_MAX_T).to(torch.uint8) + (z >= 0).to(torch.uint8) + (z >= _LLOYD_MAX_T).to(torch.uint8)
    codes = torch.where((std_s == 0).unsqueeze(-1), torch.ones_like(codes), codes)  # constant group: level ~0
    return QuantizedRows(
        packed=pack(codes.reshape(xf.shape), 2), scale=std_s, offset=mean_s, bits=2, group_size=g, dim=d,
        kind="lloyd-max",
    )


# --------------------------------------------------------------------------------- KIVI per-channel keys
def quantize_per_channel(
    x: Tensor, *, bits: int = 2, group_size: int = 32, meta_dtype: torch.dtype | str = torch.float16
) -> QuantizedRows:
    """KIVI keys: for ``x`` of shape ``[..., T, d]``, one scale/offset per channel per group of ``group_size``
    tokens. Returned rows are channels: ``packed`` is ``[..., d, T * bits / 8]``, ``scale`` ``[..., d, T / G]``.
    Dequantize with :func:`dequantize_per_channel`."""
    if x.ndim < 2:
        raise ValueError(f"per-channel quantization needs [..., tokens, dim], got shape {tuple(x.shape)}")
    return quantize(x.transpose(-1, -2), bits=bits, group_size=group_size, meta_dtype=meta_dtype)


def dequantize_per_channel(q: QuantizedRows, dtype: torch.dtype = torch.float32) -> Tensor:
    return dequantize(q, dtype).transpose(-1, -2)


__all__ = [
    "QuantizedRows",
    "check_clip_ratio",
    "clip_index",
    "clip_rows",
    "clip_rows_grid",
    "dequantize",
    "dequantize_per_channel",
    "fake_quantize",
    "pack",
    "quantize",
    "quantize_lloyd_max",
    "quantize_per_channel",
    "resolve_meta_dtype",
    "unpack",
]
