"""Evaluation text: held-out corpora from :mod:`oscarkv.data` or a plain-text file, cut into token windows.

Windows are consecutive, non-overlapping slices of the tokenized text, taken from the start: the same
``(text, tokenizer, length, index)`` always gives the same tokens, which is what makes results resumable and
comparable across methods and runs.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor


@dataclass(frozen=True)
class EvalText:
    """A held-out text and where it came from (recorded with every result)."""

    name: str
    text: str
    provenance: dict

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()


def load_eval_text(name_or_file: str) -> EvalText:
    """The evaluation split of a named corpus (``oscarkv.data``; e.g. "essays", "shakespeare") or a UTF-8 file.

    Named corpora come from their held-out split, which is disjoint from any calibration split by construction.
    """
    path = Path(name_or_file).expanduser()
    if path.is_file():
        text = path.read_text(encoding="utf-8", errors="replace")
        return EvalText(path.stem, text, {"kind": "file", "path": str(path.resolve()), "chars": len(text)})
    from .. import data

    text, prov = _named_eval_text(data, name_or_file)
    return EvalText(name_or_file, text, {"kind": "corpus", **prov, "chars": len(text)})


def _named_eval_text(data: Any, name: str) -> tuple[str, dict]:
    """The held-out split of corpus ``name`` (documents joined by blank lines) and its provenance."""
    corpus = data.load_corpus(name, split="evaluation")
    if not corpus.documents:
        raise ValueError(f"corpus {name!r} has an empty evaluation split")
    return "\n\n".join(d.text.strip() for d in corpus.documents), corpus.describe()


def tokenize(tokenizer: Any, text: str) -> Tensor:
    """int64 token ids ``[N]`` of ``text`` without special tokens (a BOS, where the model has one, is added by
    :func:`windows`)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"] if callable(tokenizer) else tokenizer.encode(text)
    return torch.tensor(ids, dtype=torch.long)


def bos_id(tokenizer: Any) -> int | None:
    """The BOS token the model expects at the start of a sequence, or None (Qwen2.5 uses none)."""
    if getattr(tokenizer, "add_bos_token", False) and getattr(tokenizer, "bos_token_id", None) is not None:
        return int(tokenizer.bos_token_id)
    return None


def windows(tokens: Tensor, length: int, count: int, bos: int | None = None) -> list[Tensor]:
    """Up to ``count`` consecutive non-overlapping windows of ``length`` tokens (``bos`` prepended, counted in
    ``length``). Raises if the text cannot give even one window."""
    if length < 2:
        raise ValueError(f"context length must be >= 2, got {length}")
    body = length - (bos is not None)
    n = min(count, tokens.numel() // body)
    if n == 0:
        raise ValueError(f"the evaluation text has {tokens.numel()} tokens, fewer than one window of {length}; "
                         "use a shorter --context or a longer text")
    out = []
    for i in range(n):
        w = tokens[i * body : (i + 1) * body]
        out.append(torch.cat([torch.tensor([bos]), w]) if bos is not None else w.clone())
    return out


__all__ = ["EvalText", "load_eval_text", "tokenize", "windows", "bos_id"]
