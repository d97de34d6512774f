"""The long-context suite: every long-context measurement of one model in one time-capped, resumable run.

``oscarkv eval --suite long-context --model M --calibration DIR --device cuda --dtype bfloat16 --time-budget 360``
runs the steps of :func:`long_context_steps` in order: the error-versus-context curve with next-line accuracy on
code, the NIAH grid, long generation, a cross-check of the cache path against the simulation together with the
per-layer attention-output errors of one window (which say where a miss comes from), shorter NIAH rows. Each
step may use its ``share`` of the budget before the next one starts; a step stops starting new units at its
deadline and finishes the unit in flight, so every cell on file is complete (all methods of a
window batch, all samples of a NIAH batch). Time left at the end goes to the unfinished steps again, in order.
Every step's start, end, new units and any error are written to ``<out>/suite.json``; a step that raises on
the kernel path is run again with the dispatcher's reference (``kernels="reference"``), which every record then
names as its path. Rerunning the command resumes. The cross-check files its records under the text name
``code-crosscheck``: its windows are the curve's (same methods, task and context) under another protocol, and a
results file holds one protocol (the report reads the latest), so sharing the curve's files would hide one of them.
"""

from __future__ import annotations

import json
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .runner import Plan, evaluate

NIAH_DEPTHS = [0.1, 0.3, 0.5, 0.7, 0.9]
NIAH_VARIANTS = ["single-number-essay", "multikey-word-essay"]
# in order of importance: a step cut short by its time cap keeps the first ones (the reference runs first anyway)
CURVE_METHODS = ["oscar-auto", "kivi-2", "oscar", "int4-hadamard", "naive-int2", "bf16"]
NIAH_METHODS = ["native", "oscar-auto", "oscar"]
# kivi-2 has no paged kernel (its attention is PyTorch, ~2 s a 32K sample on an H200): shorter rows only
NIAH_ROW_METHODS = NIAH_METHODS + ["kivi-2"]
LONGGEN_METHODS = ["oscar-auto", "kivi-2", "oscar", "bf16"]


@dataclass(frozen=True)
class Step:
    """One measurement: a held-out text and a :class:`Plan` (without its deadline), allowed ``share`` of the
    suite's budget before the next step starts. ``label``: the text name its results are filed under (default
    the text's own), for a step that measures another step's units under another protocol."""

    name: str
    share: float
    data: str
    plan: dict = field(default_factory=dict)
    label: str | None = None


def long_context_steps(context: int = 32768, prefill_chunk: int = 256, niah_samples: int = 10) -> list[Step]:
    """The suite at ``context`` tokens (the model's maximum): see the module docstring. Windows and NIAH samples go
    through the cache in batches (8 windows, 50 NIAH samples, 8 prompts); long generation decodes
    ``min(2048, context / 16)`` tokens after prompts of ``context / 4``; ``prefill_chunk`` is the chunk of every
    chunked prefill; ``niah_samples`` the samples per NIAH cell (seeds)."""
    common = {"path": "cache", "prefill_chunk": prefill_chunk}
    shorter = [c for c in (context // 4, context // 2) if c >= 2048]
    return [
        Step("curve", 0.35, "code", {"methods": CURVE_METHODS, "tasks": ["kld", "ppl", "code"], "contexts": [context],
                                     "windows": 8, "batch": 8, **common}),
        Step("niah", 0.25, "code", {"methods": NIAH_METHODS, "tasks": ["niah"], "contexts": [context],
                                    "niah_depths": NIAH_DEPTHS, "niah_variants": NIAH_VARIANTS,
                                    "niah_samples": niah_samples,
                                    "batch": 50, **common}),
        Step("longgen", 0.2, "code", {"methods": LONGGEN_METHODS, "tasks": ["longgen"], "contexts": [context // 4],
                                      "longgen_prompts": 8, "longgen_tokens": min(2048, context // 16), "batch": 8,
                                      **common}),
        Step("crosscheck", 0.05, "code", {"methods": ["oscar-auto", "oscar", "kivi-2"], "tasks": ["kld", "fidelity"],
                                          "contexts": [context], "windows": 1, "path": "simulate",
                                          "simulate_chunk": prefill_chunk}, label="code-crosscheck"),
        Step("niah-rows", 0.15, "code", {"methods": NIAH_ROW_METHODS, "tasks": ["niah"],
                                         "contexts": shorter or [context], "niah_depths": NIAH_DEPTHS,
                                         "niah_variants": NIAH_VARIANTS, "niah_samples": niah_samples, "batch": 50,
                                         **common}),
    ]


def run_suite(make_context: Callable[[str, str], Any], steps: list[Step], out: str | Path, budget: float,
              log: Callable[[str], None] = print) -> dict:
    """Run ``steps`` within ``budget`` seconds. ``make_context(data, kernels)`` returns the
    :class:`~oscarkv.eval.context.EvalContext` of a step's text with the given kernel choice. Returns (and writes
    to ``<out>/suite.json``) the status of every step."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    status_path = out / "suite.json"
    status: dict[str, Any] = json.loads(status_path.read_text()) if status_path.is_file() else {"runs": []}
    run: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%S"), "budget_s": budget, "steps": []}
    status["runs"].append(run)
    start = time.monotonic()
    end = start + budget

    def save() -> None:
        status_path.write_text(json.dumps(status, indent=1, default=str) + "\n")

    for rnd in range(2):  # the second round gives the time left to what the first one cut short
        for step in steps:
            now = time.monotonic()
            if now >= end:
                break
            deadline = end if rnd else min(end, now + step.share * budget)
            entry = {"step": step.name, "round": rnd, "data": step.data, "start_s": round(now - start, 1)}
            if step.label:
                entry["label"] = step.label
            run["steps"].append(entry)
            save()
            for kernels in ("auto", "reference"):
                try:
                    ctx = make_context(step.data, kernels)
                    if step.label:
                        ctx = _filed_as(ctx, step.label)
                    res = evaluate(ctx, _plan(step, deadline), report=False)
                    entry.update(kernels=kernels, new_units=res["new_units"])
                    break
                except Exception as e:  # noqa: BLE001 - recorded, and the step is retried on the reference path
                    entry.setdefault("errors", []).append({"kernels": kernels, "error": repr(e)[:500],
                                                           "traceback": traceback.format_exc()[-2000:]})
                    log(f"suite: step {step.name} failed with kernels={kernels}: {e!r}")
            entry["seconds"] = round(time.monotonic() - now, 1)
            log(f"suite: {step.name} (round {rnd}) took {entry['seconds']} s: {entry.get('new_units')}")
            save()
    run["seconds"] = round(time.monotonic() - start, 1)
    save()
    return status


def _plan(step: Step, deadline: float) -> Plan:
    return Plan(**step.plan, deadline=deadline)


def _filed_as(ctx: Any, label: str) -> Any:
    """``ctx`` with its text named ``label`` (same text, same tokens, same fingerprints): its records go to
    ``<out>/<model>/<label>/...`` and carry ``data: label``."""
    import dataclasses

    from .texts import EvalText

    text = EvalText(label, ctx.text.text, {**ctx.text.provenance, "text": ctx.text.name})
    return dataclasses.replace(ctx, text=text)


__all__ = ["Step", "long_context_steps", "run_suite"]
