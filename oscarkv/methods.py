"""The method registry: every KV-cache method of the project by name, with what it stores and how.

All methods, OSCAR and the baselines of method section 6, run through one code path (:mod:`oscarkv.cache`,
:mod:`oscarkv.hf`); a method only decides the rotation, the clip ratios, the centering means, the code width,
the key layout and the three tiers (16-bit sink, 2-bit middle, 16-bit recent window).

==================== ======================================================================= ==================
name                 what is stored                                                           bits / element (*)
==================== ======================================================================= ==================
bf16                 everything in the 16-bit buffer (no quantization)                        16
oscar                calibrated R = U.H.P (layer or head, from the calibration), calibrated   2 + 32/G (2.5 at
                     clip, sink + recent window in 16-bit (spec: 64 + 256, pages of 64)       d=64, 2.25 at 128)
oscar-nowindow       oscar without windows: every token quantized on write                    2 + 32/G
oscar-hadamard       Hadamard instead of the calibrated rotation, windows, fixed clip          2 + 32/G
                     K 0.96 / V 0.92
oscar-noclip         oscar without clipping                                                   2 + 32/G
oscar-gram           oscar; requires a calibration with target "gram" (K^T K / V^T V)          2 + 32/G
oscar-auto           oscar's tiers; per-layer K and V formats selected by calibration under  mean of the
                     a bit budget (layer_formats: rotation, token rows or per-page channel   layers' formats
                     groups for keys, 2 or 4 bits, fitted clip; calibrate --bit-budget)      (<= budget)
naive-int2           per-(token, head) INT2, no rotation, no clip, no windows                 2 + 32/d
quarot-int2          Hadamard + per-token INT2, no clip, no windows                           2 + 32/d
kivi-2               keys per channel in groups of 32 tokens, values per token, no clip,      K 3, V 2 + 32/d
                     16-bit residual of the 128..159 most recent tokens, no sink              (2.75 at d=64)
int4-hadamard        Hadamard + per-token INT4, no clip, no windows                           4 + 32/d
==================== ======================================================================= ==================

(*) nominal, of the quantized tier, with 16-bit scale and offset; the 16-bit tiers come on top. Physical bytes
come from :meth:`oscarkv.hf.OscarCache.nbytes`.

Every name also exists with the suffix ``-nocenter`` (no mean subtraction; centering is on by default as
method section 2.8 says). Methods other than ``oscar-auto`` ignore a calibration's ``layer_formats``.
The oscar family takes bits, group size, metadata dtype, sink, window and page size
from the calibration's :class:`~oscarkv.config.QuantSpec`; the baselines use their published settings.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace

from torch import Tensor

from .artifact import Calibration
from .config import DEFAULT_K_CLIP, DEFAULT_V_CLIP, ConfigError
from .formats import LayerFormat, TensorFormat
from .rotation import hadamard

NOCENTER = "-nocenter"
KIVI_GROUP = 32  # tokens per per-channel key group (KIVI)
KIVI_RESIDUAL = 128  # KIVI's full-precision residual


@dataclass(frozen=True)
class Method:
    """What a named method stores.

    Attributes:
        name: registry name (with ``-nocenter`` where centering is off).
        quantized: False for the 16-bit reference.
        bits: code width of the quantized tier; ``None`` takes the calibration spec's.
        rotation: "calibrated" (the calibration's R_K / R_V), "hadamard" (data-free) or "none".
        clip: "calibrated" (per-layer ratios of the calibration), "fixed" (K 0.96 / V 0.92) or "none".
        windows: "calibrated" (spec sink / window, demotion by pages), "none" (every token quantized on write)
            or "kivi" (no sink, 128-token residual, demotion by groups of 32).
        key_layout: "token" (one row per token and head) or "channel" (KIVI keys: channel pages of 32 tokens).
        centering: subtract the calibrated per-head means before quantizing.
        target: the calibration target the method requires, or ``None`` for any.
        description: one line for listings.
    """

    name: str
    description: str
    quantized: bool = True
    bits: int | None = 2
    rotation: str = "none"
    clip: str = "none"
    windows: str = "none"
    key_layout: str = "token"
    centering: bool = True
    target: str | None = None
    per_layer: bool = False  # uses the calibration's per-layer formats (layer_formats)

    def bits_per_element(self, config_or_head_dim, spec=None) -> float:
        """Nominal bits per element of the quantized tier (K and V averaged; 16-bit tiers excluded).

        ``config_or_head_dim``: a transformers config or the head dimension. ``spec``: the calibration's
        QuantSpec for the oscar family (defaults to a default QuantSpec)."""
        d = _head_dim(config_or_head_dim)
        if not self.quantized:
            return 16.0
        if self.bits is None:
            from .config import QuantSpec

            spec = spec or QuantSpec()
            return spec.bits_per_element(d)
        token = self.bits + 32 / d
        if self.key_layout == "channel":
            return ((self.bits + 32 / KIVI_GROUP) + token) / 2
        return token


def _head_dim(config_or_head_dim) -> int:
    if isinstance(config_or_head_dim, int):
        return config_or_head_dim
    cfg = getattr(config_or_head_dim, "text_config", None) or config_or_head_dim
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


_OSCAR = dict(bits=None, rotation="calibrated", clip="calibrated", windows="calibrated")

METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method("bf16", "no quantization: K/V in the 16-bit buffer", quantized=False, bits=None, centering=False),
        Method("oscar", "calibrated rotation, clip, 16-bit sink + recent window", **_OSCAR),
        Method("oscar-nowindow", "oscar without 16-bit windows", **{**_OSCAR, "windows": "none"}),
        Method("oscar-hadamard", "Hadamard instead of U, windows, fixed clip", **{**_OSCAR, "rotation": "hadamard",
                                                                                  "clip": "fixed"}),
        Method("oscar-noclip", "oscar without clipping", **{**_OSCAR, "clip": "none"}),
        Method("oscar-gram", "oscar with K^T K / V^T V targets (gram calibration)", **_OSCAR, target="gram"),
        Method("oscar-auto", "oscar tiers with per-layer K/V formats selected under a bit budget (layer_formats)",
               **_OSCAR, per_layer=True),
        Method("naive-int2", "per-token INT2, no rotation, no clip, no windows"),
        Method("quarot-int2", "Hadamard + per-token INT2, no clip, no windows", rotation="hadamard"),
        Method("kivi-2", "KIVI: per-channel keys (32-token groups), per-token values, 128-token residual",
               windows="kivi", key_layout="channel"),
        Method("int4-hadamard", "Hadamard + per-token INT4, no clip, no windows", bits=4, rotation="hadamard"),
    )
}


def names() -> list[str]:
    """Every valid method name, including the ``-nocenter`` variants."""
    return [n for base in METHODS for n in (base, base + NOCENTER)]


def get(name: str) -> Method:
    """The method called ``name`` (``-nocenter`` suffix allowed); raises ``ConfigError`` listing valid names."""
    if isinstance(name, Method):
        return name
    base, centering = (name[: -len(NOCENTER)], False) if name.endswith(NOCENTER) else (name, True)
    if base not in METHODS:
        raise ConfigError(f"unknown method {name!r}; valid methods: {names()}")
    m = METHODS[base]
    return replace(m, name=name, centering=centering and m.centering)


# ----------------------------------------------------------------------------------------------- recipes
@dataclass(frozen=True)
class LayerRecipe:
    """One layer of a method: its :class:`~oscarkv.formats.LayerFormat` (``None``: the layer is not quantized)
    and the tensors (float32, CPU) the format's rotations and the method's centering need: rotations
    ``[Hkv, d, d]`` or ``None`` (identity), means ``[Hkv, d]`` or ``None`` (no centering)."""

    r_k: Tensor | None
    r_v: Tensor | None
    mu_k: Tensor | None
    mu_v: Tensor | None
    format: LayerFormat | None

    @property
    def k_clip(self) -> float:
        return self.format.k.clip if self.format is not None else 0.0

    @property
    def v_clip(self) -> float:
        return self.format.v.clip if self.format is not None else 0.0


@dataclass(frozen=True)
class Recipe:
    """Everything the cache needs to store a model's K/V under one method: per-layer formats and tensors, the
    tiers (16-bit sink and recent window, demotion ``unit``) and the page geometry shared by every layer."""

    method: Method
    quantized: bool
    group_size: int | None
    meta_dtype: str
    sink: int
    window: int
    unit: int  # demotion granularity in tokens (whole pages, or 1 = quantize on write)
    page_size: int
    layers: tuple[LayerRecipe, ...]

    @property
    def formats(self) -> tuple[LayerFormat | None, ...]:
        """Each layer's format (``None`` for a layer kept in 16-bit)."""
        return tuple(lr.format for lr in self.layers)

    @property
    def quantized_layers(self) -> list[int]:
        return [i for i, f in enumerate(self.formats) if f is not None]

    def bits_per_element(self, head_dim: int) -> float:
        """Nominal bits per element of the quantized tier, averaged over the quantized layers and K/V (16-bit
        tiers excluded; the per-row group is ``group_size`` or the whole row, channel pages one page)."""
        fmts = [f for f in self.formats if f is not None]
        if not fmts:
            return 16.0
        meta = 32 if self.meta_dtype == "float32" else 16
        return sum(f.bits_per_element(head_dim, self.page_size, self.group_size, meta) for f in fmts) / len(fmts)


def resolve(method: str | Method, calibration: Calibration) -> Recipe:
    """Turn a method name and a calibration into per-layer formats and tensors and tier sizes.

    Raises ``ConfigError`` for an unknown name or a calibration the method cannot use."""
    m = get(method) if isinstance(method, str) else method
    spec = calibration.spec
    if m.target is not None and spec.target != m.target:
        raise ConfigError(
            f"method {m.name!r} needs a calibration with target {m.target!r}, this one has {spec.target!r}; "
            f"run `oscarkv calibrate` with target: {m.target}"
        )
    if m.per_layer and calibration.layer_formats is None:
        raise ConfigError(f"method {m.name!r} needs a calibration with per-layer formats (layer_formats); run "
                          "`oscarkv calibrate --bit-budget BITS` (or `oscarkv calibrate --select-from DIR`)")
    if m.quantized and m.bits is None and spec.quantizer != "uniform":
        raise ConfigError(f"the cache implements the uniform quantizer only; calibration has {spec.quantizer!r}")
    if m.centering and m.quantized and _zero_means(calibration):
        warnings.warn(
            f"method {m.name!r} centers K/V but the calibration's means are all zero (identity calibration?): "
            "the result equals the -nocenter variant", stacklevel=2)
    layers = tuple(_layer_recipe(m, calibration, i) for i in range(calibration.model.num_layers))
    oscar = m.bits is None
    sink, window, unit = _tiers(m, spec)
    return Recipe(
        method=m, quantized=m.quantized, group_size=spec.group_size if oscar else None,
        meta_dtype=spec.meta_dtype if oscar else "float16", sink=sink, window=window, unit=unit,
        page_size=spec.page_size if oscar else (KIVI_GROUP if m.windows == "kivi" else 64), layers=layers,
    )


def _tiers(m: Method, spec) -> tuple[int, int, int]:
    if not m.quantized or m.windows == "none":
        return 0, 0, 1
    if m.windows == "kivi":  # KIVI's per-channel key groups are channel pages of KIVI_GROUP tokens
        return 0, KIVI_RESIDUAL, KIVI_GROUP
    return spec.sink, spec.window, spec.page_size


def _zero_means(c: Calibration) -> bool:
    return not (bool(c.mu_k.abs().sum() > 0) or bool(c.mu_v.abs().sum() > 0))


def layer_format(m: Method, c: Calibration, i: int) -> LayerFormat | None:
    """Layer ``i``'s format under method ``m``: the calibration's selection for per-layer methods, else the
    method's (code width, rotation, clip, key layout) with the calibration's clip ratios where it says so."""
    if not m.quantized or not c.model.full_attention[i]:  # sliding-window layers keep the model's own cache
        return None
    if m.per_layer:
        return c.formats(i)
    bits = c.spec.bits if m.bits is None else m.bits
    if m.clip == "calibrated":
        k_clip, v_clip = float(c.k_clip[i]), float(c.v_clip[i])
    elif m.clip == "fixed":
        k_clip, v_clip = DEFAULT_K_CLIP, DEFAULT_V_CLIP
    else:
        k_clip = v_clip = 0.0
    channel = m.key_layout == "channel"
    return LayerFormat(TensorFormat(m.key_layout, bits, m.rotation, 0.0 if channel else k_clip),
                       TensorFormat("token", bits, m.rotation, v_clip))


def _layer_recipe(m: Method, c: Calibration, i: int) -> LayerRecipe:
    """Layer ``i`` of method ``m``: its format and the rotation and mean tensors that format needs."""
    fmt = layer_format(m, c, i)
    if fmt is None:
        return LayerRecipe(None, None, None, None, None)
    t = c.layer(i)
    d, H = c.model.head_dim, c.model.num_kv_heads

    def rot(f: TensorFormat, calibrated: Tensor) -> Tensor | None:
        if f.rotation == "calibrated":
            return calibrated.float().clone()
        return hadamard(d).expand(H, d, d).clone() if f.rotation == "hadamard" else None

    mu_k = t["mu_k"].float().clone() if m.centering else None
    mu_v = t["mu_v"].float().clone() if m.centering else None
    return LayerRecipe(rot(fmt.k, t["r_k"]), rot(fmt.v, t["r_v"]), mu_k, mu_v, fmt)


def nominal_bits(method: str | Method, config_or_head_dim, calibration: Calibration | None = None) -> float:
    """Nominal bits per element of ``method``'s quantized tier; per-layer methods average their layers'
    formats (needs ``calibration``), the others give :meth:`Method.bits_per_element`."""
    m = get(method) if isinstance(method, str) else method
    d = _head_dim(config_or_head_dim)
    if m.per_layer and calibration is not None and calibration.layer_formats is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # resolve()'s warnings are about numerics, not the bit count
            return resolve(m, calibration).bits_per_element(d)
    return m.bits_per_element(d, calibration.spec if calibration is not None else None)


__all__ = [
    "KIVI_GROUP",
    "METHODS",
    "LayerRecipe",
    "Method",
    "Recipe",
    "get",
    "layer_format",
    "names",
    "nominal_bits",
    "resolve",
]
