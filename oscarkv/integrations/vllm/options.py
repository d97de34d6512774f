"""The ``"oscar"`` section of vLLM's ``--additional-config`` and its validation against the served model.

Everything here is plain Python (no vLLM import), so it is unit-tested without starting an engine::

    --additional-config '{"oscar": {"calibration": "/path/to/artifact"}}'

Keys (unknown keys are an error):

* ``calibration`` (str): an artifact folder written by ``oscarkv calibrate`` for the served model. Required for
  every method but ``bf16``.
* ``method`` (str, default ``"oscar"``): a method of :mod:`oscarkv.methods`, resolved exactly as the transformers
  integration resolves it: ``oscar`` (16-bit sink + recent window, 2-bit middle), ``oscar-auto`` (the
  artifact's per-layer formats: token or channel keys, 2 or 4 bits, per layer and per K/V),
  ``oscar-nowindow`` (every token quantized on write), ``oscar-hadamard``, ``oscar-noclip``, ``naive-int2``,
  ``quarot-int2``, ``int4-hadamard``, their ``-nocenter`` variants, or ``bf16`` (K/V kept in vLLM's own 16-bit
  pages through this backend: a diagnostic whose tokens must equal vLLM's built-in backend).
* ``max_seqs`` (int): sequences that can hold 16-bit windows at once (default: vLLM's ``max_num_seqs``).
* ``decode_graphs`` (bool, default true): on CUDA, replay each layer's decode-only attention step from a CUDA
  graph captured per padded batch size (:mod:`.graphs`), so an eager vLLM step does not pay ~25 kernel launches
  of host work per layer; false runs them eagerly.
* ``monitor_every`` (int >= 0, default 64): sample a layer's page writes on its first eager attention call and
  every n-th after it for the quantization monitors in vLLM's Prometheus metrics (:mod:`.monitor`); 0 turns
  sampling off (the other figures stay).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PINNED_VLLM = "0.26.0"
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")
SUPPORTED_HEAD_SIZES = (64, 128, 256)
SUPPORTED_DTYPES = ("float16", "bfloat16", "float32")
_KEYS = ("calibration", "method", "max_seqs", "decode_graphs", "monitor_every")


class OscarVllmError(ValueError):
    """The vLLM plugin cannot serve this model with this configuration; the message says what to change."""


@dataclass(frozen=True)
class OscarOptions:
    """Parsed ``additional_config["oscar"]``."""

    calibration: str | None = None
    method: str = "oscar"
    max_seqs: int | None = None
    decode_graphs: bool = True
    monitor_every: int = 64

    @classmethod
    def from_additional_config(cls, additional: Mapping[str, Any] | None) -> OscarOptions | None:
        """``None`` when there is no ``"oscar"`` section; raises :class:`OscarVllmError` on bad keys/values."""
        if not additional or "oscar" not in additional:
            return None
        raw = additional["oscar"]
        if not isinstance(raw, Mapping):
            raise OscarVllmError(f'additional_config["oscar"] must be a JSON object, got {type(raw).__name__}')
        unknown = sorted(set(raw) - set(_KEYS))
        if unknown:
            raise OscarVllmError(f'unknown key(s) {unknown} in additional_config["oscar"]; valid keys: {list(_KEYS)}')
        opts = cls(**dict(raw))
        opts._validate()
        return opts

    def _validate(self) -> None:
        from ... import methods

        if self.method not in methods.names():
            raise OscarVllmError(f"unknown oscar.method {self.method!r}; valid: {methods.names()}")
        m = methods.get(self.method)
        if m.windows == "kivi":
            raise OscarVllmError(f"method {self.method!r} keeps a residual window without a sink, which the vLLM "
                                 "backend does not implement; use 'oscar' or 'oscar-auto'")
        v = self.max_seqs
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise OscarVllmError(f"oscar.max_seqs must be an int >= 1, got {v!r}")
        e = self.monitor_every
        if isinstance(e, bool) or not isinstance(e, int) or e < 0:
            raise OscarVllmError(f"oscar.monitor_every must be an int >= 0 (0: no sampling), got {e!r}")
        if not isinstance(self.decode_graphs, bool):
            raise OscarVllmError(f"oscar.decode_graphs must be true or false, got {self.decode_graphs!r}")
        if self.calibration is not None and not isinstance(self.calibration, str):
            raise OscarVllmError(f"oscar.calibration must be a folder path, got {self.calibration!r}")
        if m.quantized and not self.calibration:
            raise OscarVllmError(
                'oscar.calibration is required: --additional-config \'{"oscar": {"calibration": "DIR"}}\' '
                "with DIR written by `oscarkv calibrate` for this model"
            )
        if self.calibration and not Path(self.calibration).is_dir():
            raise OscarVllmError(f"oscar.calibration {self.calibration!r} is not a folder")


@dataclass(frozen=True)
class ServedModel:
    """What the plugin needs to know about the served model (read from vLLM's config)."""

    architecture: str
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    dtype: str
    sliding_window: int | None = None

    def identity(self):
        from ...artifact import ModelIdentity

        return ModelIdentity(self.architecture, self.num_layers, self.num_q_heads, self.num_kv_heads,
                             self.head_dim, self.hidden_size)


def check_model(model: ServedModel) -> None:
    """Refuse models the plugin cannot serve, with what to do instead."""
    if model.architecture not in SUPPORTED_ARCHITECTURES:
        raise OscarVllmError(
            f"model type {model.architecture!r} is not supported by the OSCAR vLLM backend; supported: "
            f"{list(SUPPORTED_ARCHITECTURES)} (full-attention decoders). Serve it without the oscar config."
        )
    if model.head_dim not in SUPPORTED_HEAD_SIZES:
        raise OscarVllmError(
            f"head size {model.head_dim} is not supported by the OSCAR vLLM backend; supported: "
            f"{list(SUPPORTED_HEAD_SIZES)}"
        )
    if model.dtype not in SUPPORTED_DTYPES:
        raise OscarVllmError(f"model dtype {model.dtype} is not supported; use one of {list(SUPPORTED_DTYPES)}")
    if model.sliding_window is not None:
        raise OscarVllmError("sliding-window attention is not supported by the OSCAR vLLM backend")


def load_calibration(opts: OscarOptions, model: ServedModel):
    """The artifact named by ``opts`` checked against ``model`` (an identity calibration when none is given)."""
    from ...artifact import ArtifactError, Calibration

    check_model(model)
    if not opts.calibration:
        return Calibration.identity(model.identity())
    try:
        calib = Calibration.load(opts.calibration, model=model.identity())
    except ArtifactError as e:
        raise OscarVllmError(f"OSCAR calibration {opts.calibration!r} cannot serve this model: {e}") from e
    return calib


def resolve_recipe(opts: OscarOptions, calib):
    """The method's :class:`~oscarkv.methods.Recipe` (as the transformers integration resolves it)."""
    from ... import methods
    from ...config import ConfigError

    try:
        return methods.resolve(opts.method, calib)
    except ConfigError as e:
        raise OscarVllmError(f"oscar.method {opts.method!r} cannot use this calibration: {e}") from e


def serving_policy(recipe):
    """The tier rule the backend serves ``recipe`` with: the store's (:func:`oscarkv.cache.policy_for`); without
    quantization (method ``bf16``) none, for the backend then reads vLLM's own 16-bit pages (no window ring)."""
    from ...cache import TierPolicy, policy_for

    return policy_for(recipe) if recipe.quantized else TierPolicy(0, 0, 1)


def windows_of(policy) -> tuple[int, int]:
    """``(ring, rows16)`` of a :class:`~oscarkv.cache.TierPolicy` in the backend: the recent window lives in a
    ring of ``window + unit`` rows after ``sink`` rows per sequence; ``(0, 0)`` when every token is quantized."""
    if not policy.windows:
        return 0, 0
    return policy.ring, policy.sink + policy.ring


def check_served(recipe, policy, block_size: int, num_slots: int, max_num_seqs: int) -> None:
    """Refuse, with one line saying what to change, what the backend cannot serve: a block size that does not
    tile the sink and the demotion unit, and channel-page keys without the 16-bit windows, in blocks other than
    the artifact's pages, or with fewer window slots than sequences (their pages are written when complete, from
    the 16-bit rows)."""
    if policy.windows:
        for name, v in (("sink", policy.sink), ("page_size", policy.unit)):
            if v % block_size:
                raise OscarVllmError(
                    f"the OSCAR {name} ({v}) must be a multiple of vLLM's block size ({block_size}); "
                    f"start vLLM with block_size={policy.unit} (--block-size {policy.unit})")
    channel = [i for i, f in enumerate(recipe.formats) if f is not None and f.k.channel]
    if not channel:
        return
    where = f"layers {channel[:8]}{' ...' if len(channel) > 8 else ''} store keys in channel pages"
    if not policy.windows:
        raise OscarVllmError(f"{where}, which need the 16-bit windows: use a method with a sink and a window")
    if block_size != recipe.page_size:
        raise OscarVllmError(f"{where} of {recipe.page_size} tokens: start vLLM with --block-size "
                             f"{recipe.page_size} (got {block_size})")
    if num_slots < max_num_seqs:
        raise OscarVllmError(f"{where}: every sequence needs its 16-bit window slot; drop oscar.max_seqs "
                             f"({num_slots}) or raise it to max_num_seqs ({max_num_seqs})")


__all__ = [
    "PINNED_VLLM",
    "SUPPORTED_ARCHITECTURES",
    "SUPPORTED_HEAD_SIZES",
    "OscarOptions",
    "OscarVllmError",
    "ServedModel",
    "check_model",
    "check_served",
    "load_calibration",
    "resolve_recipe",
    "serving_policy",
    "windows_of",
]
