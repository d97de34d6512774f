"""Resumable results: one JSONL file per (model, data, method, task, context length).

Layout: ``<out>/<model>/<data>/<method>/<task>_<context>.jsonl``. Each line is one finished unit of work (a
window, a NIAH trial) with a ``key`` and the ``run`` fingerprint it was computed under. A rerun with the same
fingerprint skips keys already present; a changed calibration or protocol changes the fingerprint, so stale
lines are ignored rather than mixed in. Lines are appended and flushed one at a time, so an interrupted run
loses at most the unit in flight.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, Iterator

_SAFE = re.compile(r"[^A-Za-z0-9._+-]+")


def safe_name(name: str) -> str:
    """A path component for ``name`` (model names, file paths used as data names)."""
    return _SAFE.sub("_", str(name)).strip("_") or "_"


def fingerprint(obj: Any) -> str:
    """Short stable hash of a JSON-serialisable description of a run's protocol."""
    blob = json.dumps(obj, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def calibration_tag(calibration: Any) -> str:
    """Stable short hash of a calibration's tensors and spec ("none" without one)."""
    if calibration is None:
        return "none"
    h = hashlib.sha256(json.dumps(calibration.spec.to_dict(), sort_keys=True).encode())
    for name in ("r_k", "r_v", "mu_k", "mu_v", "k_clip", "v_clip"):
        t = getattr(calibration, name, None)
        if t is not None:
            h.update(t.detach().float().contiguous().cpu().numpy().tobytes())
    formats = getattr(calibration, "layer_formats", None)
    if formats is not None:  # oscar-auto's per-layer formats (absent: the tag is unchanged)
        h.update(json.dumps(formats, sort_keys=True).encode())
    return h.hexdigest()[:16]


class ResultStore:
    """Append-only JSONL result files under ``root``."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def path(self, model: str, data: str, method: str, task: str, context: int | str) -> Path:
        return self.root / safe_name(model) / safe_name(data) / safe_name(method) / f"{safe_name(task)}_{context}.jsonl"

    def done(self, path: Path, run: str) -> set[str]:
        """Keys of units already finished in ``path`` under fingerprint ``run``."""
        return {r["key"] for r in read_jsonl(path) if r.get("run") == run and "key" in r}

    def append(self, path: Path, record: dict) -> None:
        if "key" not in record or "run" not in record:
            raise ValueError("a result record needs 'key' and 'run' fields")
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record, default=_json_default) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def records_for(self, model: str, data: str, method: str, task: str, context: int | str) -> list[dict]:
        """Records of one file (latest fingerprint)."""
        return latest_run(read_jsonl(self.path(model, data, method, task, context)))

    def records(self) -> Iterator[dict]:
        """Every record under the root (latest fingerprint per file wins; see :func:`latest_run`)."""
        for p in sorted(self.root.rglob("*.jsonl")):
            yield from latest_run(read_jsonl(p))


def read_jsonl(path: Path) -> list[dict]:
    """Records of a JSONL file; a torn last line (interrupted write) is skipped."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def latest_run(records: list[dict]) -> list[dict]:
    """Records of the fingerprint that appears last in the file (what the latest run wrote), de-duplicated by key."""
    if not records:
        return []
    run = records[-1].get("run")
    by_key: dict[str, dict] = {}
    for r in records:
        if r.get("run") == run:
            by_key[r.get("key", "")] = r
    return list(by_key.values())


def _json_default(o: Any) -> Any:
    if hasattr(o, "item"):
        return o.item()
    if hasattr(o, "tolist"):
        return o.tolist()
    return str(o)


__all__ = ["ResultStore", "calibration_tag", "fingerprint", "read_jsonl", "latest_run", "safe_name"]
