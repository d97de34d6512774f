"""Pure metric functions on tensors: next-token KL, top-1 agreement, NLL, relative errors, greedy agreement.

Everything works on final hidden states and applies the output head in chunks of positions, so an 8K window of
a 150K-vocabulary model never materialises its full ``[T, V]`` logits (5 GB in float32).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import Tensor


@dataclass
class TokenStats:
    """Sums over the scored positions of one window (divide by ``n`` for means).

    ``kl``: sum of KL(ref || method) in nats; ``top1``: positions where the argmaxes agree; ``nll``: method's
    negative log-likelihood of the true next token; ``nll_ref``: the reference's; ``logit_sq_err`` and
    ``logit_sq_ref``: squared L2 norms of ``logits_m - logits_ref`` and of ``logits_ref`` (float64 sums).
    """

    n: int = 0
    kl: float = 0.0
    top1: int = 0
    nll: float = 0.0
    nll_ref: float = 0.0
    logit_sq_err: float = 0.0
    logit_sq_ref: float = 0.0
    kl_max: float = 0.0

    def means(self) -> dict[str, float]:
        n = max(self.n, 1)
        return {
            "n": self.n,
            "kld": self.kl / n,
            "kld_max": self.kl_max,
            "top1": self.top1 / n,
            "nll": self.nll / n,
            "nll_ref": self.nll_ref / n,
            "logit_rel_err": math.sqrt(self.logit_sq_err / max(self.logit_sq_ref, 1e-30)),
        }


@dataclass
class PositionStats:
    """Per scored position (CPU tensors ``[n]``): ``kl`` (float64, KL(ref || method) in nats), ``nll`` and
    ``nll_ref`` (float64), ``top1`` (bool: the argmaxes agree), ``pred`` and ``pred_ref`` (int64: the argmaxes),
    plus the squared logit-error sums of :class:`TokenStats`."""

    kl: Tensor
    nll: Tensor
    nll_ref: Tensor
    top1: Tensor
    pred: Tensor
    pred_ref: Tensor
    logit_sq_err: float = 0.0
    logit_sq_ref: float = 0.0

    def totals(self) -> TokenStats:
        n = int(self.kl.numel())
        return TokenStats(n=n, kl=float(self.kl.sum()), top1=int(self.top1.sum()), nll=float(self.nll.sum()),
                          nll_ref=float(self.nll_ref.sum()), logit_sq_err=self.logit_sq_err,
                          logit_sq_ref=self.logit_sq_ref, kl_max=float(self.kl.max()) if n else 0.0)

    def buckets(self, positions: Tensor, size: int, targets: Tensor) -> dict[str, list]:
        """Sums per bucket of ``size`` positions: bucket ``b`` holds the scored positions ``p`` (the index of the
        query, so the context seen is ``p + 1`` tokens) with ``b * size <= p < (b + 1) * size``. ``targets``:
        the true next tokens (for next-token accuracy, ``hit``/``hit_ref``)."""
        b = torch.div(positions, size, rounding_mode="floor")
        nb = int(b.max()) + 1 if b.numel() else 0

        def total(x: Tensor) -> list:
            return torch.zeros(nb, dtype=torch.float64).index_add_(0, b, x.double()).tolist()

        return {"size": size, "n": [int(v) for v in total(torch.ones_like(self.kl))], "kl": total(self.kl),
                "nll": total(self.nll), "nll_ref": total(self.nll_ref), "top1": [int(v) for v in total(self.top1)],
                "hit": [int(v) for v in total(self.pred == targets)],
                "hit_ref": [int(v) for v in total(self.pred_ref == targets)]}


@torch.inference_mode()
def compare_heads(
    head: Callable[[Tensor], Tensor],
    hidden_ref: Tensor,
    hidden: dict[str, Tensor],
    targets: Tensor,
    *,
    chunk: int = 256,
) -> dict[str, PositionStats]:
    """Next-token distributions of a reference and of several methods at the same positions, computed with one
    output-head product per position for the reference (shared by every method).

    Args:
        head: maps hidden states ``[n, D]`` to float32 logits ``[n, V]`` (the model's output head).
        hidden_ref: final hidden states ``[T, D]`` of the reference (already restricted to the scored positions).
        hidden: name -> final hidden states ``[T, D]`` of each method at the same positions.
        targets: int64 ``[T]``, the true next token at each position (for NLL).
        chunk: positions per output-head call (bounds memory at ``(1 + len(hidden)) * chunk * V`` floats; the
            log-softmax runs in place, once per distribution).
    """
    T = hidden_ref.shape[0]
    if hidden_ref.ndim != 2:
        raise ValueError(f"hidden states must be [T, D], got {tuple(hidden_ref.shape)}")
    for name, h in hidden.items():
        if h.shape != hidden_ref.shape:
            raise ValueError(f"hidden states must be matching [T, D], got {tuple(hidden_ref.shape)} (reference) "
                             f"and {tuple(h.shape)} ({name})")
    if targets.shape != (T,):
        raise ValueError(f"targets must be [T]={T}, got {tuple(targets.shape)}")
    parts: dict[str, list] = {m: [] for m in hidden}
    sq = {m: [0.0, 0.0] for m in hidden}
    for s in range(0, T, chunk):
        zr = head(hidden_ref[s : s + chunk]).float()
        tgt = targets[s : s + chunk].to(zr.device)[:, None]
        pred_ref = zr.argmax(-1)
        sq_ref = float(zr.square().sum(-1).double().sum())
        lr = torch.log_softmax(zr, -1)
        nll_ref = -lr.gather(-1, tgt)[:, 0].double()
        pr = lr.exp()
        for m, h in hidden.items():
            zm = head(h[s : s + chunk]).float()
            pred = zm.argmax(-1)
            sq[m][0] += float((zm - zr).square_().sum(-1).double().sum())
            sq[m][1] += sq_ref
            lm = torch.log_softmax(zm, -1)
            del zm
            nll = -lm.gather(-1, tgt)[:, 0].double()
            # KL(p_ref || p) = sum p_ref * (log p_ref - log p); log p is finite, so rows with p_ref = 0 add 0
            kl = (pr * lm.neg_().add_(lr)).sum(-1).double().clamp_min(0.0)
            parts[m].append((kl.cpu(), nll.cpu(), nll_ref.cpu(), (pred == pred_ref).cpu(), pred.cpu(), pred_ref.cpu()))
    out = {}
    for m, rows in parts.items():
        cols = [torch.cat(c) for c in zip(*rows)] if rows else [torch.zeros(0)] * 6
        out[m] = PositionStats(*cols, logit_sq_err=sq[m][0], logit_sq_ref=sq[m][1])
    return out


@torch.inference_mode()
def token_stats(
    head: Callable[[Tensor], Tensor],
    hidden_ref: Tensor,
    hidden: Tensor,
    targets: Tensor,
    *,
    chunk: int = 256,
) -> TokenStats:
    """Compare next-token distributions of a reference and a method at every given position (sums; see
    :func:`compare_heads` for the per-position values and for several methods at once).

    Args:
        head: maps hidden states ``[n, D]`` to logits ``[n, V]`` (the model's output head).
        hidden_ref, hidden: final hidden states ``[T, D]`` of the reference and the method (any float dtype;
            the same positions, already restricted to the scored ones).
        targets: int64 ``[T]``, the true next token at each position (for NLL).
        chunk: positions per output-head call (bounds memory at ``chunk * V`` floats).
    """
    return compare_heads(head, hidden_ref, {"m": hidden}, targets, chunk=chunk)["m"].totals()


def kl_rows(logp_ref: Tensor, logp: Tensor) -> Tensor:
    """KL(p_ref || p) per row from log-probabilities ``[n, V]`` -> ``[n]`` (nats, clamped at 0 against
    rounding). Rows where ``p_ref`` is 0 contribute 0 even where ``logp`` is ``-inf``."""
    p = logp_ref.exp()
    diff = torch.where(p > 0, logp_ref - logp, torch.zeros_like(logp))
    return (p * diff).sum(-1).clamp_min(0.0)


def relative_error(x: Tensor, ref: Tensor) -> float:
    """``||x - ref|| / ||ref||`` over all elements (float64)."""
    num = (x.double() - ref.double()).norm()
    den = ref.double().norm()
    return float(num / den) if den > 0 else float(num)


def first_divergence(ref_tokens: list[int] | Tensor, tokens: list[int] | Tensor) -> int:
    """Index of the first position where two token sequences differ; ``len`` of the shorter if one is a prefix."""
    a = list(ref_tokens.tolist() if isinstance(ref_tokens, Tensor) else ref_tokens)
    b = list(tokens.tolist() if isinstance(tokens, Tensor) else tokens)
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


@contextlib.contextmanager
def peak_memory(model: Any) -> Iterator[dict]:
    """Yields a dict that, on CUDA, receives ``cuda_peak_gib``: the peak memory allocated on the model's device
    inside the block (CUDA's peak counter is reset on entry); stays empty on other devices."""
    p = next(iter(model.parameters()), None) if hasattr(model, "parameters") else None
    out: dict = {}
    if p is None or p.device.type != "cuda":
        yield out
        return
    torch.cuda.synchronize(p.device)
    torch.cuda.reset_peak_memory_stats(p.device)
    yield out
    torch.cuda.synchronize(p.device)
    out["cuda_peak_gib"] = round(torch.cuda.max_memory_allocated(p.device) / 2**30, 3)


def perplexity(nll_sum: float, n: int) -> float:
    """``exp(nll_sum / n)``; ``inf`` for ``n == 0``."""
    return math.exp(nll_sum / n) if n > 0 else float("inf")


__all__ = ["TokenStats", "PositionStats", "compare_heads", "token_stats", "kl_rows", "relative_error",
           "first_divergence", "perplexity", "peak_memory"]
