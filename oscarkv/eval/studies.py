"""Calibration studies: quality vs calibration tokens, and under distribution shift (corpus, chat template).

Each study calibrates the ctx's model several times (artifacts are kept under ``calib_dir`` and reused by a
rerun), evaluates one method with each calibration through the ordinary teacher-forced KLD/PPL task (so results
are resumable like any other), and returns a markdown table with a one-line recommendation.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

from .lm import TASK as LM_TASK
from .lm import run_lm
from .report import aggregate
from .context import EvalContext
from .store import safe_name

CHAT = "+chat"


def _calibration(s: EvalContext, corpus: str, tokens: int, calib_dir: Path):
    """Load or compute (then save) the calibration of ``corpus`` (``NAME+chat``: chat-templated) at ``tokens``."""
    from ..artifact import Calibration
    from ..calib import calibrate
    from ..config import QuantSpec

    folder = Path(calib_dir) / safe_name(s.model_name) / f"{safe_name(corpus)}-{tokens}"
    if (folder / "oscar.json").is_file():
        return Calibration.load(folder, model=s.model)
    name, chat = (corpus[: -len(CHAT)], True) if corpus.endswith(CHAT) else (corpus, False)
    spec = s.calibration.spec if s.calibration is not None else QuantSpec()
    seq_len = min(1024, max(64, tokens // 2))
    calib = calibrate(s.model, s.tokenizer, name, spec=spec, tokens=tokens, seed=0, seq_len=seq_len,
                      chat_template=chat, progress=s.progress, name=s.model_name)
    calib.save(folder)
    return calib


def _evaluate(s: EvalContext, labels: dict[str, object], method: str, contexts: Sequence[int], windows: int) -> dict:
    extra = getattr(s.backend, "extra", None)
    if extra is None:
        raise ValueError("calibration studies need the HF backend (method@label calibrations)")
    extra.update(labels)
    names = [f"{method}@{label}" for label in labels]
    for c in contexts:
        run_lm(s, [s.reference, *names], c, windows)
    keys = {f"w{i}" for i in range(windows)}  # only the windows this study evaluated (others may be on file)
    recs = []
    for name in [s.reference, *names]:
        for c in contexts:
            recs += [r for r in s.store.records_for(s.model_name, s.text.name, name, LM_TASK, c)
                     if r.get("key") in keys]
    return aggregate(recs)


def run_study(s: EvalContext, study: str, *, method: str = "oscar", tokens: Sequence[int] = (500, 2000, 8000, 32000),
              corpora: Sequence[str] = ("shakespeare", "kjv", "shakespeare+chat"), contexts: Sequence[int] = (1024,),
              windows: int = 2, calib_dir: str | Path = "calibrations") -> str:
    """Run ``study`` ("calib-tokens" or "shift") and return its markdown summary with a recommendation."""
    if study == "calib-tokens":
        corpus = corpora[0] if corpora else "shakespeare"
        labels = {f"{safe_name(corpus)}-{n}": _calibration(s, corpus, n, calib_dir) for n in tokens}
        rows = [(label, n) for label, n in zip(labels, tokens)]
        title = f"quality vs calibration tokens ({method}, calibrated on {corpus}, evaluated on {s.text.name})"
    elif study == "shift":
        n = max(tokens)
        labels = {f"{safe_name(c)}-{n}": _calibration(s, c, n, calib_dir) for c in corpora}
        rows = [(label, c) for label, c in zip(labels, corpora)]
        title = f"calibration corpus shift ({method}, {n} tokens each, evaluated on {s.text.name})"
    else:
        raise ValueError(f"unknown study {study!r}; studies: calib-tokens, shift")
    agg = _evaluate(s, labels, method, contexts, windows)
    table = [f"### {s.model_name}: {title}\n", "| calibration | " + " | ".join(f"KLD@{c} | PPL@{c}" for c in contexts)
             + " | mean KLD |", "|" + "---|" * (2 + 2 * len(contexts))]
    means = {}
    for label, what in rows:
        cells, klds = [], []
        for c in contexts:
            v = agg.get((s.model_name, s.text.name, LM_TASK, f"{method}@{label}", c))
            cells += [f"{v['kld']:.4f}", f"{v['ppl']:.2f}"] if v else ["-", "-"]
            if v:
                klds.append(v["kld"])
        means[what] = sum(klds) / len(klds) if klds else math.nan
        table.append(f"| {what} | " + " | ".join(cells) + f" | {means[what]:.4f} |")
    ref = [agg.get((s.model_name, s.text.name, LM_TASK, s.reference, c)) for c in contexts]
    ppl = ", ".join(f"{c}: {r['ppl']:.2f}" for c, r in zip(contexts, ref) if r)
    table.append(f"\nreference ({s.reference}) PPL: {ppl}")
    return "\n".join(table) + "\n\n" + recommend(study, means) + "\n"


def recommend(study: str, means: dict, tolerance: float = 0.10) -> str:
    """One-line recommendation from mean KLD per study row (token budget or corpus)."""
    valid = {k: v for k, v in means.items() if not math.isnan(v)}
    if not valid:
        return "recommendation: none (no results)"
    best_key = min(valid, key=valid.get)
    best = valid[best_key]
    if study == "calib-tokens":
        enough = min(k for k, v in valid.items() if v <= best * (1 + tolerance))
        return (f"recommendation: calibrate with at least {enough} tokens (mean KLD {valid[enough]:.4f}, within "
                f"{tolerance:.0%} of the best {best:.4f} at {best_key} tokens)")
    worst_key = max(valid, key=valid.get)
    return (f"recommendation: calibrate on {best_key} (mean KLD {best:.4f}); the worst, {worst_key}, is "
            f"{valid[worst_key] / best:.2f}x worse on this evaluation text")


__all__ = ["run_study", "recommend"]
