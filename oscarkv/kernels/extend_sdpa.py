"""Prefill/extend over a quantized prefix through cuDNN's fused attention (the default path of
:func:`~oscarkv.kernels.extend_triton.extend_attention_triton` for long chunks on CUDA).

Per sequence, the stored prefix is attended in segments of at most ``segment_tokens`` tokens: a segment's
quantized pages are dequantized (:func:`~oscarkv.kernels.dequant_triton.dequant_pages_into`, the fused kernel's
values ``o + c s`` rounded once to float16, stored in the query's 16-bit dtype) into a bounded, reused workspace,
the 16-bit tiers copied in front of the first segment, and cuDNN attention runs over it with its log-sum-exp. The
prefix is not causal, so the GQA group folds into the query rows (``[Hkv, T G, d]``: one K/V head per query
head group, no repetition). The chunk attends to itself causally in one cuDNN call for the whole batch. The
partial outputs are merged by their log-sum-exps (:func:`_merge_kernel`), which also writes the output in the
query's layout.

What it costs: a transient workspace of ``2 Hkv (segment_tokens + C16) d`` 16-bit values (at most 134 MB at the
default 32768 tokens, 8 KV heads, d 128), the prefix lengths on the host (``host_lengths``; read from the
device, one synchronisation, when not given), and bfloat16 queries see a bfloat16 rounding of the dequantized
rows (the fused kernel keeps float16): the same error budget (1e-2 with bfloat16 inputs). Why and when it is
faster than the fused kernel: docs/kernels.md.
"""

from __future__ import annotations

import warnings

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._triton_util import interpreting
from .dequant_triton import dequant_pages_into
from .layout import QuantPages

SEGMENT_TOKENS = 32768


def min_chunk(batch: int) -> int:
    """Chunk tokens per sequence from which the default takes the cuDNN fold for ``batch`` sequences: 16 for one
    sequence, ``128 B`` for more (the cuDNN fold handles one sequence at a time, so with several short chunks the
    fused kernel, parallel over sequences, is faster; crossover measured on the H200, docs/kernels.md)."""
    return 16 if batch <= 1 else 128 * batch


# (device index, dtype, d) -> the error, once cuDNN attention failed there (the default then takes the fused kernel)
_CUDNN_BROKEN: dict[tuple, str] = {}


def sdpa_supported(q: Tensor, d: int, host_lengths: bool = False) -> bool:
    """Whether the cuDNN fold is the default for this query ``[B, T, Hq, d]``: a chunk of at least
    :func:`min_chunk` ``(B)`` tokens (the cuDNN fold handles one sequence at a time, so with several short
    chunks the fused kernel, parallel over sequences, is faster), CUDA (not the interpreter; inside CUDA-graph
    capture only with ``host_lengths``, since the prefix lengths are host integers), cuDNN attention enabled,
    sm_80 or newer, ``d <= 128`` and a multiple of 8 (cuDNN's fused attention), and no earlier failure there."""
    if q.device.type != "cuda" or interpreting() or q.shape[1] < min_chunk(q.shape[0]):
        return False
    if torch.cuda.is_current_stream_capturing() and not host_lengths:
        return False
    if not (torch.backends.cudnn.is_available() and torch.backends.cuda.cudnn_sdp_enabled()):
        return False
    if torch.cuda.get_device_capability(q.device) < (8, 0) or d > 128 or d % 8:
        return False
    return (q.device.index, _work_dtype(q.dtype), d) not in _CUDNN_BROKEN


def _work_dtype(dt: torch.dtype) -> torch.dtype:
    return torch.bfloat16 if dt == torch.bfloat16 else torch.float16


def _attend_lse(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool) -> tuple[Tensor, Tensor]:
    """Attention with its natural-log log-sum-exp: q ``[B, H, M, d]``, k/v ``[B, H, N, d]`` (same heads).
    Returns ``o [B, H, M, d]`` and ``lse [B, H, M]`` (float32). CUDA: cuDNN; elsewhere (the interpreter
    tests) float32 math."""
    if q.device.type == "cuda":
        o, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False,
                                                                    scale=scale)[:2]
        return o, lse.reshape(q.shape[:3])
    s = torch.einsum("bhmd,bhnd->bhmn", q.float(), k.float()) * scale
    if causal:
        keep = torch.ones(s.shape[-2:], dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, -1)
    o = torch.einsum("bhmn,bhnd->bhmd", torch.exp(s - lse[..., None]), v.float())
    return o, lse


@triton.jit
def _merge_kernel(oa_ptr, la_ptr, ob_ptr, lb_ptr, out_ptr, lo_ptr, n_rows, HQ, G,
                  sa_t, sa_h, sa_g, ta_t, ta_h, ta_g, sb_t, sb_h, sb_g, tb_t, tb_h, tb_g,
                  so_t, so_h, so_g, to_t, to_h, to_g,
                  D: tl.constexpr, BLOCK_R: tl.constexpr, HAS_B: tl.constexpr, WRITE_LSE: tl.constexpr):
    """Two normalised partial outputs and their log-sum-exps -> ``(wa o_a + wb o_b) / (wa + wb)``, ``w = exp(lse
    - max)``, and optionally the merged log-sum-exp. Rows are (token ``t``, query head ``h G + g``) pairs; each
    tensor has its own (t, h, g) strides (``s*``: outputs, ``t*``: log-sum-exps), so the folded ``[Hkv, T G]``
    prefix partials, the ``[Hq, T]`` chunk partial and the ``[T, Hq]`` output all read in place. A row whose
    both partials are empty (log-sum-exp ``-inf``) gets zeros."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rm = r < n_rows
    t = (r // HQ).to(tl.int64)
    hq = r % HQ
    h = (hq // G).to(tl.int64)
    g = (hq % G).to(tl.int64)
    dcol = tl.arange(0, D)
    m2 = rm[:, None]
    la = tl.load(la_ptr + t * ta_t + h * ta_h + g * ta_g, mask=rm, other=float("-inf")).to(tl.float32)
    oa = tl.load(oa_ptr + (t * sa_t + h * sa_h + g * sa_g)[:, None] + dcol[None, :], mask=m2, other=0.0)
    if HAS_B:
        lb = tl.load(lb_ptr + t * tb_t + h * tb_h + g * tb_g, mask=rm, other=float("-inf")).to(tl.float32)
        ob = tl.load(ob_ptr + (t * sb_t + h * sb_h + g * sb_g)[:, None] + dcol[None, :], mask=m2, other=0.0)
        m = tl.maximum(la, lb)
        m = tl.where(m > float("-inf"), m, 0.0)
        wa = tl.exp(la - m)
        wb = tl.exp(lb - m)
        den = wa + wb
        full = den > 0.0
        den = tl.where(full, den, 1.0)
        inv = tl.where(full, 1.0 / den, 0.0)
        o = (oa.to(tl.float32) * (wa * inv)[:, None] + ob.to(tl.float32) * (wb * inv)[:, None])
        lse = tl.where(full, m + tl.log(den), float("-inf"))
    else:
        o = tl.where((la > float("-inf"))[:, None], oa.to(tl.float32), 0.0)
        lse = la
    tl.store(out_ptr + (t * so_t + h * so_h + g * so_g)[:, None] + dcol[None, :], o.to(out_ptr.dtype.element_ty),
             mask=m2)
    if WRITE_LSE:
        tl.store(lo_ptr + t * to_t + h * to_h + g * to_g, lse, mask=rm)


def _folded(o: Tensor, lse: Tensor, G: int) -> tuple[tuple, tuple]:
    """(t, h, g) strides of a prefix partial ``o [1, Hkv, T G, d]``, ``lse [1, Hkv, T G]`` (row ``t G + g``)."""
    return ((G * o.stride(2), o.stride(1), o.stride(2)), (G * lse.stride(2), lse.stride(1), lse.stride(2)))


def _by_head(o: Tensor, lse: Tensor, G: int) -> tuple[tuple, tuple]:
    """(t, h, g) strides of the chunk partial ``o [Hq, T, d]``, ``lse [Hq, T]`` (head ``h G + g``)."""
    return ((o.stride(1), G * o.stride(0), o.stride(0)), (lse.stride(1), G * lse.stride(0), lse.stride(0)))


def _merge(a, b, out: Tensor, out_strides: tuple, lse_out: Tensor | None, lse_strides: tuple, T: int, hq: int,
           G: int, d: int) -> None:
    """Launch :func:`_merge_kernel`: ``a``/``b`` = (o, lse, o strides, lse strides); ``b`` may be None."""
    oa, la, sa, ta = a
    ob, lb, sb, tb = b if b is not None else a
    n = T * hq
    block_r = max(1, min(64, 4096 // d))
    _merge_kernel[(triton.cdiv(n, block_r),)](
        oa, la, ob, lb, out, la if lse_out is None else lse_out, n, hq, G, *sa, *ta, *sb, *tb, *out_strides,
        *lse_strides, D=d, BLOCK_R=block_r, HAS_B=b is not None, WRITE_LSE=lse_out is not None, num_warps=4)


def extend_attention_sdpa(
    q: Tensor, k_new: Tensor, v_new: Tensor, k_pages: QuantPages, v_pages: QuantPages, block_table: Tensor,
    qlen: Tensor, k16: Tensor, v16: Tensor, len16: Tensor, sm_scale: float, out: Tensor, *,
    segment_tokens: int = SEGMENT_TOKENS, host_lengths: tuple[list[int], list[int]] | None = None,
) -> Tensor:
    """The cuDNN fold (module docstring); arguments already checked by the launcher, ``out [B, T, Hq, d]``
    allocated, ``sm_scale`` resolved. ``host_lengths``: ``(qlen, len16)`` as host integers (else read from the
    device)."""
    B, T, hq, d = q.shape
    fmt = k_pages.fmt
    hkv, ps = fmt.num_kv_heads, fmt.page_size
    G = hq // hkv
    if segment_tokens < ps:
        raise ValueError(f"segment_tokens must be at least the page size {ps}, got {segment_tokens}")
    if host_lengths is None:
        n2s, n16s = qlen.tolist(), len16.tolist()
    else:
        n2s, n16s = (list(map(int, x)) for x in host_lengths)
        if len(n2s) != B or len(n16s) != B:
            raise ValueError(f"host_lengths must hold {B} prefix and {B} tier lengths, got {len(n2s)}, {len(n16s)}")
    wdt = q.dtype  # 16-bit: the launcher has prescaled a float32 query to float16
    seg_pages = segment_tokens // ps
    maxp = block_table.shape[1]
    rows = min(seg_pages, maxp) * ps + max(n16s + [0])
    kw = torch.empty(1, hkv, rows, d, dtype=wdt, device=q.device)
    vw = torch.empty_like(kw)
    # the chunk, causally, for every sequence at once (heads repeated for the GQA group)
    kc = k_new.transpose(1, 2).to(wdt).repeat_interleave(G, 1)
    vc = v_new.transpose(1, 2).to(wdt).repeat_interleave(G, 1)
    oc, lc = _attend_lse(q.transpose(1, 2), kc, vc, sm_scale, True)  # [B, Hq, T, d], [B, Hq, T]
    del kc, vc
    osd = (out.stride(1), G * out.stride(2), out.stride(2))
    for b in range(B):
        n2, n16 = n2s[b], n16s[b]
        chunk = (oc[b], lc[b], *_by_head(oc[b], lc[b], G))
        if n2 + n16 == 0:
            _merge(chunk, None, out[b], osd, None, (0, 0, 0), T, hq, G, d)
            continue
        qg = q[b].view(T, hkv, G, d).transpose(0, 1).reshape(1, hkv, T * G, d)
        acc = None  # the prefix partial so far: a segment's own, or (from the second) a float32 running one
        npg = -(-n2 // ps)
        for si, p0 in enumerate(range(0, max(npg, 1), seg_pages)):
            front = n16 if si == 0 else 0
            if front:
                kw[0, :, :front].copy_(k16[b, :, :front])
                vw[0, :, :front].copy_(v16[b, :, :front])
            npages = min(seg_pages, npg - p0)
            if npages > 0:
                dequant_pages_into(k_pages, v_pages, block_table[b:b + 1], qlen[b:b + 1], kw[:, :, front:],
                                   vw[:, :, front:], npages, p0)
            nrow = front + max(0, min(npages * ps, n2 - p0 * ps))
            o, lse = _attend_lse(qg, kw[:, :, :nrow], vw[:, :, :nrow], sm_scale, False)
            part = (o, lse, *_folded(o, lse, G))
            if acc is None:
                acc = part
                continue
            if si == 1:  # the segment partials are 16-bit: merge into a float32 running partial (folded layout)
                ao = torch.empty(1, hkv, T * G, d, dtype=torch.float32, device=q.device)
                al = torch.empty(1, hkv, T * G, dtype=torch.float32, device=q.device)
                run = (ao, al, *_folded(ao, al, G))
            else:
                run = acc
            _merge(acc, part, run[0], run[2], run[1], run[3], T, hq, G, d)
            acc = run
        _merge(acc, chunk, out[b], osd, None, (0, 0, 0), T, hq, G, d)
    return out


def mark_cudnn_broken(q: Tensor, d: int, err: Exception) -> None:
    """Record that cuDNN attention failed for this (device, dtype, d), warning once: the default fold is then
    the fused kernel there."""
    key = (q.device.index, _work_dtype(q.dtype), d)
    if key not in _CUDNN_BROKEN:
        _CUDNN_BROKEN[key] = f"{type(err).__name__}: {err}"
        warnings.warn(f"extend: cuDNN attention failed ({_CUDNN_BROKEN[key][:200]}); using the fused Triton "
                      f"kernel for {q.dtype} queries with d={d} on this device", stacklevel=3)


__all__ = ["SEGMENT_TOKENS", "extend_attention_sdpa", "mark_cudnn_broken", "min_chunk", "sdpa_supported"]
