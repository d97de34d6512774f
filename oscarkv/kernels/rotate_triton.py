"""Per-head row rotation in one launch: ``out[n, h] = (x[n, h] - mu[h // G]) @ R[h // G]`` (or ``@ R^T``, mean
added after), float32 math, optionally also scattered into a second tensor's rows (a 16-bit ring).

It replaces the ~5 torch ops per tensor (dtype casts, centering, an einsum's permute/bmm/reshape) that the vLLM
backend issued per layer for q, k, v and the output: eager vLLM steps are bound by that host work, not by the
GPU (benchmarks/vllm_layer_probe.py). Spec: :func:`oscarkv.kernels.reference.rotate_rows_ref`. The dot is
``tf32x3`` on the GPU (three TF32 tensor-core products, float32-level accuracy; the FMA ``ieee`` form cost as
much as the decode attention, docs/kernels.md) and ``ieee`` in the interpreter: results
match the reference to about float32 rounding, not bit for bit, i.e. within one ulp of the 16-bit output.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from ._triton_util import check_device, interpreting


@triton.jit
def _rotate_rows_kernel(
    x_ptr, r_ptr, mu_ptr, out_ptr, out2_ptr, rows_ptr,
    N, G, sxn, sxh, srh, sri, srj, smh, son, soh, s2n, s2h,
    D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_MU: tl.constexpr,
    MU_AFTER: tl.constexpr, HAS_OUT: tl.constexpr, HAS_OUT2: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_n = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // G
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    mask = offs_n[:, None] < N
    acc = tl.zeros((BLOCK_N, D), dtype=tl.float32)
    for k0 in tl.static_range(0, D, BLOCK_K):  # K in slices: a whole [D, D] float32 operand would spill
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_n[:, None] * sxn + h * sxh + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_MU:
            if not MU_AFTER:
                x = x - tl.load(mu_ptr + hk * smh + offs_k)[None, :]
        r = tl.load(r_ptr + hk * srh + offs_k[:, None] * sri + offs_d[None, :] * srj)
        acc = tl.dot(x, r, acc, input_precision=PRECISION)
    if HAS_MU:
        if MU_AFTER:
            acc = acc + tl.load(mu_ptr + hk * smh + offs_d)[None, :]
    if HAS_OUT:
        tl.store(out_ptr + offs_n[:, None] * son + h * soh + offs_d[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=mask)
    if HAS_OUT2:
        rows = tl.load(rows_ptr + offs_n, mask=offs_n < N, other=0)
        tl.store(out2_ptr + rows[:, None] * s2n + h * s2h + offs_d[None, :],
                 acc.to(out2_ptr.dtype.element_ty), mask=mask)


def rotate_rows_triton(
    x: Tensor, r: Tensor, mu: Tensor | None = None, *, out: Tensor | None = None, transpose: bool = False,
    mean_after: bool = False, rows_out: Tensor | None = None, rows: Tensor | None = None,
) -> Tensor | None:
    """See :func:`oscarkv.kernels.dispatch.rotate_rows`. ``x [N, Hx, d]`` (unit last stride), ``r [H, d, d]``
    and ``mu [H, d]`` float32 with ``Hx % H == 0``; ``out [N, Hx, d]`` and/or ``rows_out [M, Hx, d]`` with
    ``rows [N]`` (int64 row of each token in ``rows_out``)."""
    N, hx, d = x.shape
    H = r.shape[0]
    if hx % H or r.shape != (H, d, d) or (mu is not None and mu.shape != (H, d)) or d & (d - 1) or d < 16:
        raise ValueError(f"rotate_rows: x {tuple(x.shape)}, r {tuple(r.shape)}, mu "
                         f"{None if mu is None else tuple(mu.shape)} do not fit (d a power of two >= 16)")
    if out is None and rows_out is None:
        raise ValueError("rotate_rows needs out and/or rows_out")
    for name, t in (("x", x), ("r", r), ("mu", mu), ("out", out), ("rows_out", rows_out), ("rows", rows)):
        if t is not None:
            check_device(name, t, x.device)
    if x.stride(2) != 1 or (out is not None and (out.shape != x.shape or out.stride(2) != 1)):
        raise ValueError("x and out must be [N, Hx, d] with unit last stride")
    if rows_out is not None and (rows is None or rows.shape != (N,) or rows_out.shape[1:] != (hx, d)
                                 or rows_out.stride(2) != 1):
        raise ValueError("rows_out must be [M, Hx, d] (unit last stride) with rows [N]")
    if r.dtype.itemsize != 4 or (mu is not None and (mu.dtype.itemsize != 4 or mu.stride(1) != 1)):
        raise ValueError("r and mu must be float32")
    if N == 0:
        return out
    block_n = 16 if N <= 16 else 32 if N <= 2048 else 64
    sri, srj = (r.stride(2), r.stride(1)) if transpose else (r.stride(1), r.stride(2))
    o, o2 = (out if out is not None else x), (rows_out if rows_out is not None else x)
    _rotate_rows_kernel[(triton.cdiv(N, block_n), hx)](
        x, r, mu if mu is not None else r, o, o2, rows if rows is not None else x,
        N, hx // H, x.stride(0), x.stride(1), r.stride(0), sri, srj, mu.stride(0) if mu is not None else 0,
        o.stride(0), o.stride(1), o2.stride(0), o2.stride(1),
        D=d, BLOCK_N=block_n, BLOCK_K=min(32, d), HAS_MU=mu is not None, MU_AFTER=mean_after,
        HAS_OUT=out is not None, HAS_OUT2=rows_out is not None, PRECISION="ieee" if interpreting() else "tf32x3",
        num_warps=4,
    )
    return out


__all__ = ["rotate_rows_triton"]
