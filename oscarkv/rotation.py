"""Rotations: the normalised Sylvester Hadamard, bit-reversal permutation and the OSCAR composition U @ H @ P.

Rows are rotated on the right (``k~ = k @ R``). All constructors return float32 unless asked otherwise; the
eigendecomposition runs in float64.
"""

from __future__ import annotations

import torch
from torch import Tensor


class RotationError(ValueError):
    """A rotation cannot be built for this input (e.g. a head_dim that is not a power of two)."""


def is_power_of_two(n: int) -> bool:
    return n >= 1 and (n & (n - 1)) == 0


def _require_power_of_two(d: int, what: str = "head_dim") -> None:
    if not is_power_of_two(d):
        raise RotationError(
            f"{what} = {d} is not a power of two: the Sylvester Hadamard needs one. Use composition 'u' or "
            "'none' for this model."
        )


def hadamard(d: int, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> Tensor:
    """Normalised Sylvester Hadamard: ``H_1 = [1]``, ``H_2n = [[H_n, H_n], [H_n, -H_n]] / sqrt(2)``."""
    _require_power_of_two(d)
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / d**0.5).to(dtype=dtype, device=device)


def bit_reverse(i: int, nbits: int) -> int:
    return int(format(i, f"0{nbits}b")[::-1], 2) if nbits else 0


def bitrev_permutation(d: int) -> Tensor:
    """``perm[i] = bitrev(i)`` over ``log2(d)`` bits, as a LongTensor."""
    _require_power_of_two(d)
    nbits = d.bit_length() - 1
    return torch.tensor([bit_reverse(i, nbits) for i in range(d)], dtype=torch.long)


def permutation_matrix(perm: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """``P`` with ``P[i, perm[i]] = 1``, so ``(y @ P)[perm[i]] = y[i]``: position ``i`` moves to ``perm[i]``."""
    d = perm.numel()
    p = torch.zeros(d, d, dtype=dtype)
    p[torch.arange(d), perm] = 1
    return p


def sorted_eigh(cov: Tensor) -> tuple[Tensor, Tensor]:
    """Eigenvalues (descending) and eigenvectors (columns, same order) of a symmetric matrix, in float64.

    Each eigenvector's sign is fixed (its largest-magnitude entry is positive) so the result is reproducible.
    """
    c = cov.to(torch.float64)
    c = 0.5 * (c + c.transpose(-1, -2))
    evals, evecs = torch.linalg.eigh(c)
    evals = evals.flip(-1)
    evecs = evecs.flip(-1)
    idx = evecs.abs().argmax(dim=-2, keepdim=True)
    signs = torch.sign(torch.gather(evecs, -2, idx))
    signs[signs == 0] = 1
    return evals, evecs * signs


def compose(u: Tensor | None, d: int, composition: str = "uhp") -> Tensor:
    """Build the rotation for ``composition`` in ("uhp", "uh", "u", "h", "none") from eigenvectors ``u``
    (columns sorted by descending eigenvalue; ``[..., d, d]``, ignored for "h"/"none"). Returns float32."""
    eye = torch.eye(d, dtype=torch.float64)
    if composition == "none":
        return eye.to(torch.float32)
    if composition == "h":
        return hadamard(d, torch.float64).to(torch.float32)
    if u is None:
        raise ValueError(f"composition {composition!r} needs eigenvectors")
    u = u.to(torch.float64)
    if composition == "u":
        return u.to(torch.float32)
    r = u @ hadamard(d, torch.float64)
    if composition == "uhp":
        r = r @ permutation_matrix(bitrev_permutation(d), torch.float64)
    elif composition != "uh":
        raise ValueError(f"unknown composition {composition!r}; valid: uhp, uh, u, h, none")
    return r.to(torch.float32)


def rotation_from_covariance(cov: Tensor, composition: str = "uhp") -> tuple[Tensor, Tensor]:
    """``(R, eigenvalues)`` for covariance(s) ``[..., d, d]``: ``R = U @ H @ P`` (or the chosen composition)."""
    evals, evecs = sorted_eigh(cov)
    return compose(evecs, cov.shape[-1], composition), evals.to(torch.float32)


def orthogonality_error(r: Tensor) -> float:
    """``max |R^T R - I|`` over all matrices in ``r`` (``[..., d, d]``), computed in float64."""
    r64 = r.to(torch.float64)
    eye = torch.eye(r.shape[-1], dtype=torch.float64, device=r.device)
    return (r64.transpose(-1, -2) @ r64 - eye).abs().max().item()


def check_orthogonal(r: Tensor, atol: float = 1e-5, what: str = "rotation") -> None:
    """Raise ``RotationError`` if ``r`` is not square or not orthogonal to ``atol``."""
    if r.ndim < 2 or r.shape[-1] != r.shape[-2]:
        raise RotationError(f"{what} must be square [..., d, d], got shape {tuple(r.shape)}")
    if not torch.isfinite(r).all():
        raise RotationError(f"{what} contains NaN or Inf")
    err = orthogonality_error(r)
    if err > atol:
        raise RotationError(f"{what} is not orthogonal: max |R^T R - I| = {err:.3g} > {atol:g}")


def random_orthogonal(d: int, generator: torch.Generator | None = None) -> Tensor:
    """A Haar-random orthogonal matrix (float32), for tests."""
    a = torch.randn(d, d, dtype=torch.float64, generator=generator)
    q, rr = torch.linalg.qr(a)
    return (q * torch.sign(torch.diagonal(rr))).to(torch.float32)


__all__ = [
    "RotationError",
    "hadamard",
    "bitrev_permutation",
    "permutation_matrix",
    "sorted_eigh",
    "compose",
    "rotation_from_covariance",
    "orthogonality_error",
    "check_orthogonal",
    "random_orthogonal",
    "is_power_of_two",
]
