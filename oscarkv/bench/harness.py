"""The benchmark harness: provenance, a timer with a cold L2, and a correctness gate.

Every speed a benchmark reports goes through :func:`measure`, which first runs the candidate's ``verify``
callable (the kernel's output against its PyTorch reference, an engine's tokens against transformers, ...) and
refuses to time it when that fails: the row then carries ``{"error": "correctness: ..."}`` and no time, and
:attr:`Failures.any` makes the script exit non-zero.

    timer = Timer("cuda")
    failures = Failures()
    row["ours"] = measure(timer, fn, verify=lambda: check_close("decode", fn(), ref()), failures=failures)
"""

from __future__ import annotations

import platform
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

FLUSH_BYTES = 256 * 2**20  # larger than any current GPU's L2 (H200: 60 MiB)


class CorrectnessError(AssertionError):
    """A timed candidate's output does not match its reference within the stated budget."""


# ------------------------------------------------------------------------------------------- provenance
def _git(*args: str) -> str | None:
    repo = Path(__file__).resolve().parents[2]
    if not (repo / ".git").exists() or shutil.which("git") is None:
        return None
    out = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else None


def provenance(git_sha: str | None = None) -> dict:
    """Where a result comes from: GPU and driver, torch / CUDA / triton / Python versions, the git commit of
    this checkout (``git_sha`` overrides it, e.g. for a tree copied without ``.git``) and whether the tree had
    uncommitted changes, and the UTC time."""
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
            "platform": platform.platform(), "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["gpu_count"] = torch.cuda.device_count()
        if shutil.which("nvidia-smi"):
            smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm,memory.total",
                                  "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
            info["driver"] = smi.splitlines()[0].split(",")[0].strip() if smi else None
            info["nvidia_smi"] = smi.splitlines()[0] if smi else None
    else:
        info["gpu"] = None
    if git_sha:
        info["git_sha"], info["git_dirty"] = git_sha, None
    else:
        info["git_sha"] = _git("rev-parse", "HEAD") or "unknown"
        status = _git("status", "--porcelain", "--untracked-files=no")
        info["git_dirty"] = None if status is None else bool(status)
    return info


# ------------------------------------------------------------------------------------------------ timer
@dataclass(frozen=True)
class Timing:
    """Milliseconds per call over ``reps`` cold-L2 repetitions."""

    median_ms: float
    min_ms: float
    max_ms: float
    reps: int
    graph: bool

    def to_dict(self) -> dict:
        return asdict(self)


class Timer:
    """Times a callable with a cold L2: before every repetition a ``flush_bytes`` buffer is written, so the
    candidate reads its inputs from memory, not from a cache the previous repetition warmed. On CUDA each
    repetition is bracketed by CUDA events (optionally replaying a captured CUDA graph of ``fn``); on the CPU by
    ``time.perf_counter``. Reports the median."""

    def __init__(self, device: str | torch.device = "cuda", flush_bytes: int = FLUSH_BYTES):
        self.device = torch.device(device)
        self._flush = torch.empty(flush_bytes, dtype=torch.uint8, device=self.device)

    def __call__(self, fn: Callable[[], object], *, reps: int = 30, warmup: int = 1, graph: bool = False) -> Timing:
        if reps < 1:
            raise ValueError(f"reps must be >= 1, got {reps}")
        cuda = self.device.type == "cuda"
        for _ in range(warmup):
            fn()
        run = self._capture(fn) if graph and cuda else fn
        times = []
        for _ in range(reps):
            self._flush.zero_()
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                run()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                run()
                times.append((time.perf_counter() - t0) * 1e3)
        return Timing(statistics.median(times), min(times), max(times), reps, graph and cuda)

    @staticmethod
    def _capture(fn: Callable[[], object]) -> Callable[[], None]:
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        return g.replay


# ------------------------------------------------------------------------------------------ correctness
def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64 (inf when ``out`` holds NaN or Inf)."""
    if not bool(torch.isfinite(out).all()):
        return float("inf")
    o, r = out.double(), ref.double().to(out.device)
    return ((o - r).norm() / r.norm().clamp_min(1e-30)).item()


def check_close(name: str, out: torch.Tensor, ref: torch.Tensor, budget: float) -> float:
    """Raise :class:`CorrectnessError` unless ``rel_err(out, ref) <= budget``; returns the error."""
    if tuple(out.shape) != tuple(ref.shape):
        raise CorrectnessError(f"{name}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}")
    err = rel_err(out, ref)
    if not err <= budget:
        raise CorrectnessError(f"{name}: relative error {err:.3g} > budget {budget:.3g}")
    return err


def check_equal(name: str, out: torch.Tensor, ref: torch.Tensor) -> None:
    """Raise :class:`CorrectnessError` unless ``out`` equals ``ref`` bit for bit (integer outputs)."""
    if tuple(out.shape) != tuple(ref.shape) or out.dtype != ref.dtype:
        raise CorrectnessError(f"{name}: {out.dtype}{tuple(out.shape)} != reference {ref.dtype}{tuple(ref.shape)}")
    bad = int((out != ref.to(out.device)).sum())
    if bad:
        raise CorrectnessError(f"{name}: {bad} of {out.numel()} elements differ from the reference")


@dataclass
class Failures:
    """The candidates a run refused to time (or could not run), for the summary and the exit status."""

    items: list[str] = field(default_factory=list)

    @property
    def any(self) -> bool:
        return bool(self.items)

    def report(self) -> str:
        return "\n".join(["correctness or run failures (no speed reported for these):", *self.items])


def measure(timer: Timer, fn: Callable[[], object], *, verify: Callable[[], object], failures: Failures,
            name: str = "", reps: int = 30, graph: bool = False) -> dict:
    """``verify()`` first (it raises :class:`CorrectnessError` on a mismatch), then time ``fn``. Returns
    ``{"ms": median, "timing": {...}, "check": <verify's return value>}``, or ``{"error": ...}`` without a
    time when the check fails or either call raises (recorded in ``failures``)."""
    try:
        checked = verify()
    except CorrectnessError as e:
        failures.items.append(f"{name}: correctness: {e}")
        return {"error": f"correctness: {e}"}
    except Exception as e:  # noqa: BLE001 - a candidate that cannot run is recorded, the others go on
        failures.items.append(f"{name}: {type(e).__name__}: {e}")
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    try:
        t = timer(fn, reps=reps, graph=graph)
    except Exception as e:  # noqa: BLE001
        failures.items.append(f"{name}: timing: {type(e).__name__}: {e}")
        return {"error": f"timing: {type(e).__name__}: {str(e)[:300]}"}
    out = {"ms": t.median_ms, "timing": t.to_dict()}
    if checked is not None:
        out["check"] = checked
    return out


__all__ = ["CorrectnessError", "Failures", "Timer", "Timing", "check_close", "check_equal", "measure",
           "provenance", "rel_err"]
