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


@torch.inference_mode()
def token_stats(
    head: Callable[[Tensor], Tensor],
    hidden_ref: Tensor,
    hidden: Tensor,
    targets: Tensor,
    *,
    chunk: int = 256,
) -> TokenStats:
    """Compare next-token distributions of a reference and a method at every given position.

    Args:
        head: maps hidden states ``[n, D]`` to logits ``[n, V]`` (the model's output head).
        hidden_ref, hidden: final hidden states ``[T, D]`` of the reference and the method (any float dtype;
            the same positions, already restricted to the scored ones).
        targets: int64 ``[T]``, the true next token at each position (for NLL).
        chunk: positions per output-head call (bounds memory at ``chunk * V`` floats).
    """
    if hidden_ref.shape != hidden.shape or hidden.ndim != 2:
        raise ValueError(f"hidden states must be matching [T, D], got {tuple(hidden_ref.shape)} and {tuple(hidden.shape)}")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets must be [T]={hidden.shape[0]}, got {tuple(targets.shape)}")
    st = TokenStats()
    for s in range(0, hidden.shape[0], chunk):
        lr = head(hidden_ref[s : s + chunk]).float()
        lm = head(hidden[s : s + chunk]).float()
        tgt = targets[s : s + chunk].to(lr.device)
        st.n += lr.shape[0]
        st.logit_sq_err += float((lm - lr).double().pow(2).sum())
        st.logit_sq_ref += float(lr.double().pow(2).sum())
        st.top1 += int((lr.argmax(-1) == lm.argmax(-1)).sum())
        lr = torch.log_softmax(lr, -1)
        lm = torch.log_softmax(lm, -1)
        kl = kl_rows(lr, lm)
        st.kl += float(kl.double().sum())
        st.kl_max = max(st.kl_max, float(kl.max()))
        st.nll -= float(lm.gather(-1, tgt[:, None]).double().sum())
        st.nll_ref -= float(lr.gather(-1, tgt[:, None]).double().sum())
    return st


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


__all__ = ["TokenStats", "token_stats", "kl_rows", "relative_error", "first_divergence", "perplexity", "peak_memory"]
