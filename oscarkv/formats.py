"""The storage format of one layer's quantized tier: :class:`LayerFormat` (keys and values, each a
:class:`TensorFormat`). One object carries a layer's format from the calibration artifact (``layer_formats`` in
``oscar.json``) through the method registry (:func:`oscarkv.methods.resolve`) to the cache and the kernels (the
cache builds each pool's :class:`~oscarkv.kernels.layout.PageFormat` from it plus the store's geometry,
:func:`oscarkv.cache.formats.page_formats`). Pure Python: importable everywhere.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

LAYOUTS = ("token", "channel")
ROTATIONS = ("calibrated", "hadamard", "none")
BITS = (2, 4)
_KEYS = ("layout", "bits", "rotation", "clip")


class FormatError(ValueError):
    """A format names a layout, width, rotation or clip the runtime does not implement."""


@dataclass(frozen=True)
class TensorFormat:
    """How one layer stores its keys or its values in the quantized tier.

    Attributes:
        layout: "token" (one quantized row per token and KV head: the method's format) or "channel" (keys only:
            one scale and offset per channel per page, over the page's tokens; numerically
            :func:`oscarkv.quant.quantize_per_channel` with ``group_size = page_size``; pages are written whole).
        bits: code width, 2 or 4.
        rotation: "calibrated" (the calibration's R of this layer), "hadamard" or "none".
        clip: per-row clip ratio of the token layout (0 = off; always 0 for "channel").
    """

    layout: str = "token"
    bits: int = 2
    rotation: str = "calibrated"
    clip: float = 0.0

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise FormatError(f"unknown format layout {self.layout!r}; valid: {list(LAYOUTS)}")
        if self.rotation not in ROTATIONS:
            raise FormatError(f"unknown format rotation {self.rotation!r}; valid: {list(ROTATIONS)}")
        if isinstance(self.bits, bool) or self.bits not in BITS:
            raise FormatError(f"format bits must be 2 or 4, got {self.bits!r}")
        if isinstance(self.clip, bool) or not isinstance(self.clip, (int, float)) or not 0.0 <= self.clip <= 1.0:
            raise FormatError(f"format clip must be a ratio in [0, 1], got {self.clip!r}")
        clip = 0.0 if float(self.clip) == 1.0 else float(self.clip)  # 1.0 keeps every value: no clipping
        if self.layout == "channel" and clip != 0.0:
            raise FormatError(f"the channel layout has no per-row clip; got clip {self.clip!r}")
        object.__setattr__(self, "clip", clip)

    @property
    def channel(self) -> bool:
        return self.layout == "channel"

    @property
    def label(self) -> str:
        """Short name, e.g. ``token2/calibrated@0.96`` or ``channel2/none``."""
        clip = f"@{self.clip:g}" if self.clip > 0.0 else ""
        return f"{self.layout}{self.bits}/{self.rotation}{clip}"

    def bits_per_element(self, head_dim: int, page_size: int, group_size: int | None = None,
                         meta_bits: int = 16) -> float:
        """Nominal bits per element: codes plus a scale and offset per row group (token) or per channel and
        page (channel)."""
        per = page_size if self.channel else (group_size or head_dim)
        return self.bits + 2 * meta_bits / per

    def to_dict(self) -> dict:
        return {"layout": self.layout, "bits": self.bits, "rotation": self.rotation, "clip": self.clip}

    @classmethod
    def from_dict(cls, data: Any) -> TensorFormat:
        if isinstance(data, TensorFormat):
            return data
        if not isinstance(data, Mapping):
            raise FormatError(f"a tensor format must be a mapping, got {type(data).__name__}")
        unknown = sorted(set(data) - set(_KEYS))
        if unknown:
            raise FormatError(f"unknown tensor-format key(s) {unknown}; valid: {', '.join(_KEYS)}")
        return cls(**data)


@dataclass(frozen=True)
class LayerFormat:
    """The quantized-tier format of one attention layer: keys ``k`` and values ``v`` (values are token rows).
    Unpacks as ``k, v = fmt``."""

    k: TensorFormat
    v: TensorFormat

    def __post_init__(self) -> None:
        if not isinstance(self.k, TensorFormat) or not isinstance(self.v, TensorFormat):
            raise FormatError(f"a layer format holds two TensorFormats, got {self.k!r} and {self.v!r}")
        if self.v.channel:
            raise FormatError(f"values are stored token-wise only, got layout {self.v.layout!r}")

    def __iter__(self) -> Iterator[TensorFormat]:
        return iter((self.k, self.v))

    def __getitem__(self, i: int) -> TensorFormat:
        return (self.k, self.v)[i]

    @property
    def label(self) -> str:
        return f"K {self.k.label}, V {self.v.label}"

    def bits_per_element(self, head_dim: int, page_size: int, group_size: int | None = None,
                         meta_bits: int = 16) -> float:
        """Nominal bits per element of K and V together (their mean)."""
        return sum(f.bits_per_element(head_dim, page_size, group_size, meta_bits) for f in self) / 2

    def to_dict(self) -> dict:
        return {"k": self.k.to_dict(), "v": self.v.to_dict()}

    @classmethod
    def from_entry(cls, entry: Any) -> LayerFormat:
        """From a ``layer_formats`` entry ``{"k": {...}, "v": {...}, ...}`` (other keys, e.g. the predicted
        errors of the selection, are informational and ignored)."""
        if isinstance(entry, LayerFormat):
            return entry
        if not isinstance(entry, Mapping) or "k" not in entry or "v" not in entry:
            raise FormatError(f"a layer format must be a mapping with 'k' and 'v' formats, got {entry!r}")
        return cls(TensorFormat.from_dict(entry["k"]), TensorFormat.from_dict(entry["v"]))


def describe_layers(layers: list[int], total: int) -> str:
    """``"all 30"``, ``"none of 30"`` or the layer indices as ranges (``"2, 5, 8-11 of 18"``)."""
    if len(layers) == total:
        return f"all {total}"
    if not layers:
        return f"none of {total}"
    runs, start = [], layers[0]
    for a, b in zip(layers, layers[1:] + [None]):
        if b != a + 1:
            runs.append(str(start) if start == a else f"{start}-{a}")
            start = b
    return f"{', '.join(runs)} of {total}"


__all__ = ["BITS", "LAYOUTS", "ROTATIONS", "FormatError", "LayerFormat", "TensorFormat", "describe_layers"]
