"""Fail if a Python file of the package is longer than the limit (docs/style: small units, files under 600 lines).

    python scripts/check_sizes.py [--limit 600] [ROOT]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def oversized(root: Path, limit: int) -> list[tuple[Path, int]]:
    """``(file, lines)`` of every ``*.py`` under ``root`` with more than ``limit`` lines, longest first."""
    sizes = ((p, len(p.read_text(encoding="utf-8").splitlines())) for p in sorted(root.rglob("*.py")))
    return sorted(((p, n) for p, n in sizes if n > limit), key=lambda pn: -pn[1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", nargs="?", default=str(Path(__file__).resolve().parents[1] / "oscarkv"))
    ap.add_argument("--limit", type=int, default=600)
    args = ap.parse_args(argv)
    root = Path(args.root)
    if not root.is_dir():
        ap.error(f"{root} is not a folder")
    bad = oversized(root, args.limit)
    for path, n in bad:
        print(f"{path.relative_to(root.parent)}: {n} lines (limit {args.limit}): split it")
    if not bad:
        print(f"every Python file under {root.name}/ has at most {args.limit} lines")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
