"""Quality evaluation of KV-cache methods: KLD, perplexity, NIAH, greedy agreement and per-layer fidelity.

Every metric runs a method through one code path, a :class:`~oscarkv.eval.backend.Backend`: teacher-forced
``simulate`` (one forward pass gives the logits a token-by-token decode through the cache would give) or the
cache itself (chunked prefill + greedy decode). Results are resumable JSONL files; :func:`write_report` turns
them into markdown tables and PNG plots. See ``docs/evaluation.md``.
"""

from __future__ import annotations

from .backend import Backend, HFBackend, final_hidden, greedy_generate, output_head
from .metrics import TokenStats, first_divergence, kl_rows, relative_error, token_stats
from .niah import NiahGenerator, Sample, Variant
from .report import aggregate, markdown_tables, write_report
from .runner import MAIN_METHODS, TASKS, Plan, evaluate
from .context import EvalContext, calibration_tag
from .store import ResultStore
from .texts import EvalText, load_eval_text

__all__ = [
    "Backend", "HFBackend", "final_hidden", "greedy_generate", "output_head", "TokenStats", "first_divergence",
    "kl_rows", "relative_error", "token_stats", "NiahGenerator", "Sample", "Variant", "aggregate",
    "markdown_tables", "write_report", "MAIN_METHODS", "TASKS", "Plan", "evaluate", "EvalContext",
    "calibration_tag", "ResultStore", "EvalText", "load_eval_text",
]
