"""Next-line exact match from one teacher-forced pass (the code-completion task).

A *line* of a window is the run of tokens after a token that contains a newline, up to and including the next
token that contains one. Greedy decoding from the prefix before the line reproduces the line exactly iff, at
every position of the line, the argmax given the true prefix is the true token: while the greedy output agrees
with the truth, its prefix *is* the true prefix. So the argmaxes of one teacher-forced pass score every line of
the window as a completion task whose prompt is everything before it. The line's last token is compared up to
and including its first newline (the text after it, e.g. a blank line, belongs to the next line), so a
completion "ends the line" however the tokenizer groups trailing whitespace.

Lines whose text (before the newline, stripped) is shorter than ``min_chars`` are not scored (blank lines, lone
brackets). This is stricter than comparing decoded strings: a completion that spells the line with other tokens
counts as a miss, for the reference and every method alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

MIN_CHARS = 3


class LineTable:
    """Per token id of one tokenizer: its text up to and including its first newline, as a class id (``-1`` for
    tokens without a newline). Built once per tokenizer (``[V]`` int64)."""

    def __init__(self, tokenizer: Any, vocab_size: int):
        heads: dict[str, int] = {}
        cls = []
        for i in range(vocab_size):
            text = _token_text(tokenizer, i)
            cut = text.find("\n")
            cls.append(-1 if cut < 0 else heads.setdefault(text[: cut + 1], len(heads)))
        self.end_class = torch.tensor(cls, dtype=torch.long)
        self.tokenizer = tokenizer

    def spans(self, ids: Tensor, lo: int, min_chars: int = MIN_CHARS) -> list[tuple[int, int]]:
        """``(a, b)`` token index ranges (inclusive) of the scored lines of ``ids`` ``[T]``: token ``a - 1`` holds
        a newline, ``b`` is the next token that holds one, ``a - 1 >= lo`` (the first prediction is at a scored
        position) and the line's text has at least ``min_chars`` characters."""
        nl = (self.end_class[ids.clamp(0, self.end_class.numel() - 1)] >= 0).nonzero().squeeze(1).tolist()
        out = []
        for prev, b in zip(nl, nl[1:]):
            a = prev + 1
            if a - 1 < lo or b < a:
                continue
            text = self.tokenizer.decode(ids[a : b + 1].tolist())
            if len(text.split("\n", 1)[0].strip()) >= min_chars:
                out.append((a, b))
        return out

    def correct(self, pred: Tensor, ids: Tensor, spans: list[tuple[int, int]]) -> Tensor:
        """bool ``[len(spans)]``: whether the argmaxes ``pred`` (``pred[p]`` is the prediction for token ``p + 1``,
        ``[T - 1]`` or longer) reproduce each line."""
        out = torch.zeros(len(spans), dtype=torch.bool)
        hit = pred[: ids.numel() - 1] == ids[1:]
        ec = self.end_class
        for j, (a, b) in enumerate(spans):
            out[j] = bool(hit[a - 1 : b - 1].all()) and int(ec[pred[b - 1]]) == int(ec[ids[b]]) >= 0
        return out


@dataclass
class LineScores:
    """Next-line exact match of one window: line start positions and per-line correctness of the method and of
    the reference."""

    start: Tensor
    hit: Tensor
    hit_ref: Tensor

    def buckets(self, size: int, nb: int) -> dict[str, list]:
        """Counts per bucket of ``size`` positions, a line counted at its first prediction ``a - 1``."""
        b = torch.div(self.start - 1, size, rounding_mode="floor").clamp(max=max(nb - 1, 0))

        def total(x: Tensor) -> list[int]:
            return [int(v) for v in torch.zeros(nb, dtype=torch.long).index_add_(0, b, x.long())]

        return {"n": total(torch.ones_like(self.hit)), "hit": total(self.hit), "hit_ref": total(self.hit_ref)}


def score_lines(table: LineTable, ids: Tensor, lo: int, pred: Tensor, pred_ref: Tensor) -> LineScores:
    """Lines of window ``ids`` ``[T]`` scored from position ``lo``; ``pred``/``pred_ref`` are the argmaxes at
    positions ``lo .. T - 2`` (as :func:`oscarkv.eval.metrics.compare_heads` returns them)."""
    spans = table.spans(ids, lo)
    full = torch.full((ids.numel() - 1,), -1, dtype=torch.long)
    full_ref = full.clone()
    full[lo:] = pred
    full_ref[lo:] = pred_ref
    start = torch.tensor([a for a, _ in spans], dtype=torch.long)
    return LineScores(start, table.correct(full, ids, spans), table.correct(full_ref, ids, spans))


def _token_text(tokenizer: Any, i: int) -> str:
    try:
        return tokenizer.decode([i])
    except Exception:  # noqa: BLE001 - ids a tokenizer cannot decode (reserved slots past its vocabulary)
        return ""


__all__ = ["LineTable", "LineScores", "score_lines", "MIN_CHARS"]
