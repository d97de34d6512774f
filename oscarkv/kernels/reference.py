"""PyTorch references of every kernel op: the specification the kernels are tested against, and the
implementation used on CPU. Shapes follow :mod:`oscarkv.kernels.layout`; the dense decoder ops (norms, QK
preparation, GEMV, paged 16-bit decode) at the end."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from ..quant import QuantizedRows, clip_index, dequantize, pack, quantize, unpack
from .layout import QuantPages


def quantize_write_ref(
    pages: QuantPages,
    x: Tensor,
    slots: Tensor,
    *,
    rotation: Tensor | None = None,
    mean: Tensor | None = None,
    clip_ratio: float = 0.0,
) -> None:
    """Center, rotate, clip, quantize and pack rows ``x`` ``[N, Hkv, d]`` into ``slots`` (int64 ``[N]``,
    ``page * page_size + row``; a negative slot marks a padding row that is skipped, as in vLLM) of ``pages``,
    in place.

    ``mean``: ``[Hkv, d]`` subtracted first; ``rotation``: ``[d, d]`` or ``[Hkv, d, d]`` applied as ``x @ R``
    in float32. Bit-identical to :func:`oscarkv.quant.quantize` on the rotated rows.

    Channel pages (``pages.fmt.layout == "channel"``, keys): rows come in whole pages (see
    :func:`channel_page_ids`; a partial page raises ``ValueError``), no clipping (``clip_ratio`` must be 0);
    codes and metadata equal ``quantize_per_channel(x_page [Hkv, page_size, d], group_size=page_size)``.
    """
    fmt = pages.fmt
    if fmt.channel:
        page_ids = channel_page_ids(slots, fmt.page_size)  # validates before anything is written
    keep = slots >= 0
    if not bool(keep.all()):
        x, slots = x[keep], slots[keep]
    xf = x.to(torch.float32)
    if mean is not None:
        xf = xf - mean.to(torch.float32)
    if rotation is not None:
        r = rotation.to(torch.float32)
        xf = torch.einsum("nhd,de->nhe", xf, r) if r.ndim == 2 else torch.einsum("nhd,hde->nhe", xf, r)
    if fmt.channel:
        _write_channel_pages(pages, xf, page_ids[page_ids >= 0], clip_ratio)
        return
    q = quantize(xf, bits=fmt.bits, group_size=fmt.group_size, clip_ratio=clip_ratio, meta_dtype=fmt.meta_dtype,
                 check_finite=False)
    page = slots // fmt.page_size
    row = slots % fmt.page_size
    pages.codes[page, :, row] = q.packed
    pages.scale[page, :, row] = q.scale
    pages.offset[page, :, row] = q.offset


def channel_page_ids(slots: Tensor, page_size: int) -> Tensor:
    """Page ids ``[N / page_size]`` (int64, -1 = a skipped all-padding page) of a channel-page write.

    Channel pages are written whole: ``slots`` (``[N]``) must be consecutive runs ``page * page_size + (0 ..
    page_size - 1)``, each run one page, or runs of negative slots (padding, skipped). Raises ``ValueError``
    otherwise (a partially filled page cannot hold per-channel statistics of its tokens). Synchronises with
    the device (validation on the host).
    """
    n = slots.shape[0]
    if n % page_size:
        raise ValueError(f"channel pages are written whole: got {n} rows, not a multiple of page_size "
                         f"{page_size}; keep partial pages in the 16-bit tier until they are full")
    runs = slots.reshape(-1, page_size).to(torch.int64)
    pad = runs < 0
    first = runs[:, :1]
    whole = (first % page_size == 0) & (runs == first + torch.arange(page_size, device=slots.device)).all(1, True)
    ok = pad.all(1, True) | (~pad.any(1, True) & whole)
    if not bool(ok.all()):
        bad = int((~ok).nonzero()[0, 0])
        raise ValueError(f"channel pages are written whole: rows [{bad * page_size}, {(bad + 1) * page_size}) "
                         f"do not map to one whole page (slots must be page * {page_size} + 0..{page_size - 1} "
                         "in order, or all negative)")
    return torch.where(pad[:, 0], -1, first[:, 0] // page_size)


def _write_channel_pages(pages: QuantPages, xf: Tensor, page_ids: Tensor, clip_ratio: float) -> None:
    """``xf`` float32 ``[n * page_size, Hkv, d]`` (whole pages, in order) -> pages ``page_ids`` ``[n]``."""
    fmt = pages.fmt
    if clip_index(clip_ratio, fmt.head_dim) is not None:
        raise ValueError(f"channel pages are not clipped (KIVI per-channel keys); got clip_ratio {clip_ratio}: "
                         "pass 0")
    x = xf.reshape(-1, fmt.page_size, fmt.num_kv_heads, fmt.head_dim).permute(0, 2, 1, 3)  # [n, Hkv, ps, d]
    # == quantize_per_channel(x, bits, group_size=page_size, meta_dtype) (rows = channels), minus the NaN check
    q = quantize(x.transpose(-1, -2), bits=fmt.bits, group_size=fmt.page_size, meta_dtype=fmt.meta_dtype,
                 check_finite=False)
    codes = unpack(q.packed, fmt.bits).transpose(-1, -2)  # [n, Hkv, ps, d]
    pages.codes[page_ids] = pack(codes, fmt.bits)
    pages.scale[page_ids] = q.scale.transpose(-1, -2)
    pages.offset[page_ids] = q.offset.transpose(-1, -2)


def dequantize_pages_ref(pages: QuantPages, ids: Tensor) -> Tensor:
    """Dequantized pages ``ids`` (``[n]``) as float32 ``[n, Hkv, page_size, d]``, either layout
    (``offset + code * scale``, method section 3)."""
    fmt = pages.fmt
    ids = ids.long()
    if not fmt.channel:
        rows = QuantizedRows(packed=pages.codes[ids], scale=pages.scale[ids], offset=pages.offset[ids],
                             bits=fmt.bits, group_size=fmt.group, dim=fmt.head_dim)
        return dequantize(rows)
    codes = unpack(pages.codes[ids], fmt.bits).to(torch.float32)
    return pages.offset[ids].to(torch.float32) + codes * pages.scale[ids].to(torch.float32)


def demote_ref(
    k_pages: QuantPages,
    v_pages: QuantPages,
    k16: Tensor,
    v16: Tensor,
    seq_ids: Tensor,
    src_index: Tensor,
    slots: Tensor,
    *,
    k_clip: float = 0.0,
    v_clip: float = 0.0,
) -> None:
    """Demotion: quantize 16-bit-tier rows ``k16/v16[seq_ids[i], :, src_index[i]]`` (``[B, Hkv, C16, d]``,
    already centered and rotated) into ``slots[i]`` of the 2-bit pools, in place (no rotation, no centering)."""
    sid, idx = seq_ids.long(), src_index.long()
    quantize_write_ref(k_pages, k16[sid, :, idx], slots, clip_ratio=k_clip)
    quantize_write_ref(v_pages, v16[sid, :, idx], slots, clip_ratio=v_clip)


def gather_dequant_ref(pages: QuantPages, block_table: Tensor, b: int, ntok: int) -> Tensor:
    """Dequantized rows ``[Hkv, ntok, d]`` (float32) of the first ``ntok`` 2-bit-tier tokens of sequence ``b``."""
    fmt = pages.fmt
    if ntok == 0:
        return torch.zeros(fmt.num_kv_heads, 0, fmt.head_dim, device=pages.codes.device)
    npages = math.ceil(ntok / fmt.page_size)
    x = dequantize_pages_ref(pages, block_table[b, :npages])  # [npages, Hkv, page, d]
    return x.permute(1, 0, 2, 3).reshape(fmt.num_kv_heads, npages * fmt.page_size, fmt.head_dim)[:, :ntok]


def _stored_prefix(pages: QuantPages, buf16: Tensor, len16: Tensor, qlen: Tensor, block_table: Tensor, b: int,
                   dtype: torch.dtype) -> Tensor:
    """Sequence ``b``'s stored rows ``[Hkv, len16 + qlen, d]``: its 16-bit slots, then its dequantized 2-bit tier."""
    n16, nq = int(len16[b]), int(qlen[b])
    return torch.cat([buf16[b, :, :n16].to(dtype), gather_dequant_ref(pages, block_table, b, nq).to(dtype)], 1)


def _attend(q: Tensor, k: Tensor, v: Tensor, sm_scale: float, mask: Tensor | None = None) -> Tensor:
    """q ``[Hq, M, d]``, k/v ``[Hkv, N, d]`` (GQA by repetition), mask ``[M, N]`` bool (True = attend)."""
    g = q.shape[0] // k.shape[0]
    k = k.repeat_interleave(g, 0)
    v = v.repeat_interleave(g, 0)
    s = torch.einsum("hmd,hnd->hmn", q, k) * sm_scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.einsum("hmn,hnd->hmd", torch.softmax(s, dim=-1), v)


def decode_attention_ref(
    q: Tensor,
    k_pages: QuantPages,
    v_pages: QuantPages,
    block_table: Tensor,
    qlen: Tensor,
    k16: Tensor,
    v16: Tensor,
    len16: Tensor,
    sm_scale: float | None = None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """One query per sequence over its 16-bit tiers and 2-bit pages.

    q ``[B, Hq, d]`` (rotated); k16/v16 ``[B, Hkv, C16, d]`` with ``len16[b]`` valid slots; 2-bit tier of
    ``qlen[b]`` tokens through ``block_table``. Returns ``[B, Hq, d]`` in the rotated V basis, computed in
    ``dtype`` (float64 for test references). A sequence with no tokens at all gets zeros.
    """
    B, Hq, d = q.shape
    sm_scale = d**-0.5 if sm_scale is None else sm_scale
    out = torch.zeros(B, Hq, d, dtype=dtype, device=q.device)
    for b in range(B):
        k = _stored_prefix(k_pages, k16, len16, qlen, block_table, b, dtype)
        if k.shape[1] == 0:
            continue
        v = _stored_prefix(v_pages, v16, len16, qlen, block_table, b, dtype)
        out[b] = _attend(q[b].to(dtype).unsqueeze(1), k, v, sm_scale).squeeze(1)
    return out


def extend_attention_ref(
    q: Tensor,
    k_new: Tensor,
    v_new: Tensor,
    k_pages: QuantPages,
    v_pages: QuantPages,
    block_table: Tensor,
    qlen: Tensor,
    k16: Tensor,
    v16: Tensor,
    len16: Tensor,
    sm_scale: float | None = None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """A new chunk of ``T`` tokens per sequence attends causally to itself (16-bit ``k_new``/``v_new``
    ``[B, T, Hkv, d]``) and fully to the stored prefix (16-bit tiers + 2-bit pages), as stored.

    q ``[B, T, Hq, d]`` (rotated). Returns ``[B, T, Hq, d]`` in the rotated V basis.
    """
    B, T, Hq, d = q.shape
    sm_scale = d**-0.5 if sm_scale is None else sm_scale
    out = torch.zeros(B, T, Hq, d, dtype=dtype, device=q.device)
    for b in range(B):
        kp = _stored_prefix(k_pages, k16, len16, qlen, block_table, b, dtype)
        vp = _stored_prefix(v_pages, v16, len16, qlen, block_table, b, dtype)
        k = torch.cat([kp, k_new[b].transpose(0, 1).to(dtype)], 1)
        v = torch.cat([vp, v_new[b].transpose(0, 1).to(dtype)], 1)
        npre = kp.shape[1]
        mask = torch.ones(T, npre + T, dtype=torch.bool, device=q.device)
        mask[:, npre:] = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        out[b] = _attend(q[b].transpose(0, 1).to(dtype), k, v, sm_scale, mask).transpose(0, 1)
    return out




def rotate_rows_ref(
    x: Tensor, r: Tensor, mu: Tensor | None = None, *, out: Tensor | None = None, transpose: bool = False,
    mean_after: bool = False, rows_out: Tensor | None = None, rows: Tensor | None = None,
) -> Tensor | None:
    """``y[n, h] = (x[n, h] - mu[h // G]) @ R[h // G]`` in float32 (``G = Hx / H``); ``transpose``: ``@ R^T``;
    ``mean_after``: ``+ mu`` after the product instead of ``- mu`` before. Written, cast, to ``out [N, Hx, d]``
    and/or to rows ``rows [N]`` of ``rows_out [M, Hx, d]``; returns ``out``, or the float32 product without it."""
    N, hx, d = x.shape
    H = r.shape[0]
    xg = x.to(r.dtype).view(N, H, hx // H, d)  # float32 (r's dtype; float64 for exact references in tests)
    if mu is not None and not mean_after:
        xg = xg - mu[None, :, None]
    y = torch.einsum("nhge,hde->nhgd" if transpose else "nhgd,hde->nhge", xg, r)
    if mu is not None and mean_after:
        y = y + mu[None, :, None]
    y = y.reshape(N, hx, d)
    if out is not None:
        out.copy_(y)
    if rows_out is not None:
        rows_out.index_copy_(0, rows, y.to(rows_out.dtype))
    return y if out is None else out


# ------------------------------------------------------------------- dense ops of the decoder (engine)
def rmsnorm_ref(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """HF's RMSNorm: normalise in float32, cast back, then scale. x ``[..., D]``."""
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rope_ref(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x ``[N, H, d]``, cos/sin ``[N, d]`` (rotate-half convention)."""
    h = x.shape[-1] // 2
    return x * cos[:, None] + torch.cat((-x[..., h:], x[..., :h]), dim=-1) * sin[:, None]


def qk_prep_ref(qkv: Tensor, hq: int, hkv: int, d: int, cos: Tensor, sin: Tensor, qn: Tensor | None,
                  kn: Tensor | None, eps: float, r_k: Tensor | None, mu_k: Tensor | None) -> tuple[Tensor, Tensor]:
    """Split fused QKV ``[N, (hq + 2 hkv) d]``, QK-norm (if weights given), RoPE, and with ``r_k``
    ``[hkv, d, d]`` center keys by ``mu_k`` ``[hkv, d]`` and rotate queries and keys (float64 math here,
    float32 in the kernel).
    Returns q ``[N, hq, d]`` and kv ``[2, N, hkv, d]`` in the input dtype."""
    N = qkv.shape[0]
    q, k, v = qkv.split((hq * d, hkv * d, hkv * d), dim=-1)
    q, k, v = q.view(N, hq, d), k.view(N, hkv, d), v.view(N, hkv, d)
    if qn is not None:
        q, k = rmsnorm_ref(q, qn, eps), rmsnorm_ref(k, kn, eps)
    q, k = rope_ref(q, cos, sin), rope_ref(k, cos, sin)
    if r_k is not None:  # float64 like oscarkv.hf, so both produce the same stored rows
        r = r_k.double()
        k = torch.einsum("nhd,hde->nhe", k.double() - mu_k.double(), r).float().to(qkv.dtype)
        qg = q.double().view(N, hkv, hq // hkv, d)
        q = torch.einsum("nhgd,hde->nhge", qg, r).reshape(N, hq, d).float().to(qkv.dtype)
    return q, torch.stack((k, v))


def paged_decode_ref(q: Tensor, kv: Tensor, block_table: Tensor, lens: Tensor, sm_scale: float) -> Tensor:
    """One query per sequence over 16-bit pages. q ``[B, Hq, d]``, kv ``[2, pages, Hkv, P, d]``, block_table
    int32 ``[B, max_pages]``, lens ``[B]``. Returns ``[B, Hq, d]`` (zeros for empty sequences)."""
    B, Hq, d = q.shape
    P, Hkv = kv.shape[3], kv.shape[2]
    out = torch.zeros_like(q)
    for b in range(B):
        n = int(lens[b])
        if n == 0:
            continue
        pages = block_table[b, : (n + P - 1) // P].long()
        k, v = (kv[i, pages].transpose(0, 1).reshape(Hkv, -1, d)[:, :n] for i in range(2))
        g = Hq // Hkv
        s = torch.einsum("hgd,hnd->hgn", q[b].float().view(Hkv, g, d), k.float()) * sm_scale
        out[b] = torch.einsum("hgn,hnd->hgd", s.softmax(-1), v.float()).reshape(Hq, d).to(q.dtype)
    return out


def gemv_ref(x: Tensor, w: Tensor, b: Tensor | None = None, residual: Tensor | None = None,
               norm: Tensor | None = None, eps: float = 1e-6, act: str | None = None,
               out_dtype: torch.dtype | None = None) -> Tensor:
    """The fused decode GEMV: ``linear(pro(x), w, b)``, rounded to x's dtype, then
    ``+ residual`` (then converted to ``out_dtype`` if given). ``pro``: ``rmsnorm_ref(x, norm)`` with
    ``norm``, ``silu(x[:, :K]) * x[:, K:]`` with ``act="silu"``, else identity (the unfused ops of a block, in
    the same order)."""
    if norm is not None:
        x = rmsnorm_ref(x, norm, eps)
    elif act == "silu":
        gate, up = x.chunk(2, dim=-1)
        x = F.silu(gate) * up
    y = F.linear(x, w, b)
    y = y if residual is None else y + residual
    return y if out_dtype is None else y.to(out_dtype)


def embed_rope_ref(tokens: Tensor, positions: Tensor, emb: Tensor, inv_freq2: Tensor,
                     scaling: float = 1.0) -> tuple[Tensor, Tensor, Tensor]:
    """A step's embedding rows and RoPE ``cos/sin [N, d]`` (``inv_freq2``: both halves of the frequencies)."""
    x = F.embedding(tokens, emb)
    e = positions[:, None] * inv_freq2.float()  # one launch: cat((f, f)) of positions.float() * inv_freq
    cos, sin = e.cos(), e.sin()
    if scaling != 1.0:
        cos, sin = cos * scaling, sin * scaling
    return x, cos.to(x.dtype), sin.to(x.dtype)


__all__ = [
    "channel_page_ids",
    "decode_attention_ref",
    "demote_ref",
    "dequantize_pages_ref",
    "embed_rope_ref",
    "extend_attention_ref",
    "gather_dequant_ref",
    "gemv_ref",
    "paged_decode_ref",
    "qk_prep_ref",
    "quantize_write_ref",
    "rmsnorm_ref",
    "rope_ref",
    "rotate_rows_ref",
]
