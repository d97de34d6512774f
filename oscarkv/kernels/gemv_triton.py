"""Triton decode GEMV of the decoder (:func:`gemv`, dispatched by :func:`oscarkv.kernels.dispatch.gemv`):
``y = linear(pro(x), w, b) (+ residual)`` for a few rows, with an RMSNorm or a SiLU gate fused into its input;
semantics of :func:`oscarkv.kernels.reference.gemv_ref`. Launch configurations come from :func:`gemv_config`
(per-shape entries in ``GEMV_CONFIGS`` win over its heuristic).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from .dense_triton import (
    _gdc_launch,
    _gdc_wait,
    _launch,
    _p2,
    _pdl_enter,
    pdl_available,
)
from .dispatch import GEMV_MAX_M


@dataclass(frozen=True)
class GemvConfig:
    """Tiling of the decode GEMV. Each program owns ``block_n`` output columns and streams their weight rows
    over all of K, or over one of ``split_k`` slices of K.

    ``kind`` "fma": CUDA-core FMAs; meant for one row: each thread sums its 16-byte vector of products in
    registers, so the fp32 accumulator is ``[BN, BK / 8]`` (bf16); a 16 x 1024 tile takes 125-128 registers
    (Triton 3.6, sm_90 AOT build: 4 programs per SM);
    the input row shares the weight tile's layout, so the loop has no layout conversion. More rows broadcast
    through a 3-D ``[MP, BN, BK]`` accumulator, which Triton converts through shared memory: correct but slow.
    "dot": tensor cores with the weight tile as the M side (``W[BN, BK] @ x^T[BK, 16]``, rows padded to 16),
    loads pipelined by ``num_stages`` (cp.async).
    ``split_k`` > 1: a grid of ``(N / BN, split_k)`` programs, each over ``K / split_k`` (rounded up to whole
    ``block_k`` tiles): more programs and more loads in flight for a small matrix, and with PDL a larger share
    of the weights loaded before the wait. Each program stores its float32 partial sums to a workspace and
    takes a ticket; the last of a column block adds the partials in split order (deterministic), runs the
    epilogue and resets its ticket counter (graph-safe: nothing to zero between replays). Sums in a different
    order than ``split_k=1``, so results differ in the last bits.
    (Register and pipelining figures: compiled for sm_90 with Triton 3.9, not yet timed on a GPU.)"""

    kind: str = "fma"
    block_n: int = 8
    block_k: int = 1024
    num_warps: int = 4
    num_stages: int = 2
    split_k: int = 1

    def __post_init__(self) -> None:
        if self.kind not in ("fma", "dot"):
            raise ValueError(f"GemvConfig.kind must be 'fma' or 'dot', got {self.kind!r}")
        if self.kind == "dot" and (self.block_n < 16 or self.block_k < 16):
            raise ValueError("the 'dot' GEMV needs block_n and block_k >= 16 (tensor-core tile)")
        if self.split_k < 1:
            raise ValueError(f"GemvConfig.split_k must be >= 1, got {self.split_k}")


# (padded rows, N, K) -> config: a tuned entry for a shape where another tiling than the heuristic's wins
GEMV_CONFIGS: dict[tuple[int, int, int], GemvConfig] = {}


def gemv_config(M: int, N: int, K: int, dtype: torch.dtype = torch.bfloat16) -> GemvConfig:
    """The tuned entry for the shape if there is one, else a heuristic. One row, "fma": 8 x 1024 tiles, 4 warps,
    for up to 8192 outputs (twice the programs of 16-row tiles on the small projections: 8B qkv / o_proj 768 /
    512), 16 x 1024 above (gate_up, lm_head); rows of 8192 and more (down) 2048-wide tiles, 8 warps, 16 rows
    from 4096 outputs, else 8 (the fastest measured in the 36-layer PDL chains, docs/kernels.md). More rows:
    "dot" 16 x 256, 4 stages (49 KB of shared memory)."""
    mp = _p2(M)
    if (mp, N, K) in GEMV_CONFIGS:
        return GEMV_CONFIGS[(mp, N, K)]
    if mp == 1:
        if K >= 8192:
            return GemvConfig("fma", 16 if N >= 4096 else 8, 2048, 8, 1)
        return GemvConfig("fma", 8 if N <= 8192 else 16, 1024, 4, 1)
    if dtype == torch.float32:  # fp32 "ieee" dots run on FMAs: 256-wide tiles x 4 stages spill (tests only)
        return GemvConfig("dot", 16, 64, 4, 2)
    return GemvConfig("dot", 16, 256, 4, 4)


@triton.jit
def _gemv_inv_rms(x_ptr, rm, M, K, s_xm, eps, MP: tl.constexpr, BK: tl.constexpr):
    """1 / rms of each row of x (float32), as ``_rmsnorm_kernel`` computes it (summed in BK chunks)."""
    rk = tl.arange(0, BK)
    ss = tl.zeros([MP], tl.float32)
    for k0 in range(0, K, BK):
        m = (rm < M)[:, None] & (k0 + rk < K)[None, :]
        xf = tl.load(x_ptr + rm[:, None] * s_xm + k0 + rk[None, :], mask=m, other=0.0).to(tl.float32)
        ss += tl.sum(xf * xf, 1)
    return 1.0 / tl.sqrt(ss / K + eps)


@triton.jit
def _gemv_x(x_ptr, nw_ptr, rm, kk, inv, M, K, s_xm, PRO: tl.constexpr):
    """Rows ``rm``, columns ``kk`` of the GEMV input after the prologue, in x's dtype: PRO 0 x as is; 1 the
    RMSNorm output ``nw * (x * inv).to(dtype)``; 2 the SiLU gate ``silu(x[:, :K]).to(dtype) * x[:, K:]``
    (x then holds ``[gate | up]``). Same arithmetic as ``_rmsnorm_kernel`` / ``_silu_mul_kernel``."""
    m = (rm < M)[:, None] & (kk < K)[None, :]
    ptrs = x_ptr + rm[:, None] * s_xm + kk[None, :]
    xv = tl.load(ptrs, mask=m, other=0.0)
    if PRO == 1:
        nw = tl.load(nw_ptr + kk[None, :], mask=(kk < K)[None, :], other=0.0)  # 2-D: the x tile's layout
        xv = nw * (xv.to(tl.float32) * inv[:, None]).to(xv.dtype)
    if PRO == 2:
        u = tl.load(ptrs + K, mask=m, other=0.0)
        g = xv.to(tl.float32)
        xv = (g / (1.0 + tl.exp(-g))).to(u.dtype) * u
    return xv


@triton.jit
def _gemv_w(ptrs, rn, kk, N, K, EVEN: tl.constexpr):
    """A weight tile, streamed once: no predicates when the tiles divide the matrix, evicted first from L2."""
    if EVEN:
        return tl.load(ptrs, eviction_policy="evict_first")
    return tl.load(ptrs, mask=(rn < N)[:, None] & (kk < K)[None, :], other=0.0, eviction_policy="evict_first")


@triton.jit
def _gemv_store(y, rm, rn, x_ptr, b_ptr, r_ptr, y_ptr, M, N, s_rm, s_ym, HAS_BIAS: tl.constexpr,
                HAS_RES: tl.constexpr):
    """Epilogue on the fp32 ``y [MP, BN]``: + bias, round to x's dtype, then + residual (rounded again: the same
    two roundings as an unfused linear followed by the residual add), stored in y's dtype (x's, or float32 for
    logits: an exact conversion of the rounded value, as ``linear(...).float()``)."""
    m = (rm < M)[:, None] & (rn < N)[None, :]
    if HAS_BIAS:
        y = y + tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    out = y.to(x_ptr.dtype.element_ty)
    if HAS_RES:
        r = tl.load(r_ptr + rm[:, None] * s_rm + rn[None, :], mask=m, other=0.0)
        out = (out + r).to(x_ptr.dtype.element_ty)
    tl.store(y_ptr + rm[:, None] * s_ym + rn[None, :], out.to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _gemv_epilogue(y, rm, rn, x_ptr, b_ptr, r_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, s_rm, s_ym,
                   HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, SPLIT: tl.constexpr):
    """``SPLIT == 1``: the epilogue. Else this program's partial ``y`` goes to ``ws [SPLIT, M, N]`` (float32),
    then a ticket (acq_rel, after a CTA barrier so that all of the program's stores are released); the program
    drawing the last ticket of its column block sums the partials in split order, runs the epilogue and resets
    the counter for the next launch."""
    if SPLIT == 1:
        _gemv_store(y, rm, rn, x_ptr, b_ptr, r_ptr, y_ptr, M, N, s_rm, s_ym, HAS_BIAS, HAS_RES)
    else:
        m = (rm < M)[:, None] & (rn < N)[None, :]
        pid_n = tl.program_id(0)
        tl.store(ws_ptr + (tl.program_id(1) * M + rm[:, None]).to(tl.int64) * N + rn[None, :], y, mask=m)
        tl.debug_barrier()
        ticket = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT - 1:
            tot = tl.zeros_like(y)
            for sp in tl.static_range(SPLIT):  # L2 reads (.cg): other programs' partials, never a stale L1 line
                tot += tl.load(ws_ptr + (sp * M + rm[:, None]).to(tl.int64) * N + rn[None, :], mask=m, other=0.0,
                               cache_modifier=".cg")
            _gemv_store(tot, rm, rn, x_ptr, b_ptr, r_ptr, y_ptr, M, N, s_rm, s_ym, HAS_BIAS, HAS_RES)
            tl.atomic_xchg(cnt_ptr + pid_n, 0, sem="relaxed", scope="gpu")


@triton.jit
def _gemv_setup(x_ptr, w_ptr, M, K, s_xm, s_wn, eps, MP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                PRO: tl.constexpr):
    """This program's output columns, rows, K offsets, the prologue RMSNorm's 1/rms (PRO == 1) and weight rows."""
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rm = tl.arange(0, MP)
    rk = tl.arange(0, BK)
    if PRO == 1:
        inv = _gemv_inv_rms(x_ptr, rm, M, K, s_xm, eps, MP, BK)
    else:
        inv = tl.zeros([MP], tl.float32)
    return rn, rm, rk, inv, w_ptr + rn.to(tl.int64)[:, None] * s_wn + rk[None, :]


@triton.jit
def _gemv_krange(K, KS, SPLIT: tl.constexpr):
    """The K range ``[k_lo, k_hi)`` of this program: all of K, or its split-K slice (``program_id(1)``)."""
    if SPLIT == 1:
        k_lo = 0
        k_hi = K
    else:
        k_lo = tl.program_id(1) * KS
        k_hi = tl.minimum(k_lo + KS, K)
    return k_lo, k_hi


@triton.jit
def _gemv_fma_kernel(x_ptr, w_ptr, b_ptr, r_ptr, nw_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K, KS, s_xm, s_wn, s_rm,
                     s_ym, eps, MP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PRO: tl.constexpr,
                     HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, EVEN: tl.constexpr, V: tl.constexpr,
                     SPLIT: tl.constexpr, PDL: tl.constexpr):
    k_lo, k_hi = _gemv_krange(K, KS, SPLIT)
    if MP == 1 and PDL:
        # Programmatic dependent: let the next kernel launch now, load the first weight tile (which no kernel
        # writes) while the previous kernel drains, and only then wait for it and read x / the residual.
        _gdc_launch()
        rn = tl.program_id(0) * BN + tl.arange(0, BN)
        rm = tl.arange(0, MP)
        rk = tl.arange(0, BK)
        w_ptrs = w_ptr + rn.to(tl.int64)[:, None] * s_wn + rk[None, :]
        w = _gemv_w(w_ptrs + k_lo, rn, k_lo + rk, N, K, EVEN)
        _gdc_wait()
        if PRO == 1:
            inv = _gemv_inv_rms(x_ptr, rm, M, K, s_xm, eps, MP, BK)
        else:
            inv = tl.zeros([MP], tl.float32)
        xv = _gemv_x(x_ptr, nw_ptr, rm, k_lo + rk, inv, M, K, s_xm, PRO)
        acc2 = tl.sum(tl.reshape(w.to(tl.float32) * xv.to(tl.float32), [BN, BK // V, V]), 2)
        for k0 in range(k_lo + BK, k_hi, BK):
            w = _gemv_w(w_ptrs + k0, rn, k0 + rk, N, K, EVEN)
            xv = _gemv_x(x_ptr, nw_ptr, rm, k0 + rk, inv, M, K, s_xm, PRO)
            acc2 += tl.sum(tl.reshape(w.to(tl.float32) * xv.to(tl.float32), [BN, BK // V, V]), 2)
        y = tl.sum(acc2, 1)[None, :]
    else:
        _pdl_enter(PDL)
        rn, rm, rk, inv, w_ptrs = _gemv_setup(x_ptr, w_ptr, M, K, s_xm, s_wn, eps, MP, BN, BK, PRO)
        if MP == 1:  # 2-D: the input row shares the weight tile's layout (no 3-D broadcast, no conversion)
            acc2 = tl.zeros([BN, BK // V], tl.float32)
            for k0 in range(k_lo, k_hi, BK):
                w = _gemv_w(w_ptrs + k0, rn, k0 + rk, N, K, EVEN)
                xv = _gemv_x(x_ptr, nw_ptr, rm, k0 + rk, inv, M, K, s_xm, PRO)
                # each thread's V contiguous products (one 16-byte load) summed in registers: a V-times smaller
                # accumulator, so wide tiles keep occupancy
                acc2 += tl.sum(tl.reshape(w.to(tl.float32) * xv.to(tl.float32), [BN, BK // V, V]), 2)
            y = tl.sum(acc2, 1)[None, :]
        else:
            acc = tl.zeros([MP, BN, BK], tl.float32)
            for k0 in range(k_lo, k_hi, BK):
                w = _gemv_w(w_ptrs + k0, rn, k0 + rk, N, K, EVEN)
                xv = _gemv_x(x_ptr, nw_ptr, rm, k0 + rk, inv, M, K, s_xm, PRO)
                acc += xv.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
            y = tl.sum(acc, 2)
    _gemv_epilogue(y, rm, rn, x_ptr, b_ptr, r_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, s_rm, s_ym, HAS_BIAS, HAS_RES,
                   SPLIT)


@triton.jit
def _gemv_dot_kernel(x_ptr, w_ptr, b_ptr, r_ptr, nw_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K, KS, s_xm, s_wn, s_rm,
                     s_ym, eps, MP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PRO: tl.constexpr,
                     HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, EVEN: tl.constexpr, PREC: tl.constexpr,
                     SPLIT: tl.constexpr, PDL: tl.constexpr):
    k_lo, k_hi = _gemv_krange(K, KS, SPLIT)
    _pdl_enter(PDL)  # the pipelined loop starts with its loads: wait before it
    rn, rm, rk, inv, w_ptrs = _gemv_setup(x_ptr, w_ptr, M, K, s_xm, s_wn, eps, MP, BN, BK, PRO)
    acc = tl.zeros([BN, MP], tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        w = _gemv_w(w_ptrs + k0, rn, k0 + rk, N, K, EVEN)
        xv = _gemv_x(x_ptr, nw_ptr, rm, k0 + rk, inv, M, K, s_xm, PRO)
        acc = tl.dot(w, tl.trans(xv.to(w.dtype)), acc, input_precision=PREC)  # W as the M side: [BN, MP]
    _gemv_epilogue(tl.trans(acc), rm, rn, x_ptr, b_ptr, r_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, s_rm, s_ym,
                   HAS_BIAS, HAS_RES, SPLIT)


_SPLIT_WORK: dict = {}  # (device, split, M, N) -> float32 workspace; (device, blocks) -> int32 tickets


def _split_buffers(dev: torch.device, split: int, M: int, N: int, blocks: int) -> tuple[Tensor, Tensor]:
    """Persistent split-K workspace and ticket counters (zeroed once; the kernel resets its tickets): a captured
    graph keeps pointing at them. Calls of one shape share them, which is safe in stream order (also under PDL:
    a GEMV touches them only after its grid dependency wait)."""
    wk, ck = (dev, split, M, N), (dev, blocks)
    if wk not in _SPLIT_WORK:
        _SPLIT_WORK[wk] = torch.empty(split * M * N, dtype=torch.float32, device=dev)
    if ck not in _SPLIT_WORK:
        _SPLIT_WORK[ck] = torch.zeros(blocks, dtype=torch.int32, device=dev)
    return _SPLIT_WORK[wk], _SPLIT_WORK[ck]


def gemv(x: Tensor, w: Tensor, b: Tensor | None = None, residual: Tensor | None = None, norm: Tensor | None = None,
         eps: float = 1e-6, act: str | None = None, config: GemvConfig | None = None,
         out_dtype: torch.dtype | None = None, pdl: bool = False) -> Tensor:
    """``y = linear(pro(x), w, b)`` (+ ``residual``) for ``M <= GEMV_MAX_M`` rows; semantics of
    :func:`oscarkv.kernels.reference.gemv_ref` (``norm``: fused RMSNorm weights; ``act="silu"``: x is ``[gate | up]``;
    ``out_dtype``: the result, rounded to x's dtype as always, stored as this dtype, e.g. float32 logits).
    ``pdl``: launched as a programmatic dependent (one row, "fma": the first weight tile is loaded before the
    grid dependency wait)."""
    M = x.shape[0]
    N, K = w.shape
    if act not in (None, "silu"):
        raise ValueError(f"act must be None or 'silu', got {act!r}")
    if norm is not None and act is not None:
        raise ValueError("gemv fuses either an RMSNorm or a SiLU gate into its input, not both")
    if x.dim() != 2 or x.shape[1] != (2 * K if act else K) or not 1 <= M <= GEMV_MAX_M:
        raise ValueError(f"gemv: x {tuple(x.shape)} does not fit weight {tuple(w.shape)} (act={act}) or has more "
                         f"than {GEMV_MAX_M} rows")
    if x.dtype != w.dtype:
        raise ValueError(f"gemv: x is {x.dtype}, weight {w.dtype}")
    if x.stride(1) != 1:
        x = x.contiguous()
    w = w.contiguous()
    y = torch.empty(M, N, dtype=out_dtype or x.dtype, device=x.device)
    if residual is not None and (residual.shape != y.shape or residual.stride(1) != 1):
        raise ValueError(f"gemv: residual {tuple(residual.shape)} does not match the output {tuple(y.shape)}")
    cfg = config or gemv_config(M, N, K, x.dtype)
    mp = max(16, _p2(M)) if cfg.kind == "dot" else _p2(M)
    blocks = triton.cdiv(N, cfg.block_n)
    split, ks = 1, K
    if cfg.split_k > 1:
        tiles = triton.cdiv(K, cfg.block_k)
        ks = triton.cdiv(tiles, min(cfg.split_k, tiles)) * cfg.block_k
        split = triton.cdiv(K, ks)  # every slice non-empty
    dummy = y
    ws, cnt = _split_buffers(x.device, split, M, N, blocks) if split > 1 else (dummy, dummy)
    args = (x, w, b if b is not None else dummy, residual if residual is not None else dummy,
            norm if norm is not None else dummy, y, ws, cnt, M, N, K, ks, x.stride(0), w.stride(0),
            residual.stride(0) if residual is not None else 0, y.stride(0), eps)
    meta = {"MP": mp, "BN": cfg.block_n, "BK": cfg.block_k, "PRO": 1 if norm is not None else (2 if act else 0),
                "HAS_BIAS": b is not None, "HAS_RES": residual is not None,
                "EVEN": N % cfg.block_n == 0 and K % cfg.block_k == 0, "SPLIT": split, "num_warps": cfg.num_warps,
                "num_stages": cfg.num_stages, "pdl": pdl and pdl_available(x)}
    grid = (blocks, split)
    if cfg.kind == "fma":
        _launch(_gemv_fma_kernel, grid, *args, V=min(cfg.block_k, 16 // x.element_size()), **meta)
    else:
        _launch(_gemv_dot_kernel, grid, *args, PREC="ieee" if x.dtype == torch.float32 else "tf32", **meta)
    return y


__all__ = ["GEMV_CONFIGS", "GEMV_MAX_M", "GemvConfig", "gemv", "gemv_config"]
