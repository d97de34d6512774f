"""Triton kernels of :mod:`oscarkv.engine.ops` (CUDA; the interpreter runs them on CPU for tests).

Shapes and semantics are those of the PyTorch functions in ``ops.py``; these only fuse the elementwise work so
that a CUDA-graph decode step is not dominated by launch gaps.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

try:  # grid dependency control (Triton >= 3.4): griddepcontrol.wait / .launch_dependents on sm_90+
    from triton.language.extra.cuda import gdc_launch_dependents as _gdc_launch, gdc_wait as _gdc_wait

    HAS_GDC = True
except ImportError:  # older Triton: no programmatic dependent launch (``pdl_available`` is False)
    HAS_GDC = False

    @triton.jit
    def _gdc_wait():
        pass

    @triton.jit
    def _gdc_launch():
        pass

try:
    from triton.language.extra import libdevice as _libdevice
except ImportError:  # pragma: no cover
    _libdevice = None


def _p2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=16)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def pdl_available(t: Tensor) -> bool:
    """Whether kernels on ``t``'s device can be programmatic dependent launches: a CUDA tensor on sm_90+, a
    Triton with grid dependency control, not the CPU interpreter. Everywhere else ``pdl=True`` is a no-op."""
    if not (HAS_GDC and t.is_cuda) or _interpreting():
        return False
    return _capability(t.device.index if t.device.index is not None else torch.cuda.current_device())[0] >= 9


def _launch(kernel, grid, *args, pdl: bool = False, **meta) -> None:
    """Every kernel of this module is launched here. ``pdl``: compile the kernel's grid dependency control
    (constexpr ``PDL``: it waits for the previous kernel on the stream before touching memory that kernel
    writes or reads, and lets the next one launch early) and launch it as a programmatic dependent
    (``launch_pdl``: it may start while the previous kernel drains; in a CUDA graph, a programmatic edge)."""
    if pdl:
        meta["launch_pdl"] = True
    kernel[grid](*args, PDL=pdl, **meta)


@triton.jit
def _pdl_enter(PDL: tl.constexpr):
    """Start of a kernel with nothing to do before its inputs are ready: wait for the previous kernel, then let
    the next one be scheduled (it waits in turn, so launching it early is safe)."""
    if PDL:
        _gdc_wait()
        _gdc_launch()


@triton.jit
def _rmsnorm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, h_ptr, D, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr,
                    PDL: tl.constexpr):
    _pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < D
    x = tl.load(x_ptr + row * D + cols, mask=m, other=0.0)
    if HAS_RES:
        x = x + tl.load(r_ptr + row * D + cols, mask=m, other=0.0)
        tl.store(h_ptr + row * D + cols, x, mask=m)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / D + eps)
    w = tl.load(w_ptr + cols, mask=m, other=0.0)
    tl.store(y_ptr + row * D + cols, w * (xf * inv).to(x.dtype), mask=m)


def rmsnorm(x: Tensor, w: Tensor, eps: float, residual: Tensor | None = None,
            pdl: bool = False) -> tuple[Tensor, Tensor]:
    x = x.contiguous()
    D = x.shape[-1]
    y = torch.empty_like(x)
    h = torch.empty_like(x) if residual is not None else x
    _launch(_rmsnorm_kernel, (x.numel() // D,), x, residual if residual is not None else x, w, y, h, D, eps,
            HAS_RES=residual is not None, BLOCK=_p2(D), num_warps=4, pdl=pdl and pdl_available(x))
    return y, h


@triton.jit
def _silu_mul_kernel(gu_ptr, o_ptr, I, BLOCK: tl.constexpr, PDL: tl.constexpr):
    _pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < I
    g = tl.load(gu_ptr + row * 2 * I + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * 2 * I + I + cols, mask=m, other=0.0)
    s = (g / (1.0 + tl.exp(-g))).to(u.dtype)
    tl.store(o_ptr + row * I + cols, s * u, mask=m)


def silu_mul(gu: Tensor, pdl: bool = False) -> Tensor:
    gu = gu.contiguous()
    N, I2 = gu.shape
    out = torch.empty(N, I2 // 2, dtype=gu.dtype, device=gu.device)
    BLOCK = 1024
    _launch(_silu_mul_kernel, (N, triton.cdiv(I2 // 2, BLOCK)), gu, out, I2 // 2, BLOCK=BLOCK, num_warps=4,
            pdl=pdl and pdl_available(gu))
    return out


@triton.jit
def _qk_prep_kernel(qkv_ptr, cos_ptr, sin_ptr, qn_ptr, kn_ptr, r_ptr, mu_ptr, q_ptr, kv_ptr, dst_ptr, off_ptr,
                    s_which, s_head, N, eps, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                    NORM: tl.constexpr, ROT: tl.constexpr, POOL: tl.constexpr, PDL: tl.constexpr):
    """One program per (token, head) of q, k and v: norm, RoPE, center + rotate (keys), rotate (queries).
    With ``POOL`` the token's k/v rows go straight into the KV pool at ``dst + which * s_which + off[t] +
    head * s_head`` (cast to the pool dtype) instead of into ``kv``."""
    _pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    W: tl.constexpr = (HQ + 2 * HKV) * D
    cols = tl.arange(0, D)
    x = tl.load(qkv_ptr + t * W + h * D + cols)
    if h >= HQ + HKV:  # value head: copy
        if POOL:
            off = tl.load(off_ptr + t)
            tl.store(dst_ptr + s_which + off + (h - HQ - HKV) * s_head + cols, x.to(dst_ptr.dtype.element_ty))
        else:
            tl.store(kv_ptr + (N + t) * HKV * D + (h - HQ - HKV) * D + cols, x)
    else:
        is_q = h < HQ
        dt = x.dtype
        half: tl.constexpr = D // 2
        rot_cols = tl.where(cols < half, cols + half, cols - half)
        xr = tl.load(qkv_ptr + t * W + h * D + rot_cols)
        if NORM:
            xf = x.to(tl.float32)
            inv = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / D + eps)
            w = tl.where(is_q, tl.load(qn_ptr + cols), tl.load(kn_ptr + cols))
            wr = tl.where(is_q, tl.load(qn_ptr + rot_cols), tl.load(kn_ptr + rot_cols))
            x = w * (xf * inv).to(dt)
            xr = wr * (xr.to(tl.float32) * inv).to(dt)
        xr = tl.where(cols < half, -xr, xr)
        c = tl.load(cos_ptr + t * D + cols)
        s = tl.load(sin_ptr + t * D + cols)
        x = (x * c + xr * s).to(dt)
        kvh = tl.where(is_q, h // (HQ // HKV), h - HQ)
        if ROT:
            xf = x.to(tl.float32) - tl.where(is_q, 0.0, tl.load(mu_ptr + kvh * D + cols))
            r = tl.load(r_ptr + kvh * D * D + cols[:, None] * D + cols[None, :])  # [D, D] float32
            x = tl.sum(xf[:, None] * r, 0).to(dt)
        if is_q:
            tl.store(q_ptr + t * HQ * D + h * D + cols, x)
        elif POOL:
            off = tl.load(off_ptr + t)
            tl.store(dst_ptr + off + (h - HQ) * s_head + cols, x.to(dst_ptr.dtype.element_ty))
        else:
            tl.store(kv_ptr + t * HKV * D + (h - HQ) * D + cols, x)


def qk_prep(qkv, hq, hkv, d, cos, sin, qn, kn, eps, r_k=None, mu_k=None, out=None,
            pdl: bool = False) -> tuple[Tensor, Tensor | None]:
    """As :func:`ops.qk_prep`; with ``out`` (an :class:`ops.KVDest`) the k/v rows are stored into the pool
    and the second result is ``None``."""
    qkv = qkv.contiguous()
    N = qkv.shape[0]
    q = torch.empty(N, hq, d, dtype=qkv.dtype, device=qkv.device)
    dummy = qkv
    if out is not None:
        if out.dst.stride(-1) != 1 or out.off.dtype != torch.int64 or out.off.numel() < N:
            raise ValueError("KVDest needs a destination with unit stride on head_dim and int64 offsets per token")
        kv, dst, off, s_which, s_head = dummy, out.dst, out.off, out.s_which, out.s_head
    else:
        kv = torch.empty(2, N, hkv, d, dtype=qkv.dtype, device=qkv.device)
        dst, off, s_which, s_head = dummy, dummy, 0, 0
    _launch(_qk_prep_kernel, (N, hq + 2 * hkv),
            qkv, cos.contiguous(), sin.contiguous(), qn if qn is not None else dummy, kn if kn is not None else dummy,
            r_k.contiguous() if r_k is not None else dummy, mu_k.contiguous() if mu_k is not None else dummy, q, kv,
            dst, off, s_which, s_head, N, eps, HQ=hq, HKV=hkv, D=d, NORM=qn is not None, ROT=r_k is not None,
            POOL=out is not None, num_warps=4, pdl=pdl and pdl_available(qkv))
    return q, (None if out is not None else kv)


@triton.jit
def _paged_decode_kernel(q_ptr, kv_ptr, bt_ptr, len_ptr, o_ptr, lse_ptr, sm_scale, s_bt, s_kv2, s_kvp, s_kvh,
                         PPS, HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                         P: tl.constexpr, NSPLIT: tl.constexpr, PDL: tl.constexpr):
    """Split-K over pages: program (split, b * HKV + h) covers pages [split * pps, (split + 1) * pps) of sequence
    b, with pps its own pages over the NSPLIT splits (at most PPS, the grid's bound): a sequence shorter than the
    bound the grid was made for (a captured graph's max_len) still spreads over every split."""
    _pdl_enter(PDL)
    sp = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // HKV
    h = bh % HKV
    n = tl.load(len_ptr + b)
    rows = tl.arange(0, GP)
    cols = tl.arange(0, D)
    qm = rows < G
    q = tl.load(q_ptr + (b * HKV * G + h * G + rows[:, None]) * D + cols[None, :], mask=qm[:, None], other=0.0)
    m_i = tl.full([GP], -1e30, tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    toks = tl.arange(0, P)
    pps = tl.minimum(tl.cdiv(tl.cdiv(n, P), NSPLIT), PPS)
    for i in range(pps):
        pg = sp * pps + i
        if pg * P < n:
            page = tl.load(bt_ptr + b * s_bt + pg).to(tl.int64)
            base = kv_ptr + page * s_kvp + h * s_kvh + toks[:, None] * D + cols[None, :]
            k = tl.load(base)
            v = tl.load(base + s_kv2)
            s = tl.dot(q, tl.trans(k)).to(tl.float32) * sm_scale
            s = tl.where((pg * P + toks)[None, :] < n, s, -1e30)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
            m_i = m_new
    out = acc / tl.maximum(l_i, 1e-30)[:, None]
    lse = tl.where(l_i > 0, m_i + tl.log(tl.maximum(l_i, 1e-30)), -1e30)
    o_off = ((b * HKV * G + h * G + rows) * NSPLIT + sp).to(tl.int64)
    tl.store(o_ptr + o_off[:, None] * D + cols[None, :], out, mask=qm[:, None])
    tl.store(lse_ptr + o_off, lse, mask=qm)


@triton.jit
def _merge_kernel(o_ptr, lse_ptr, out_ptr, NSPLIT: tl.constexpr, SP: tl.constexpr, D: tl.constexpr,
                  PDL: tl.constexpr):
    _pdl_enter(PDL)
    r = tl.program_id(0).to(tl.int64)  # b * Hq + j
    s = tl.arange(0, SP)
    cols = tl.arange(0, D)
    sm = s < NSPLIT
    lse = tl.load(lse_ptr + r * NSPLIT + s, mask=sm, other=-1e30)
    mx = tl.max(lse, 0)
    w = tl.where(sm & (lse > -1e29), tl.exp(lse - mx), 0.0)
    o = tl.load(o_ptr + (r * NSPLIT + s)[:, None] * D + cols[None, :], mask=sm[:, None], other=0.0)
    tot = tl.maximum(tl.sum(w, 0), 1e-30)
    tl.store(out_ptr + r * D + cols, (tl.sum(o * w[:, None], 0) / tot).to(out_ptr.dtype.element_ty))


_WORK: dict = {}


def paged_decode(q: Tensor, kv: Tensor, block_table: Tensor, lens: Tensor, sm_scale: float,
                 max_len: int | None = None, pdl: bool = False) -> Tensor:
    """Graph-safe: the grid depends on ``max_len`` (tokens a sequence may hold), not on ``lens``. ``pdl``: both
    kernels as programmatic dependents (the merge kernel of the split kernel)."""
    B, Hq, d = q.shape
    _, npages, Hkv, P, _ = kv.shape
    g = Hq // Hkv
    max_pages = math.ceil((max_len or block_table.shape[1] * P) / P)
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 4
    want = max(1, math.ceil(4 * sms / (B * Hkv)))
    pps = max(1, math.ceil(max_pages / min(want, max_pages)))
    nsplit = math.ceil(max_pages / pps)
    key = (B, Hq, d, nsplit, q.device)
    if key not in _WORK:  # persistent workspace: a captured graph keeps pointing at it
        _WORK[key] = (torch.empty(B * Hq * nsplit, d, dtype=torch.float32, device=q.device),
                      torch.empty(B * Hq * nsplit, dtype=torch.float32, device=q.device))
    o, lse = _WORK[key]
    out = torch.empty_like(q)
    q = q.contiguous()
    pdl = pdl and pdl_available(q)
    _launch(_paged_decode_kernel, (nsplit, B * Hkv),
            q, kv, block_table, lens, o, lse, sm_scale, block_table.stride(0), kv.stride(0), kv.stride(1),
            kv.stride(2), pps, HKV=Hkv, G=g, GP=max(16, _p2(g)), D=d, P=P, NSPLIT=nsplit, num_warps=4, num_stages=2,
            pdl=pdl)
    _launch(_merge_kernel, (B * Hq,), o, lse, out, NSPLIT=nsplit, SP=_p2(nsplit), D=d, num_warps=4, pdl=pdl)
    return out


# ------------------------------------------------------------------------------------ decode step prologue
@triton.jit
def _embed_rope_kernel(tok_ptr, pos_ptr, emb_ptr, f_ptr, x_ptr, cos_ptr, sin_ptr, D, scaling, HD: tl.constexpr,
                       BLOCK: tl.constexpr, HB: tl.constexpr, SCALE: tl.constexpr, PRECISE: tl.constexpr,
                       PDL: tl.constexpr):
    """One program per token: its embedding row, and ``cos/sin(pos * inv_freq2)`` (``* scaling``) ``[HD]``,
    computed in float32 and rounded to the embedding dtype, as ``Transformer.forward``'s torch ops do them
    (``PRECISE``: libdevice's cosf / sinf, those of torch's CUDA kernels; the interpreter has only tl.cos)."""
    _pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    tok = tl.load(tok_ptr + t).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < D
    tl.store(x_ptr + t * D + cols, tl.load(emb_ptr + tok * D + cols, mask=m), mask=m)
    j = tl.arange(0, HB)
    mj = j < HD
    e = tl.load(pos_ptr + t).to(tl.float32) * tl.load(f_ptr + j, mask=mj, other=0.0)
    if PRECISE:
        c = _libdevice.cos(e)
        sn = _libdevice.sin(e)
    else:
        c = tl.cos(e)
        sn = tl.sin(e)
    if SCALE:
        c = c * scaling
        sn = sn * scaling
    dt = x_ptr.dtype.element_ty
    tl.store(cos_ptr + t * HD + j, c.to(dt), mask=mj)
    tl.store(sin_ptr + t * HD + j, sn.to(dt), mask=mj)


def embed_rope(tokens: Tensor, positions: Tensor, emb: Tensor, inv_freq2: Tensor, scaling: float = 1.0,
               pdl: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """``(embed(tokens), cos, sin)`` of a step in one launch instead of six torch ops: ``emb`` ``[V, D]``,
    ``inv_freq2`` float32 ``[d]`` (both halves); cos/sin ``[N, d]`` in the embedding dtype."""
    N, (V, D), hd = tokens.shape[0], emb.shape, inv_freq2.shape[0]
    x = torch.empty(N, D, dtype=emb.dtype, device=emb.device)
    cos = torch.empty(N, hd, dtype=emb.dtype, device=emb.device)
    sin = torch.empty_like(cos)
    _launch(_embed_rope_kernel, (N,), tokens.contiguous(), positions.contiguous(), emb.contiguous(),
            inv_freq2.float().contiguous(), x, cos, sin, D, float(scaling), HD=hd, BLOCK=_p2(D), HB=_p2(hd),
            SCALE=float(scaling) != 1.0, PRECISE=_libdevice is not None and not _interpreting(), num_warps=4,
            pdl=pdl and pdl_available(emb))
    return x, cos, sin


# -------------------------------------------------------------------------------------------- decode GEMV
GEMV_MAX_M = 8  # rows up to which the decode GEMV runs (beyond: cuBLAS, which is compute-efficient there)


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


# (padded rows, N, K) -> config; benchmarks/gemv_probe.py --sweep prints entries measured on a GPU
GEMV_CONFIGS: dict[tuple[int, int, int], GemvConfig] = {}


def _fma1(split: int = 1, bn: int = 16, bk: int = 1024, nw: int = 4) -> GemvConfig:
    return GemvConfig("fma", bn, bk, nw, 1, split_k=split)


# Named one-row configurations per decode projection (None: gemv_config's heuristic), to compare on a GPU in a
# chain (benchmarks/pdl_probe.py) and in the whole step (bench_e2e.py --pdl on:NAME, which enters them into
# GEMV_CONFIGS for the model's shapes). Not measured yet: no default uses them.
GEMV_SETS: dict[str, dict[str, GemvConfig | None]] = {
    "default": {"qkv": None, "o_proj": None, "gate_up": None, "down": None},
    # about 2-4x the programs of the default on the small projections (8B: 768 / 1024 / 1024)
    "splitk": {"qkv": _fma1(2), "o_proj": _fma1(4), "gate_up": None, "down": _fma1(4)},
    # one 16 x 1024 tile per program on the small ones: with PDL all of a program's weights load before the wait
    "splitk1": {"qkv": _fma1(4), "o_proj": _fma1(4), "gate_up": None, "down": _fma1(12)},
    # narrower tiles instead (the gemv_probe sweep's best for qkv / o_proj in isolation): gemv_config's choice
    # for the 8B shapes since session 15 (and "bn8d2" for the 4B ones)
    "bn8": {"qkv": _fma1(1, 8), "o_proj": _fma1(1, 8), "gate_up": None, "down": _fma1(1, 16, 2048, 8)},
    # variations of bn8 (H200, session 15, 8B chains: bn8g and bn4 equal to bn8, bn8d / bn8d2 slower; bn8lm's
    # lm_head on the dot tile 0.05-0.07 ms slower in the whole step)
    "bn8g": {"qkv": _fma1(1, 8), "o_proj": _fma1(1, 8), "gate_up": _fma1(1, 8), "down": _fma1(1, 16, 2048, 8)},
    "bn8d": {"qkv": _fma1(1, 8), "o_proj": _fma1(1, 8), "gate_up": None, "down": _fma1(1, 8)},
    "bn8d2": {"qkv": _fma1(1, 8), "o_proj": _fma1(1, 8), "gate_up": None, "down": _fma1(1, 8, 2048, 8)},
    "bn4": {"qkv": _fma1(1, 4), "o_proj": _fma1(1, 4), "gate_up": None, "down": _fma1(1, 16, 2048, 8)},
    # on top of session 15's heuristic (None): 2048-wide 8-warp tiles for gate_up, or for qkv and o_proj (H200,
    # 8B chains: gu2k slower, 3.772 vs 3.525 ms; qo2k 3.479 in the gemv chain but 3.944 vs 3.891 in the layer one)
    "gu2k": {"qkv": None, "o_proj": None, "gate_up": _fma1(1, 16, 2048, 8), "down": None},
    "qo2k": {"qkv": _fma1(1, 8, 2048, 8), "o_proj": _fma1(1, 8, 2048, 8), "gate_up": None, "down": None},
    "bn8lm": {"qkv": _fma1(1, 8), "o_proj": _fma1(1, 8), "gate_up": None, "down": _fma1(1, 16, 2048, 8),
              "lm_head": GemvConfig("dot", 64, 128, 4, 3)},
}


def gemv_config(M: int, N: int, K: int, dtype: torch.dtype = torch.bfloat16) -> GemvConfig:
    """The tuned entry for the shape if there is one, else a heuristic. One row, "fma": 8 x 1024 tiles, 4 warps,
    for up to 8192 outputs (twice the programs of 16-row tiles on the small projections: 8B qkv / o_proj 768 /
    512), 16 x 1024 above (gate_up, lm_head); rows of 8192 and more (down) 2048-wide tiles, 8 warps, 16 rows
    from 4096 outputs, else 8. Measured on the H200 in the 36-layer PDL chains (``benchmarks/pdl_probe.py``,
    docs/results/pdl_probe_s15_h200.log: the sets "bn8" for 8B, "bn8d2" for 4B): 8B gemv chain 3.735 ->
    3.531 ms (1.26 -> 1.20x its weight floor), 4B 2.349 -> 2.176 ms, against 16 x 1024 everywhere (the 8B
    down kept at 16 x 2048: 8 rows there measured slower, 3.616 ms). More rows: "dot" 16 x 256, 4 stages (49 KB
    of shared memory)."""
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
    :func:`oscarkv.engine.ops.gemv_torch` (``norm``: fused RMSNorm weights; ``act="silu"``: x is ``[gate | up]``;
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
    meta = dict(MP=mp, BN=cfg.block_n, BK=cfg.block_k, PRO=1 if norm is not None else (2 if act else 0),
                HAS_BIAS=b is not None, HAS_RES=residual is not None,
                EVEN=N % cfg.block_n == 0 and K % cfg.block_k == 0, SPLIT=split, num_warps=cfg.num_warps,
                num_stages=cfg.num_stages, pdl=pdl and pdl_available(x))
    grid = (blocks, split)
    if cfg.kind == "fma":
        _launch(_gemv_fma_kernel, grid, *args, V=min(cfg.block_k, 16 // x.element_size()), **meta)
    else:
        _launch(_gemv_dot_kernel, grid, *args, PREC="ieee" if x.dtype == torch.float32 else "tf32", **meta)
    return y


__all__ = ["rmsnorm", "silu_mul", "qk_prep", "paged_decode", "embed_rope", "gemv", "GemvConfig", "GEMV_CONFIGS",
           "GEMV_SETS", "GEMV_MAX_M", "gemv_config", "pdl_available", "HAS_GDC"]
