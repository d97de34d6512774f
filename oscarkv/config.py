"""Typed, frozen quantization configuration (``QuantSpec``) with validation and YAML/JSON I/O.

The spec travels with every calibration artifact (``oscar.json``); the CLI builds it from a file or flags.
Unknown keys are an error that lists the valid ones: a misspelt option must never be silently ignored.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Union

ClipSetting = Union[float, str]  # a ratio in (0, 1], 0.0 (off), or "fitted"

META_DTYPES = ("float16", "bfloat16", "float32")
QUANTIZERS = ("uniform", "lloyd-max")
# How the rotation is composed from the calibrated eigenvectors U, the Hadamard H and bit-reversal P.
COMPOSITIONS = ("uhp", "uh", "u", "h", "none")
GRANULARITIES = ("layer", "head")
# Covariance the key/value rotations diagonalise: the attention-aware targets of the method (C_Q, C_S)
# or the plain Gram matrices K^T K / V^T V (an ablation).
TARGETS = ("attention", "gram")
VALUE_WEIGHTINGS = ("quadratic", "softmax")

DEFAULT_K_CLIP = 0.96  # the reference code's hand-set ratios, used when fitting is off
DEFAULT_V_CLIP = 0.92
DEFAULT_CLIP_GRID = (1.0, 0.99, 0.98, 0.96, 0.94, 0.92, 0.90, 0.88, 0.85, 0.80)
# The default recipe of ``oscarkv calibrate`` (QuantSpec.default_recipe): per-layer formats at KIVI-2's nominal
# bits, a one-page sink and a one-page recent window (16-bit tiers of 128..191 tokens; KIVI-2's residual holds
# 128..159). The sink is one whole page because the vLLM plugin keeps 16-bit rows in whole vLLM blocks: a shorter
# sink would make the default artifact unservable there.
DEFAULT_RECIPE = {"sink": 64, "window": 64, "bit_budget": "kivi"}


class ConfigError(ValueError):
    """A configuration value or key is invalid; the message says which and what is allowed."""


@dataclass(frozen=True)
class QuantSpec:
    """How the KV cache is quantized. Defaults are the method's (``docs/method.md``).

    Attributes:
        bits: code width of the quantized tier, 2 or 4.
        group_size: elements per scale/offset group inside a row; ``None`` means the whole row (``G = d``).
        meta_dtype: dtype of the stored scale and offset ("float16", "bfloat16", "float32").
        k_clip, v_clip: per-row clip ratio (``0.0`` disables clipping) or ``"fitted"`` (per-layer grid search
            at calibration time; the artifact then stores the chosen ratios).
        clip_grid: candidate ratios for fitting; ``1.0`` means no clipping.
        sink: tokens at the start of every sequence kept in 16-bit.
        window: most recent tokens kept in 16-bit.
        page_size: tokens per page of the quantized tier; demotion moves whole pages.
        quantizer: "uniform" (the normative format) or "lloyd-max" (non-uniform levels, optional).
        composition: rotation built from the calibration: "uhp" (U @ H @ P, the method), "uh", "u",
            "h" (data-free Hadamard) or "none".
        granularity: one rotation per layer ("layer") or per layer and KV head ("head").
        target: "attention" (C_Q for keys, C_S for values) or "gram" (K^T K, V^T V).
        value_weighting: token weights of C_S: "quadratic" (k^T C_Q k, the reference) or "softmax"
            (sum of squared causal softmax scores, the paper's definition).
        centering: subtract calibrated per-head K/V means before quantizing (exact; see method section 2.8).
        bit_budget: ``None`` (one format for every layer, the default) or the mean bits per element under which
            calibration selects a format per layer and per K/V for ``oscar-auto`` (a number, or "kivi" for
            KIVI-2's nominal bits at the model's head_dim; docs/recipe.md).
    """

    bits: int = 2
    group_size: int | None = None
    meta_dtype: str = "float16"
    k_clip: ClipSetting = "fitted"
    v_clip: ClipSetting = "fitted"
    clip_grid: tuple[float, ...] = DEFAULT_CLIP_GRID
    sink: int = 64
    window: int = 256
    page_size: int = 64
    quantizer: str = "uniform"
    composition: str = "uhp"
    granularity: str = "layer"
    target: str = "attention"
    value_weighting: str = "quadratic"
    centering: bool = True
    bit_budget: float | str | None = None

    def __post_init__(self) -> None:
        if self.bits not in (2, 4):
            raise ConfigError(f"bits must be 2 or 4, got {self.bits!r}")
        if self.group_size is not None and (not isinstance(self.group_size, int) or self.group_size < 4):
            raise ConfigError(f"group_size must be None (whole row) or an int >= 4, got {self.group_size!r}")
        _check_choice("meta_dtype", self.meta_dtype, META_DTYPES)
        _check_choice("quantizer", self.quantizer, QUANTIZERS)
        _check_choice("composition", self.composition, COMPOSITIONS)
        _check_choice("granularity", self.granularity, GRANULARITIES)
        _check_choice("target", self.target, TARGETS)
        _check_choice("value_weighting", self.value_weighting, VALUE_WEIGHTINGS)
        for name in ("k_clip", "v_clip"):
            _check_clip(name, getattr(self, name))
        if not self.clip_grid or any(not (0.0 < float(r) <= 1.0) for r in self.clip_grid):
            raise ConfigError(f"clip_grid must be a non-empty list of ratios in (0, 1], got {self.clip_grid!r}")
        object.__setattr__(self, "clip_grid", tuple(float(r) for r in self.clip_grid))
        for name in ("sink", "window"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ConfigError(f"{name} must be an int >= 0, got {value!r}")
        if not isinstance(self.page_size, int) or self.page_size < 1:
            raise ConfigError(f"page_size must be an int >= 1, got {self.page_size!r}")
        if not isinstance(self.centering, bool):
            raise ConfigError(f"centering must be true or false, got {self.centering!r}")
        b = self.bit_budget
        if b is not None and b != "kivi" and (isinstance(b, bool) or not isinstance(b, (int, float)) or b <= 0):
            raise ConfigError(f"bit_budget must be null, 'kivi' or a number of bits per element > 0, got {b!r}")

    # ----------------------------------------------------------------------------------------- helpers
    @property
    def fitted_clip(self) -> bool:
        return self.k_clip == "fitted" or self.v_clip == "fitted"

    def group_for(self, head_dim: int) -> int:
        """The group size for rows of length ``head_dim``; raises if it does not divide the row."""
        g = head_dim if self.group_size is None else self.group_size
        if head_dim % g:
            raise ConfigError(f"group_size {g} does not divide head_dim {head_dim}")
        return g

    def bits_per_element(self, head_dim: int) -> float:
        """Nominal bits per element of the quantized tier (codes + scale + offset), windows excluded."""
        meta_bits = 32 if self.meta_dtype == "float32" else 16
        return self.bits + 2 * meta_bits / self.group_for(head_dim)

    @classmethod
    def default_recipe(cls) -> "QuantSpec":
        """The spec ``oscarkv calibrate`` uses without ``--config``: :data:`DEFAULT_RECIPE` over the defaults."""
        return cls(**DEFAULT_RECIPE)

    def replace(self, **changes: Any) -> "QuantSpec":
        unknown = sorted(set(changes) - set(valid_keys()))
        if unknown:
            raise ConfigError(f"unknown QuantSpec key(s) {unknown}; valid keys: {valid_keys()}")
        return dataclasses.replace(self, **changes)

    # ---------------------------------------------------------------------------------------------- I/O
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["clip_grid"] = list(self.clip_grid)
        if d["bit_budget"] is None:  # omitted when unset: artifacts (and their hashes) stay as before the key
            del d["bit_budget"]
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "QuantSpec":
        if not isinstance(data, Mapping):
            raise ConfigError(f"a QuantSpec must be a mapping of keys to values, got {type(data).__name__}")
        unknown = sorted(set(data) - set(valid_keys()))
        if unknown:
            raise ConfigError(f"unknown QuantSpec key(s) {unknown}; valid keys: {valid_keys()}")
        kwargs = dict(data)
        if "clip_grid" in kwargs and kwargs["clip_grid"] is not None:
            kwargs["clip_grid"] = tuple(kwargs["clip_grid"])
        return cls(**kwargs)

    @classmethod
    def load(cls, path: str | Path) -> "QuantSpec":
        """Load from ``.json``, ``.yaml`` or ``.yml``."""
        path = Path(path)
        text = path.read_text()
        if path.suffix.lower() in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text) or {}
        elif path.suffix.lower() == ".json":
            data = json.loads(text)
        else:
            raise ConfigError(f"{path}: a QuantSpec file must end in .json, .yaml or .yml")
        return cls.from_dict(data)

    def save(self, path: str | Path) -> None:
        path = Path(path)
        if path.suffix.lower() in (".yaml", ".yml"):
            import yaml

            path.write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))
        elif path.suffix.lower() == ".json":
            path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        else:
            raise ConfigError(f"{path}: a QuantSpec file must end in .json, .yaml or .yml")


def valid_keys() -> list[str]:
    return [f.name for f in dataclasses.fields(QuantSpec)]


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name} must be one of {list(choices)}, got {value!r}")


def _check_clip(name: str, value: Any) -> None:
    if value == "fitted":
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0.0 <= float(value) <= 1.0):
        raise ConfigError(f"{name} must be a ratio in [0, 1] (0 disables clipping) or 'fitted', got {value!r}")


def resolve_clip(setting: ClipSetting, default: float) -> float:
    """A fixed clip ratio for ``setting``: the number itself, or ``default`` where it says "fitted"."""
    return default if setting == "fitted" else float(setting)


__all__ = ["QuantSpec", "ConfigError", "valid_keys", "resolve_clip", "DEFAULT_K_CLIP", "DEFAULT_V_CLIP",
           "DEFAULT_RECIPE"]
