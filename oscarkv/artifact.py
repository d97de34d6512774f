"""The calibration artifact: a folder with ``rotations.safetensors`` and ``oscar.json``.

``rotations.safetensors`` holds, per layer ``L`` (and per KV head where ``granularity == "head"``):

======== ===================== ===========================================================
name     shape                 meaning
======== ===================== ===========================================================
r_k      [L, d, d] | [L,H,d,d] key rotation (rows rotate as ``k @ r_k``), float32
r_v      same                  value rotation
eig_k    [L, d] | [L, H, d]    eigenvalues of the key target, descending (zeros if none)
eig_v    same                  eigenvalues of the value target
mu_k     [L, H, d]             mean post-RoPE key per KV head (unrotated basis), for centering
mu_v     [L, H, d]             mean value per KV head
k_clip   [L]                   clip ratio per layer for keys (0 = no clipping)
v_clip   [L]                   clip ratio per layer for values
======== ===================== ===========================================================

``oscar.json`` holds the format version, the :class:`~oscarkv.config.QuantSpec`, the model identity, the
calibration provenance and the sha256 and size of ``rotations.safetensors`` (``files``). :meth:`Calibration.load`
checks the file against that record, every value (finite, shapes, orthogonal rotations, clips, window) and,
given a model, the model identity; each failure is one ``ArtifactError`` line that names the file and the fault.
Artifacts saved before the ``files`` record existed still load, with a warning saying how to add the record
(their values are checked all the same).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .config import ConfigError, QuantSpec
from .formats import FormatError, LayerFormat, TensorFormat

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
LAYER_FORMATS_VERSION = 1  # schema of ``layer_formats`` entries (written next to them in oscar.json)
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3_text")
TENSOR_NAMES = ("r_k", "r_v", "eig_k", "eig_v", "mu_k", "mu_v", "k_clip", "v_clip")
TENSOR_FILE, META_FILE = "rotations.safetensors", "oscar.json"
META_KEYS = ("format", "format_version", "spec", "model", "provenance", "layer_formats", "layer_formats_version",
             "files")
ORTHOGONALITY_TOL_PER_DIM = 1e-6  # see orthogonality_tolerance
_IDENTITY_INTS = ("num_layers", "num_q_heads", "num_kv_heads", "head_dim", "hidden_size")


class ArtifactError(ValueError):
    """A calibration artifact is malformed or does not match the model it is used with."""


class UnsupportedModelError(ValueError):
    """The model's architecture is not one the library supports."""


@dataclass(frozen=True)
class ModelIdentity:
    """What a calibration must agree with: architecture and attention geometry (plus a free-form name)."""

    architecture: str
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    name: str = ""
    # per layer "full_attention" or another attention type (e.g. "sliding_attention") where the model mixes them;
    # None: every layer attends over the whole sequence (or an artifact written before this field)
    layer_types: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.layer_types is not None:
            types = tuple(self.layer_types)
            if len(types) != self.num_layers:
                raise ArtifactError(f"layer_types has {len(types)} entries for {self.num_layers} layers")
            object.__setattr__(self, "layer_types", types)

    @property
    def full_attention(self) -> list[bool]:
        """Per layer: True where the layer attends over the whole sequence (where OSCAR quantizes)."""
        if self.layer_types is None:
            return [True] * self.num_layers
        return [t == "full_attention" for t in self.layer_types]

    def to_dict(self) -> dict:
        d = asdict(self)
        if d["layer_types"] is None:  # omitted for full-attention models: their artifacts stay as before the key
            del d["layer_types"]
        else:
            d["layer_types"] = list(d["layer_types"])
        return d

    @classmethod
    def from_config(cls, config: Any, name: str = "") -> ModelIdentity:
        """Read the identity of a transformers config (or a config with a ``text_config``)."""
        cfg = getattr(config, "text_config", None) or config
        arch = getattr(cfg, "model_type", None)
        if arch == "gemma3":
            arch = "gemma3_text"
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"model type {arch!r} is not supported; oscarkv supports {list(SUPPORTED_ARCHITECTURES)} "
                "(full-attention decoder models of the Llama, Qwen2, Qwen3 and Gemma3 families)"
            )
        n_q = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_q
        types = getattr(cfg, "layer_types", None)
        types = tuple(types) if types is not None and any(t != "full_attention" for t in types) else None
        return cls(
            architecture=arch,
            num_layers=cfg.num_hidden_layers,
            num_q_heads=n_q,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or n_q,
            head_dim=head_dim,
            hidden_size=cfg.hidden_size,
            name=name or getattr(cfg, "_name_or_path", "") or "",
            layer_types=types,
        )

    def differences(self, other: ModelIdentity) -> list[str]:
        """Human-readable list of fields that differ (the free-form name is not compared)."""
        out = []
        for key in ("architecture", "num_layers", "num_q_heads", "num_kv_heads", "head_dim", "hidden_size"):
            a, b = getattr(self, key), getattr(other, key)
            if a != b:
                out.append(f"{key}: calibration has {a!r}, model has {b!r}")
        if self.layer_types is not None and other.layer_types is not None and self.layer_types != other.layer_types:
            out.append("layer_types: the calibration's attention type per layer differs from the model's")
        return out


def parse_layer_format(entry: Any, layer: int) -> LayerFormat:
    """The :class:`~oscarkv.formats.LayerFormat` of one ``layer_formats`` entry ``{"k": {...}, "v": {...}, ...}``
    (other keys, e.g. the predicted errors, are informational). Raises ``ArtifactError`` naming the layer."""
    try:
        return LayerFormat.from_entry(entry)
    except FormatError as e:
        raise ArtifactError(f"layer_formats[{layer}]: {e}") from None


@dataclass
class Calibration:
    """Per-layer rotations, means and clip ratios for one model, plus the spec and provenance."""

    spec: QuantSpec
    model: ModelIdentity
    r_k: Tensor
    r_v: Tensor
    eig_k: Tensor
    eig_v: Tensor
    mu_k: Tensor
    mu_v: Tensor
    k_clip: Tensor
    v_clip: Tensor
    provenance: dict = field(default_factory=dict)
    # Per-layer format choices where calibration selected them (see :class:`~oscarkv.formats.LayerFormat`,
    # :func:`parse_layer_format`): ``[{"k": {...}, "v": {...}, "k_error": e, "v_error": e}, ...]``; else None.
    layer_formats: list[dict] | None = None

    def __post_init__(self) -> None:
        self.validate_shapes()

    # ------------------------------------------------------------------------------------------ shapes
    @property
    def per_head(self) -> bool:
        return self.r_k.ndim == 4

    def validate_shapes(self) -> None:
        m = self.model
        L, H, d = m.num_layers, m.num_kv_heads, m.head_dim
        rot = (L, H, d, d) if self.spec.granularity == "head" else (L, d, d)
        eig = rot[:-1]
        expected = {
            "r_k": rot, "r_v": rot, "eig_k": eig, "eig_v": eig, "mu_k": (L, H, d), "mu_v": (L, H, d),
            "k_clip": (L,), "v_clip": (L,),
        }
        for name, shape in expected.items():
            t = getattr(self, name)
            if not isinstance(t, Tensor):
                raise ArtifactError(f"{name} must be a tensor, got {type(t).__name__}")
            if tuple(t.shape) != shape:
                raise ArtifactError(f"{name} has shape {tuple(t.shape)}, expected {shape} for {m}")
            if not torch.isfinite(t).all():
                raise ArtifactError(f"{name} contains NaN or Inf")
        if self.layer_formats is not None:
            if len(self.layer_formats) != L:
                raise ArtifactError(f"layer_formats has {len(self.layer_formats)} entries for {L} layers")
            for i, entry in enumerate(self.layer_formats):
                parse_layer_format(entry, i)

    def formats(self, i: int) -> LayerFormat | None:
        """Layer ``i``'s selected formats (``k, v = calib.formats(i)``), or ``None`` without ``layer_formats``."""
        return None if self.layer_formats is None else parse_layer_format(self.layer_formats[i], i)

    def check_orthogonal(self, atol: float | None = None) -> None:
        """Raise ``ArtifactError`` unless ``max |R^T R - I| <= atol`` for every rotation (default
        :func:`orthogonality_tolerance` of the head dim)."""
        atol = orthogonality_tolerance(self.model.head_dim) if atol is None else atol
        eye = torch.eye(self.model.head_dim, dtype=torch.float64)
        for name in ("r_k", "r_v"):
            r = getattr(self, name).to(torch.float64)
            errs = (r.transpose(-1, -2) @ r - eye).abs().amax(dim=(-2, -1))  # per layer (and head)
            err = float(errs.max())
            if not err <= atol:
                layer = int(errs.reshape(errs.shape[0], -1).amax(1).argmax())
                raise ArtifactError(f"{name} is not orthogonal: max |R^T R - I| = {err:.3g} (layer {layer}) exceeds "
                                    f"{atol:.3g} = {ORTHOGONALITY_TOL_PER_DIM:g} x head_dim")

    def validate(self) -> None:
        """The value checks of :meth:`load` and :meth:`save` beyond shapes and finiteness (``validate_shapes``):
        clip ratios in [0, 1] (0 and 1 both mean no clipping), orthogonal rotations, a recent window that is a
        whole number of pages. Raises ``ArtifactError``."""
        for name in ("k_clip", "v_clip"):
            t = getattr(self, name)
            bad = ((t < 0) | (t > 1)).nonzero().flatten()
            if len(bad):
                i = int(bad[0])
                raise ArtifactError(f"{name}[{i}] = {float(t[i]):g} is not a clip ratio in [0, 1]")
        self.check_orthogonal()
        s = self.spec
        if s.window % s.page_size:
            raise ArtifactError(f"the spec's window ({s.window} tokens) is not a multiple of its page_size "
                                f"({s.page_size}): the quantized tier moves whole pages")

    # ------------------------------------------------------------------------------------------ access
    def layer(self, i: int) -> dict[str, Tensor]:
        """Tensors of layer ``i``; rotations always come back as ``[Hkv, d, d]`` (broadcast where per layer)."""
        H = self.model.num_kv_heads
        out = {}
        for name in ("r_k", "r_v"):
            r = getattr(self, name)[i]
            out[name] = r if r.ndim == 3 else r.unsqueeze(0).expand(H, -1, -1)
        out["mu_k"], out["mu_v"] = self.mu_k[i], self.mu_v[i]
        out["k_clip"], out["v_clip"] = float(self.k_clip[i]), float(self.v_clip[i])
        return out

    def bits_per_element(self) -> float:
        return self.spec.bits_per_element(self.model.head_dim)

    # --------------------------------------------------------------------------------------------- I/O
    def save(self, path: str | Path) -> Path:
        """Write ``rotations.safetensors`` and ``oscar.json`` (with the tensor file's sha256 and size) into the
        folder ``path``, each through a temporary file renamed into place. Refuses a calibration that
        :meth:`validate` rejects."""
        from safetensors.torch import save_file

        self.validate()
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        tensors = {n: getattr(self, n).detach().to(torch.float32).contiguous().cpu() for n in TENSOR_NAMES}
        tmp = path / (TENSOR_FILE + ".tmp")
        save_file(tensors, str(tmp), metadata={"format_version": str(FORMAT_VERSION)})
        meta = {
            "format": "oscarkv-calibration",
            "format_version": FORMAT_VERSION,
            "spec": self.spec.to_dict(),
            "model": self.model.to_dict(),
            "provenance": self.provenance,
            "layer_formats": self.layer_formats,
            "files": {TENSOR_FILE: {"sha256": _sha256(tmp), "bytes": tmp.stat().st_size}},
        }
        if self.layer_formats is not None:
            meta["layer_formats_version"] = LAYER_FORMATS_VERSION
        meta_tmp = path / (META_FILE + ".tmp")
        meta_tmp.write_text(json.dumps(meta, indent=2, default=str) + "\n")
        os.replace(tmp, path / TENSOR_FILE)
        os.replace(meta_tmp, path / META_FILE)
        return path

    @classmethod
    def load(cls, path: str | Path, model: Any = None) -> Calibration:
        """Load an artifact folder; with ``model`` (a transformers model, config or :class:`ModelIdentity`)
        also check that it belongs to that model.

        Checks, each failing with one ``ArtifactError`` line: the folder and both files exist; ``oscar.json``
        parses, has no unknown keys and a known format version; the tensor file has the size and sha256
        recorded in ``oscar.json`` (an artifact saved before that record existed loads with a warning saying
        how to add it); the tensor file parses, holds exactly the expected float32 tensors of the shapes the spec
        and model identity imply, all finite; :meth:`validate` (clips, orthogonality, window)."""
        path = Path(path)
        meta_path, tensor_path = path / META_FILE, path / TENSOR_FILE
        if not path.is_dir():
            raise ArtifactError(f"{path} is not a calibration folder (run `oscarkv calibrate --out {path}` first)")
        for p in (meta_path, tensor_path):
            if not p.exists():
                raise ArtifactError(f"{path} is missing {p.name}; it is not a complete oscarkv calibration")
        meta = _read_meta(meta_path)
        _verify_files(path, meta)
        tensors = _read_tensors(tensor_path)
        where = f"{meta_path}:"
        try:
            spec = QuantSpec.from_dict(meta["spec"])
        except (ConfigError, TypeError, ValueError) as e:
            raise ArtifactError(f"{where} spec: {e}") from None
        provenance = meta.get("provenance", {})
        if not isinstance(provenance, dict):
            raise ArtifactError(f"{where} provenance must be a mapping, got {type(provenance).__name__}")
        layer_formats = meta.get("layer_formats")
        if layer_formats is not None and not isinstance(layer_formats, list):
            raise ArtifactError(f"{where} layer_formats must be a list or null, got {type(layer_formats).__name__}")
        try:
            calib = cls(spec=spec, model=_identity(meta["model"], where), provenance=provenance,
                        layer_formats=layer_formats, **tensors)
            calib.validate()
        except ArtifactError as e:
            raise ArtifactError(f"{path}: {e}") from None
        if model is not None:
            calib.check_model(model)
        return calib

    def check_model(self, model: Any) -> None:
        """Raise ``ArtifactError`` naming every difference between this calibration and ``model``."""
        other = model if isinstance(model, ModelIdentity) else ModelIdentity.from_config(
            getattr(model, "config", model))
        diffs = self.model.differences(other)
        if diffs:
            raise ArtifactError(
                f"calibration for {self.model.name or self.model.architecture!r} does not match this model "
                f"({other.name or other.architecture!r}): " + "; ".join(diffs)
                + ". Calibrate this model with `oscarkv calibrate`."
            )

    # ------------------------------------------------------------------------------------ constructors
    @classmethod
    def identity(cls, model: ModelIdentity, spec: QuantSpec | None = None, clip: float = 0.0) -> Calibration:
        """Identity rotations, zero means, fixed clip: for tests and for data-free baselines."""
        spec = spec or QuantSpec(k_clip=clip, v_clip=clip, centering=False, composition="none")
        L, H, d = model.num_layers, model.num_kv_heads, model.head_dim
        shape = (L, H, d, d) if spec.granularity == "head" else (L, d, d)
        eye = torch.eye(d).expand(shape).clone()
        return cls(
            spec=spec, model=model, r_k=eye, r_v=eye.clone(), eig_k=torch.zeros(shape[:-1]),
            eig_v=torch.zeros(shape[:-1]), mu_k=torch.zeros(L, H, d), mu_v=torch.zeros(L, H, d),
            k_clip=torch.full((L,), float(clip)), v_clip=torch.full((L,), float(clip)),
            provenance={"kind": "identity"},
        )

    @classmethod
    def from_rotation_zoo(
        cls, k_path: str | Path, v_path: str | Path, model: Any, spec: QuantSpec | None = None
    ) -> Calibration:
        """Import reference RotationZoo ``.pt`` files (``{"layers": {i: {"rotation", "eigenvalues"}}}``) for
        keys and values. Loaded with ``weights_only=True``; means are zero (the reference does not center)."""
        ident = model if isinstance(model, ModelIdentity) else ModelIdentity.from_config(
            getattr(model, "config", model))
        spec = spec or QuantSpec(k_clip=0.96, v_clip=0.92, centering=False)
        r = {}
        for which, p in (("k", k_path), ("v", v_path)):
            blob = torch.load(str(p), map_location="cpu", weights_only=True)
            if not isinstance(blob, Mapping) or "layers" not in blob:
                raise ArtifactError(f"{p} is not a RotationZoo file: expected a dict with a 'layers' entry")
            layers = blob["layers"]
            rots, eigs = [], []
            for i in range(ident.num_layers):
                entry = layers.get(i, layers.get(str(i))) if isinstance(layers, Mapping) else layers[i]
                if entry is None:
                    raise ArtifactError(f"{p} has no entry for layer {i} (model has {ident.num_layers} layers)")
                rots.append(torch.as_tensor(entry["rotation"], dtype=torch.float32))
                eigs.append(torch.as_tensor(entry.get("eigenvalues", torch.zeros(ident.head_dim)), dtype=torch.float32))
            r[which] = (torch.stack(rots), torch.stack(eigs))
        L, H, d = ident.num_layers, ident.num_kv_heads, ident.head_dim
        return cls(
            spec=spec.replace(granularity="layer"), model=ident, r_k=r["k"][0], r_v=r["v"][0], eig_k=r["k"][1],
            eig_v=r["v"][1], mu_k=torch.zeros(L, H, d), mu_v=torch.zeros(L, H, d),
            k_clip=torch.full((L,), 0.96), v_clip=torch.full((L,), 0.92),
            provenance={"imported_from": [str(k_path), str(v_path)], "kind": "rotation_zoo"},
        )



def orthogonality_tolerance(head_dim: int) -> float:
    """Largest ``max |R^T R - I|`` accepted for a stored rotation: ``ORTHOGONALITY_TOL_PER_DIM * head_dim``. The
    rotations are built in float64 and stored in float32 (measured ``~4e-8`` at ``d = 64``); float32 rounding
    of ``R^T R`` grows with ``d``; the bound is far above both and far below any real damage (``O(1)``)."""
    return ORTHOGONALITY_TOL_PER_DIM * head_dim


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _read_meta(meta_path: Path) -> dict:
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ArtifactError(f"{meta_path} is not UTF-8 text ({e.reason} at byte {e.start}); the file is damaged, "
                            "restore it or re-run `oscarkv calibrate`") from None
    except json.JSONDecodeError as e:
        raise ArtifactError(f"{meta_path} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}); the "
                            "file is damaged, restore it or re-run `oscarkv calibrate`") from None
    if not isinstance(meta, dict):
        raise ArtifactError(f"{meta_path} must hold a JSON object, got {type(meta).__name__}")
    if meta.get("format") != "oscarkv-calibration":
        raise ArtifactError(f"{meta_path} is not an oscarkv calibration (format={meta.get('format')!r})")
    version = meta.get("format_version")
    if version != FORMAT_VERSION:
        raise ArtifactError(f"{meta_path} has format version {version!r}; this oscarkv reads version "
                            f"{FORMAT_VERSION}. Re-run `oscarkv calibrate` with this version.")
    unknown = sorted(set(meta) - set(META_KEYS))
    if unknown:
        raise ArtifactError(f"{meta_path} has unknown key(s) {unknown}; valid: {sorted(META_KEYS)}")
    for key in ("spec", "model"):
        if key not in meta:
            raise ArtifactError(f"{meta_path} lacks the {key!r} entry")
    lf_version = meta.get("layer_formats_version", LAYER_FORMATS_VERSION)
    if meta.get("layer_formats") is not None and lf_version != LAYER_FORMATS_VERSION:
        raise ArtifactError(f"{meta_path} has layer_formats version {lf_version!r}; this oscarkv reads version "
                            f"{LAYER_FORMATS_VERSION}. Re-run `oscarkv calibrate --bit-budget ...`.")
    return meta


def _verify_files(path: Path, meta: dict) -> None:
    """Compare the tensor file with the size and sha256 recorded at save time."""
    files = meta.get("files")
    if files is None:
        log.warning("%s was saved without a sha256 record of %s, so its integrity cannot be checked (the values "
                    "are still checked); add one with: python -c \"from oscarkv.artifact import Calibration as C; "
                    "C.load('%s').save('%s')\"", path, TENSOR_FILE, path, path)
        return
    record = files.get(TENSOR_FILE) if isinstance(files, dict) else None
    if (not isinstance(files, dict) or set(files) != {TENSOR_FILE} or not isinstance(record, dict)
            or set(record) != {"sha256", "bytes"} or not isinstance(record["sha256"], str)
            or type(record["bytes"]) is not int):
        raise ArtifactError(f"{path / META_FILE}: 'files' must be {{{TENSOR_FILE!r}: {{'sha256': hex, 'bytes': "
                            f"int}}}}, got {files!r}")
    tensor_path = path / TENSOR_FILE
    size = tensor_path.stat().st_size
    if size != record["bytes"]:
        raise ArtifactError(f"{tensor_path} has {size} bytes but {META_FILE} records {record['bytes']}: the file is "
                            "truncated or was changed after saving; restore it or re-run `oscarkv calibrate`")
    digest = _sha256(tensor_path)
    if digest != record["sha256"].lower():
        raise ArtifactError(f"{tensor_path} does not match the sha256 recorded in {META_FILE} ({digest[:12]}... "
                            f"vs {record['sha256'][:12]}...): the file is damaged or was changed after saving; "
                            "restore it or re-run `oscarkv calibrate`")


def _read_tensors(tensor_path: Path) -> dict[str, Tensor]:
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(tensor_path))
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error type for every malformation
        msg = " ".join(str(e).split())[:200]
        raise ArtifactError(f"{tensor_path} cannot be read as safetensors ({msg}); the file is damaged, restore it "
                            "or re-run `oscarkv calibrate`") from None
    missing = [n for n in TENSOR_NAMES if n not in tensors]
    if missing:
        raise ArtifactError(f"{tensor_path} lacks tensors {missing}")
    unknown = sorted(set(tensors) - set(TENSOR_NAMES))
    if unknown:
        raise ArtifactError(f"{tensor_path} has unknown tensors {unknown}; valid: {list(TENSOR_NAMES)}")
    for name, t in tensors.items():
        if t.dtype != torch.float32:
            raise ArtifactError(f"{tensor_path}: tensor {name} is {t.dtype}; artifacts store float32")
    return tensors


def _identity(data: Any, where: str) -> ModelIdentity:
    if not isinstance(data, dict):
        raise ArtifactError(f"{where} model must be a mapping, got {type(data).__name__}")
    fields = [f.name for f in dataclasses.fields(ModelIdentity)]
    required = ("architecture", *_IDENTITY_INTS)
    unknown, missing = sorted(set(data) - set(fields)), [f for f in required if f not in data]
    if unknown or missing:
        raise ArtifactError(f"{where} model has unknown key(s) {unknown} / lacks {missing}; valid: {fields}")
    for key in _IDENTITY_INTS:
        if type(data[key]) is not int or data[key] < 1:
            raise ArtifactError(f"{where} model.{key} must be an int >= 1, got {data[key]!r}")
    if not isinstance(data["architecture"], str) or not isinstance(data.get("name", ""), str):
        raise ArtifactError(f"{where} model.architecture and model.name must be strings")
    try:
        return ModelIdentity(**data)
    except (TypeError, ValueError) as e:  # the identity's own checks (ArtifactError is a ValueError)
        raise ArtifactError(f"{where} model: {e}") from None


__all__ = [
    "FORMAT_VERSION",
    "LAYER_FORMATS_VERSION",
    "ArtifactError",
    "Calibration",
    "LayerFormat",
    "ModelIdentity",
    "TensorFormat",
    "UnsupportedModelError",
    "orthogonality_tolerance",
    "parse_layer_format",
]
