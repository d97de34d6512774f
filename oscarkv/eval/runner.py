"""One entry point for every task: :func:`evaluate` runs the requested tasks, resumably, then writes the report."""

from __future__ import annotations

import json
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from .fidelity import run_fidelity
from .greedy import run_greedy
from .lm import run_lm
from .longgen import run_longgen
from .niah import Variant, run_niah
from .report import write_report
from .context import EvalContext

TASKS = ("kld", "ppl", "code", "niah", "greedy", "fidelity", "longgen")
MAIN_METHODS = ("bf16", "naive-int2", "quarot-int2", "kivi-2", "int4-hadamard", "oscar", "oscar-auto")
LM_PATHS = ("auto", "simulate", "cache")


@dataclass
class Plan:
    """What to run. ``windows``: teacher-forced windows per context length (kld/ppl/code/fidelity);
    ``niah_*``: NIAH grid (lengths default to ``contexts``); ``greedy_*``: prompts and continuation length;
    ``longgen_*``: prompts, their length (default: the first context) and generated tokens.
    ``path``: how the teacher-forced tasks (kld, ppl, code, longgen) run a method: ``simulate``, ``cache``
    (chunked prefill through the real cache: the kernels on CUDA) or ``auto`` (``cache`` on CUDA, else
    ``simulate``). ``prefill_chunk``: tokens per chunk of every chunked prefill; ``batch``: windows, NIAH
    samples or prompts per cache batch; ``bucket``: positions per bucket of the curves. ``deadline``: a
    ``time.monotonic()`` value after which no task starts a new unit."""

    methods: list[str]
    tasks: list[str]
    contexts: list[int]
    windows: int = 4
    niah_lengths: list[int] | None = None
    niah_depths: list[float] = field(default_factory=lambda: [0.1, 0.5, 0.9])
    niah_variants: list[str] = field(default_factory=lambda: ["single-number-essay", "multikey-word-noise"])
    niah_samples: int = 1
    greedy_prompts: int = 4
    greedy_tokens: int = 32
    greedy_mode: str = "teacher"
    prefill_chunk: int = 256
    fidelity_positions: int = 256
    path: str = "auto"
    batch: int = 1
    bucket: int = 1024
    longgen_prompts: int = 4
    longgen_tokens: int = 2048
    longgen_context: int | None = None
    simulate_chunk: int = 1
    deadline: float | None = None

    def __post_init__(self) -> None:
        bad = sorted(set(self.tasks) - set(TASKS))
        if bad:
            raise ValueError(f"unknown task(s) {bad}; tasks are {list(TASKS)}")
        if not self.methods:
            raise ValueError("no methods to evaluate")
        if not self.contexts or any(c < 2 for c in self.contexts):
            raise ValueError(f"context lengths must be >= 2, got {self.contexts}")
        for v in self.niah_variants:
            Variant.parse(v)
        if self.path not in LM_PATHS:
            raise ValueError(f"path must be one of {list(LM_PATHS)}, got {self.path!r}")
        for name in ("prefill_chunk", "batch", "bucket", "longgen_prompts", "longgen_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    def lm_path(self, device: str) -> str:
        """The teacher-forced path on ``device`` ("cpu", "cuda")."""
        return ("cache" if device == "cuda" else "simulate") if self.path == "auto" else self.path


def evaluate(s: EvalContext, plan: Plan, *, report: bool = True) -> dict:
    """Run ``plan`` in the order cheap-to-expensive; every finished unit is in the store as soon as it ends."""
    _write_methods_info(s, plan.methods)
    counts: dict[str, int] = {}
    path = plan.lm_path(s.numerics.get("device", "cpu"))
    if {"kld", "ppl", "code"} & set(plan.tasks):
        for c in plan.contexts:
            counts[f"lm@{c}"] = len(run_lm(s, plan.methods, c, plan.windows, path=path, bucket=plan.bucket,
                                           prefill_chunk=plan.prefill_chunk, batch=plan.batch,
                                           lines="code" in plan.tasks, simulate_chunk=plan.simulate_chunk,
                                           deadline=plan.deadline))
    if "greedy" in plan.tasks:
        for c in plan.contexts:
            counts[f"greedy@{c}"] = len(run_greedy(s, plan.methods, c, plan.greedy_prompts,
                                                   new_tokens=plan.greedy_tokens, mode=plan.greedy_mode))
    if "fidelity" in plan.tasks:
        for c in plan.contexts:
            counts[f"fidelity@{c}"] = len(run_fidelity(s, plan.methods, c, plan.windows,
                                                       max_positions=plan.fidelity_positions))
    if "niah" in plan.tasks:
        variants = [Variant.parse(v) for v in plan.niah_variants]
        counts["niah"] = len(run_niah(s, plan.methods, plan.niah_lengths or plan.contexts, plan.niah_depths, variants,
                                      plan.niah_samples, chunk=plan.prefill_chunk, haystack=_essays(s),
                                      batch=plan.batch, deadline=plan.deadline))
    if "longgen" in plan.tasks:
        length = plan.longgen_context or plan.contexts[0]
        counts[f"longgen@{length}"] = len(run_longgen(s, plan.methods, length, plan.longgen_prompts,
                                                      new_tokens=plan.longgen_tokens, bucket=max(plan.bucket // 4, 1),
                                                      path=path, prefill_chunk=plan.prefill_chunk,
                                                      batch=plan.batch, deadline=plan.deadline))
    out = {"new_units": counts}
    if report:
        out["report"] = str(write_report(s.store.root, order=list(MAIN_METHODS)))
    return out


def _essays(s: EvalContext) -> tuple[str, str]:
    """``(name, text)`` of the held-out prose for the NIAH ``essay`` haystack: the evaluation text itself when it
    is the essays or a file, else the essays' held-out split, else (essays not installed) the held-out ``docs``;
    any other haystack than the essays is named in every record's protocol."""
    if s.text.name == "essays" or s.text.provenance.get("kind") == "file":
        return s.text.name, s.text.text
    from ..data import DataNotAvailableError
    from .texts import load_eval_text

    for name in ("essays", "docs"):
        try:
            text = load_eval_text(name).text
        except DataNotAvailableError:
            continue
        if name != "essays":
            print(f"NIAH: the essays are not installed; the essay haystack is the held-out {name}")
        return name, text
    return s.text.name, s.text.text


def _write_methods_info(s: EvalContext, methods: Sequence[str]) -> None:
    """``<out>/<model>/methods.json``: per method, bits per element and what the backend says about it; the
    evaluation texts and the command lines that wrote into the folder."""
    path = Path(s.store.root) / s.store.path(s.model_name, "x", "x", "x", 0).parent.parent.parent.name / "methods.json"
    info = json.loads(path.read_text()) if path.is_file() else {"model": s.model_name, "methods": {}}
    for m in methods:
        info["methods"][m] = s.describe(m)
    info["calibration"] = s.calib_tag
    info["numerics"] = numerics_info(s)
    info["calibration_provenance"] = getattr(s.calibration, "provenance", None)
    info["text"] = {"name": s.text.name, "sha256": s.text.sha256, **s.text.provenance}
    info.setdefault("texts", {})[s.text.name] = info["text"]
    command = shlex.join(["oscarkv", *sys.argv[1:]]) if sys.argv and sys.argv[0].endswith(("oscarkv", "__main__.py")) \
        else None
    if command and command not in info.setdefault("commands", []):
        info["commands"].append(command)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(info, indent=1, default=str) + "\n")


def numerics_info(s: EvalContext) -> dict:
    """Where and how the run computes: device, model dtype, the caches' kernel choice, and on CUDA the GPU and
    whether float32 matrix products may use TF32 (they must not for results comparable with the CPU)."""
    import torch

    out = {**s.numerics, "kernels": getattr(s.backend, "kernels", "auto"), "torch": torch.__version__}
    if out.get("device") == "cuda":
        dev = next(s.model.parameters()).device
        out.update(gpu=torch.cuda.get_device_name(dev), tf32_matmul=bool(torch.backends.cuda.matmul.allow_tf32),
                   float32_matmul_precision=torch.get_float32_matmul_precision())
    return out


__all__ = ["evaluate", "Plan", "TASKS", "MAIN_METHODS", "numerics_info"]
