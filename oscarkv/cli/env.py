"""``oscarkv env``: versions, devices, cache location and which model/data packages are installed."""

from __future__ import annotations

import argparse
import importlib.metadata as md
import os
import platform


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON")


def _version(dist: str) -> str:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "not installed"


def collect() -> dict:
    import torch

    from oscarkv import __version__
    from oscarkv.models import MODELS, cache_dir, cached_path, package_dir

    from .setup import DATA_PACKAGES

    devices = [f"cpu ({os.cpu_count()} cores, {torch.get_num_threads()} torch threads)"]
    if torch.cuda.is_available():
        devices += [f"cuda:{i} {torch.cuda.get_device_name(i)}" for i in range(torch.cuda.device_count())]
    models = {}
    for name, src in MODELS.items():
        n_ok = sum(package_dir(mod) is not None for _, mod in src.packages)
        cached = (cached_path(name) / "oscarkv_cache.json").is_file()
        models[name] = f"{n_ok}/{len(src.packages)} packages" + (", float cache ready" if cached else "")
    return {
        "oscarkv": __version__,
        "python": platform.python_version(),
        **{d: _version(d) for d in ("torch", "transformers", "triton", "accelerate", "gguf", "safetensors")},
        "devices": devices,
        "cache_dir": str(cache_dir()),
        "models": models,
        "data": {req: ("installed" if package_dir(mod) else "missing") for req, mod in DATA_PACKAGES},
    }


def run(args: argparse.Namespace) -> int:
    info = collect()
    if args.json:
        import json

        print(json.dumps(info, indent=2))
        return 0
    for key, value in info.items():
        if isinstance(value, dict):
            print(f"{key}:")
            for k, v in value.items():
                print(f"  {k:22s} {v}")
        elif isinstance(value, list):
            print(f"{key:13s} " + "; ".join(value))
        else:
            print(f"{key:13s} {value}")
    partial = any(v.split("/")[0] != v.split("/")[1].split()[0] for v in info["models"].values())
    if partial or "missing" in info["data"].values():
        print("install missing packages with `oscarkv setup --models NAME[,NAME] --data`")
    return 0
