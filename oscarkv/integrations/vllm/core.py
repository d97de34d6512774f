"""One attention layer of one vLLM step over the OSCAR cache, independent of vLLM's classes (unit-testable).

Per layer the cache is vLLM's block-major tensor ``[num_blocks, page_bytes]`` (uint8) in that layer's own page
size, carved into K and V pools of :class:`~oscarkv.kernels.layout.QuantPages` in the layer's
:class:`~oscarkv.formats.LayerFormat`, plus a 16-bit pool ``[num_slots + 1, rows16, Hkv, d]`` per K and V for the
sink and recent windows (:mod:`.windows`). Which token is read from which tier is the store's
:class:`~oscarkv.cache.TierPolicy`.

A step: rotate/center the new K/V (``(x - mu) @ R``) and the queries (``q @ R_K``); write the 2-bit pages (token
layouts: every new token into its page slot; a layer with channel-page keys: K and V of each page its last token
completes, whole, from the 16-bit rows); copy new rows into the 16-bit ring; decode rows attend to their tiers
after the write, prefill chunks attend causally to themselves in full precision and to their prefix as stored;
the output is rotated back (``@ R_V^T``) and ``mu_V`` added. Every 2-bit value is quantized from the row's
16-bit rounding, so the pages hold what the engine's and the transformers cache's demotions write.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from ...cache import TierPolicy
from ...kernels.layout import PageFormat, QuantPages
from ...kernels.plan import DecodePlan
from ...kernels.reference import rotate_rows_ref
from .options import windows_of
from .windows import WindowSlots, step_indices


def ops():
    """The kernel ops of :mod:`oscarkv.kernels.dispatch`: Triton on CUDA, the PyTorch reference on CPU."""
    from ...kernels import dispatch

    return dispatch.quantize_write, dispatch.decode_attention, dispatch.extend_attention, dispatch.rotate_rows


def prebuild_decode_kernels(k_fmt: PageFormat, v_fmt: PageFormat, num_q_heads: int, q_dtype: torch.dtype,
                            dtype16: torch.dtype, max_seqs: int, warn: Callable[[str], None]) -> int:
    """Build the CUDA decode kernel's cubins for key pages ``k_fmt`` and value pages ``v_fmt``, for every batch
    up to ``max_seqs``, before serving (a first-use build
    costs ~1.7 s of nvcc per configuration, inside a request). Returns how many are ready; on failure ``warn`` is
    told and the kernels build on first use as before (or the Triton kernel serves, where nvcc is missing)."""
    from ...kernels import decode_cuda

    try:
        return len(decode_cuda.prebuild(k_fmt, num_q_heads, q_dtype, dtype16, max_seqs, v_fmt=v_fmt))
    except Exception as e:  # noqa: BLE001 - a start-up optimisation must not stop the server
        warn(f"OSCAR: the CUDA decode kernel was not built at start ({str(e)[:300]}); it builds on first use")
        return 0


def _pool_bytes(fmt: PageFormat) -> tuple[int, int]:
    """Bytes of one block's codes and of one block's scales (or offsets) for K or V (all heads)."""
    meta = torch.empty((), dtype=fmt.meta_dtype).element_size()
    return fmt.num_kv_heads * fmt.page_size * fmt.row_bytes, fmt.num_kv_heads * math.prod(fmt.meta_shape) * meta


def page_bytes(k_fmt: PageFormat, v_fmt: PageFormat) -> int:
    """Bytes of one vLLM block of one layer: K and V codes, scales and offsets of ``page_size`` tokens."""
    (kc, km), (vc, vm) = _pool_bytes(k_fmt), _pool_bytes(v_fmt)
    return kc + vc + 2 * km + 2 * vm


def carve(kv_cache: Tensor, k_fmt: PageFormat, v_fmt: PageFormat) -> tuple[QuantPages, QuantPages]:
    """K and V page pools inside vLLM's uint8 ``[num_blocks, page_bytes(k_fmt, v_fmt)]`` cache of one layer.

    The bytes are used pool-major (K codes of all blocks, then V codes, K scales, K offsets, V scales, V offsets),
    so each pool is a contiguous tensor as the kernels require. vLLM only ever addresses these bytes through the
    backend (no KV zeroing for this spec, no KV connectors), so the block-major shape it allocates is only a size.
    """
    nb, want = kv_cache.shape[0], page_bytes(k_fmt, v_fmt)
    if kv_cache.dtype != torch.uint8 or not kv_cache.is_contiguous() or kv_cache.numel() != nb * want:
        raise ValueError(f"KV cache {tuple(kv_cache.shape)} {kv_cache.dtype} is not {nb} contiguous pages of "
                         f"{want} bytes")
    flat = kv_cache.view(-1)
    H, P = k_fmt.num_kv_heads, k_fmt.page_size
    parts, at = [], 0
    for dtype, shape in ((torch.uint8, (P, k_fmt.row_bytes)), (torch.uint8, (P, v_fmt.row_bytes)),
                         (k_fmt.meta_dtype, k_fmt.meta_shape), (k_fmt.meta_dtype, k_fmt.meta_shape),
                         (v_fmt.meta_dtype, v_fmt.meta_shape), (v_fmt.meta_dtype, v_fmt.meta_shape)):
        n = nb * H * math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        parts.append(flat[at:at + n].view(dtype).view(nb, H, *shape))
        at += n
    kc, vc, ks, ko, vs, vo = parts
    return QuantPages(kc, ks, ko, k_fmt), QuantPages(vc, vs, vo, v_fmt)


@dataclass
class LayerParams:
    """Per-layer, per-rank calibration tensors (on the compute device)."""

    r_k: Tensor  # float32 [Hkv, d, d]
    r_v: Tensor  # float32 [Hkv, d, d]
    mu_k: Tensor  # float32 [Hkv, d]
    mu_v: Tensor  # float32 [Hkv, d]
    k_clip: float
    v_clip: float
    sm_scale: float
    dtype16: torch.dtype = torch.bfloat16  # the 16-bit tiers; quantized rows are quantized from this rounding
    channel: bool = False  # keys in channel pages: K and V pages are written whole when complete


@dataclass
class StepMeta:
    """Per-step metadata (built once per step by the metadata builder, shared by all layers)."""

    num_tokens: int
    num_decodes: int  # rows [0, num_decodes) are single-token decodes; tokens [0, num_decodes) theirs
    slot_mapping: Tensor  # int64 [T]: page * block_size + row of each new token
    block_table: Tensor  # int32 [B, max_blocks]
    qlen: Tensor  # int32 [B]: 2-bit tokens read (decode: after this step; prefill: of the prefix)
    skip_blocks: int  # blocks skipped at the start of every row's page table (the sink), see bt2
    bt2: Tensor  # int32 [B, *]: page table of the 2-bit tier (rows with their own skip already applied)
    len16: Tensor  # int32 [B]
    gather: Tensor  # int64 [B, rows16]: flat 16-bit pool rows of each row's 16-bit tier
    ring_rows: Tensor | None  # int64 [T]: flat 16-bit pool row of each new token (None: no windows)
    ring_keep: Tensor | None = None  # int64: the new tokens whose ring row is not the trash row ...
    ring_dst: Tensor | None = None  # ... and their rows (a long chunk keeps <= sink + window of its tokens)
    prefills: list[tuple[int, int, int, int]] = field(default_factory=list)  # (row, tok_start, tok_end, n0)
    seq_lens: list[int] = field(default_factory=list)  # tokens after this step (16-bit mode only)
    max_qlen: int = 0  # longest 2-bit tier read by a decode row (sizes the decode plan's splits)
    plan: DecodePlan | None = None  # decode split geometry + workspace, planned once per step for every layer
    graph_rows: int = 0  # > 0: a decode step padded for CUDA graphs (graphs.StaticDecode); its real rows
    qlen_host: list[int] = field(default_factory=list)  # qlen and len16 as host integers: the extend kernel's
    len16_host: list[int] = field(default_factory=list)  # cuDNN fold needs them (no device read per layer)
    # pages completed this step, per page token (windows.StepIndices.page_*): physical slot (-1 = none), source
    page_slots: Tensor | None = None  # int64 [M]
    page_new: Tensor | None = None  # int64 [M]: this step's token index (clamped to 0 where the pool is read)
    page_ring: Tensor | None = None  # int64 [M]: flat 16-bit pool row
    page_from_new: Tensor | None = None  # bool [M]


def build_step(
    policy: TierPolicy, slots: WindowSlots | None, num_slots: int, qsl: np.ndarray, seq: np.ndarray,
    keys: np.ndarray | None, block_table: Tensor, slot_mapping: Tensor, block_size: int, pages: bool = False,
) -> StepMeta:
    """:class:`StepMeta` of one step from vLLM's batch: ``qsl`` query start offsets ``[B + 1]`` and ``seq``
    tokens after the step ``[B]`` (CPU int64), ``keys`` first-block ids (None without windows), the device
    ``block_table [B, M]`` and ``slot_mapping [T]``. Leading one-token rows are decodes (vLLM puts them first).
    ``pages``: also list the pages this step completes (layers with channel-page keys write them)."""
    B = len(seq)
    qlens = np.diff(qsl)
    is_one = qlens == 1
    nd = B if is_one.all() else int(np.argmin(is_one))
    if slots is not None:
        row_slots = slots.assign(keys, fresh=(seq - qlens) == 0)
    else:
        row_slots = np.full(B, -1, dtype=np.int64)
    idx = step_indices(policy, row_slots, seq, qlens, num_slots, np.arange(B) < nd, block_size if pages else 0)
    skip = idx.skip // block_size
    dev = block_table.device
    if B == 0 or (skip == skip[0]).all():
        bt2 = block_table[:, int(skip[0]) if B else 0:]
    else:
        cols = torch.arange(block_table.shape[1], device=dev)[None] + torch.as_tensor(skip, device=dev)[:, None]
        bt2 = block_table.gather(1, cols.clamp(max=block_table.shape[1] - 1).long())

    def to_dev(a, dtype):
        return torch.as_tensor(a, dtype=dtype).to(dev, non_blocking=True)

    T = int(qsl[-1])
    trash = num_slots * windows_of(policy)[1]
    # a chunk's tokens that leave the window at once all map to the trash row: scattering them there (32K
    # writes of one row per layer at 32K prompts) is contention, not work, so prefill steps write the kept ones
    keep = np.flatnonzero(idx.ring_rows != trash) if slots is not None and nd < B else None
    m = StepMeta(
        num_tokens=T, num_decodes=nd, slot_mapping=slot_mapping[:T].long(), block_table=block_table,
        qlen=to_dev(idx.qlen, torch.int32), skip_blocks=int(skip[0]) if B else 0, bt2=bt2,
        len16=to_dev(idx.len16, torch.int32), gather=to_dev(idx.gather, torch.int64),
        ring_rows=to_dev(idx.ring_rows, torch.int64) if slots is not None else None,
        ring_keep=to_dev(keep, torch.int64) if keep is not None else None,
        ring_dst=to_dev(idx.ring_rows[keep], torch.int64) if keep is not None else None,
        prefills=[(r, int(qsl[r]), int(qsl[r + 1]), int(seq[r] - qlens[r])) for r in range(nd, B)],
        seq_lens=seq.tolist(), max_qlen=int(idx.qlen[:nd].max()) if nd else 0,
        qlen_host=[int(x) for x in idx.qlen], len16_host=[int(x) for x in idx.len16],
    )
    if pages:
        row, pos = to_dev(idx.page_row, torch.int64), to_dev(idx.page_pos, torch.int64)
        blk = block_table[row.clamp(min=0), pos // block_size].long()
        m.page_slots = torch.where(row >= 0, blk * block_size + pos % block_size, -1)
        m.page_new = to_dev(np.maximum(idx.page_new, 0), torch.int64)
        m.page_from_new = to_dev(idx.page_new >= 0, torch.bool)
        m.page_ring = to_dev(idx.page_ring, torch.int64)
    return m


def decode_plan(plan: DecodePlan | None, m: StepMeta, new_plan: Callable[[int], DecodePlan]) -> DecodePlan | None:
    """The decode kernels' split plan for step ``m``: ``plan`` re-planned from two host integers (batch, longest
    2-bit tier), or ``new_plan(width)`` when there is none or it was built for a narrower block table. Shared by
    every layer of the step (one workspace, used layer after layer on one stream). ``plan`` without decode rows."""
    if not m.num_decodes:
        return plan
    width = m.bt2.shape[1]
    if plan is None or plan.max_pages < width:
        plan = new_plan(width)
    return plan.update(m.num_decodes, m.max_qlen)


def unrotate_rows(o: Tensor, p: LayerParams) -> Tensor:
    """``o @ R_V^T + mu_V`` per query head's KV head, float32 (the reference of the kernel path's last launch)."""
    return rotate_rows_ref(o, p.r_v, p.mu_v, transpose=True, mean_after=True)


def quant_step(
    q: Tensor, k: Tensor, v: Tensor, kv: tuple[QuantPages, QuantPages], pools: tuple[Tensor, Tensor] | None,
    p: LayerParams, m: StepMeta, out: Tensor | None = None,
) -> Tensor:
    """One layer over the 2-bit cache. q ``[T, Hq, d]``, k/v ``[T, Hkv, d]``; pools ``[num_slots + 1,
    rows16, Hkv, d]`` (``p.dtype16``) or None without windows. Returns ``[T, Hq, d]`` (unrotated): float32, or
    ``out`` (any float dtype, unit last stride) written in place.

    As in :mod:`oscarkv.cache`, a quantized row is quantized from its 16-bit value, and a chunk attends to its
    own K/V unrounded; queries and the chunk's own K/V reach the kernels in the activation dtype.
    """
    if pools is not None and not m.prefills:
        return _decode_step(q, k, v, kv, pools, p, m, out)
    quantize_write, decode_attention, extend_attention, rotate_rows = ops()
    T, nd, act = m.num_tokens, m.num_decodes, q.dtype
    kp, vp = kv
    # one launch per tensor (float32 products, each written once in its dtype), as in _decode_step: no float32
    # copy of the chunk, no casts
    qr = torch.empty(q.shape, dtype=act, device=q.device)
    rotate_rows(q, p.r_k, out=qr)  # q @ R_K, in the activation dtype
    kr, vr = (torch.empty(x.shape, dtype=act, device=x.device) for x in (k, v))
    if p.dtype16 == act:  # the rows to quantize (and the ring's) are the chunk's own K/V: one tensor each
        rotate_rows(k, p.r_k, p.mu_k, out=kr)
        rotate_rows(v, p.r_v, p.mu_v, out=vr)
        k16new, v16new = kr, vr
    else:  # the same float32 products rounded once to each dtype: act in out, dtype16 in rows_out (row n -> n)
        k16new, v16new = (torch.empty(x.shape, dtype=p.dtype16, device=x.device) for x in (k, v))
        ident = torch.arange(k.shape[0], device=k.device)
        rotate_rows(k, p.r_k, p.mu_k, out=kr, rows_out=k16new, rows=ident)
        rotate_rows(v, p.r_v, p.mu_v, out=vr, rows_out=v16new, rows=ident)
    H, d = k.shape[1], k.shape[2]
    empty16 = q.new_zeros(1, H, 1, d)
    pre16 = {}
    if pools is not None:
        flat_k, flat_v = (pool.view(-1, *pool.shape[2:]) for pool in pools)
        for row, _, _, n0 in m.prefills:  # the prefix as stored, before this chunk enters the ring
            if n0:
                pre16[row] = (flat_k[m.gather[row]].permute(1, 0, 2)[None],
                              flat_v[m.gather[row]].permute(1, 0, 2)[None])
    if p.channel:  # before the ring write: a completed page's older tokens are read from the ring
        write_pages(kp, vp, k16new, v16new, flat_k, flat_v, p, m)
    else:
        quantize_write(kp, vp, k16new, v16new, m.slot_mapping, k_clip=p.k_clip, v_clip=p.v_clip)
    if pools is not None:  # a step with prefill chunks: only the rows the ring keeps (build_step)
        flat_k.index_copy_(0, m.ring_dst, k16new[m.ring_keep])
        flat_v.index_copy_(0, m.ring_dst, v16new[m.ring_keep])
    attn = torch.empty(T, q.shape[1], q.shape[2], dtype=act, device=q.device)
    if nd and pools is not None:  # the new token is read back from the ring
        k16 = flat_k[m.gather[:nd]].permute(0, 2, 1, 3)
        v16 = flat_v[m.gather[:nd]].permute(0, 2, 1, 3)
        decode_attention(qr[:nd], kp, vp, m.bt2[:nd], m.qlen[:nd], k16, v16, m.len16[:nd], p.sm_scale, plan=m.plan,
                         out=attn[:nd])
    elif nd:  # no windows: each decode token attends to its quantized prefix and to itself unrounded
        z = empty16.expand(nd, H, 1, d)
        extend_attention(qr[:nd, None], kr[:nd, None], vr[:nd, None], kp, vp, m.bt2[:nd], m.qlen[:nd], z, z,
                         m.len16[:nd], p.sm_scale, out=attn[:nd, None])
    fresh = [(a, b) for _, a, b, n0 in m.prefills if n0 == 0] if q.is_cuda else []
    if fresh:  # nothing stored before these chunks: causal attention over each chunk alone
        fresh_chunk_attention(qr, kr, vr, fresh, p.sm_scale, attn)
    for row, a, b, n0 in m.prefills:
        if (a, b) in fresh:
            continue
        k16, v16 = pre16.get(row, (empty16, empty16))
        hl = ([m.qlen_host[row]], [m.len16_host[row]]) if m.qlen_host else None
        extend_attention(qr[None, a:b], kr[None, a:b], vr[None, a:b], kp, vp, m.bt2[row:row + 1],
                         m.qlen[row:row + 1], k16, v16, m.len16[row:row + 1], p.sm_scale, out=attn[None, a:b],
                         host_lengths=hl)
    if out is None:
        out = torch.empty(attn.shape, dtype=torch.float32, device=q.device)
    return rotate_rows(attn, p.r_v, p.mu_v, out=out, transpose=True, mean_after=True)  # unrotate_rows, into out


def _decode_step(q: Tensor, k: Tensor, v: Tensor, kv: tuple[QuantPages, QuantPages], pools: tuple[Tensor, Tensor],
                 p: LayerParams, m: StepMeta, out: Tensor | None) -> Tensor:
    """:func:`quant_step` for a step of decode rows only (with windows): the same values in 6-7 launches instead
    of ~25 torch ops. An eager vLLM step is bound by the host's op issue (H200 machine: 1.4 ms of host time per
    layer against 0.43 ms on the GPU at 34 x 32K, a layer probe, git 3106180), so fewer ops is faster."""
    quantize_write, decode_attention, _, rotate_rows = ops()
    T = m.num_tokens
    kp, vp = kv
    flat_k, flat_v = (pool.view(-1, *pool.shape[2:]) for pool in pools)
    qr = torch.empty_like(q)
    rotate_rows(q, p.r_k, out=qr)  # q @ R_K, in the activation dtype
    k16, v16 = (torch.empty(k.shape, dtype=p.dtype16, device=k.device) for _ in range(2))
    # (x - mu) @ R rounded to the tiers' dtype: the rows to quantize, also written into the 16-bit ring
    rotate_rows(k, p.r_k, p.mu_k, out=k16, rows_out=flat_k, rows=m.ring_rows)
    rotate_rows(v, p.r_v, p.mu_v, out=v16, rows_out=flat_v, rows=m.ring_rows)
    if p.channel:  # the ring now holds every token of a page completed by this step's token
        write_pages(kp, vp, k16, v16, flat_k, flat_v, p, m)
    else:
        quantize_write(kp, vp, k16, v16, m.slot_mapping, k_clip=p.k_clip, v_clip=p.v_clip)
    ka, va = flat_k[m.gather[:T]].permute(0, 2, 1, 3), flat_v[m.gather[:T]].permute(0, 2, 1, 3)
    attn = decode_attention(qr, kp, vp, m.bt2[:T], m.qlen[:T], ka, va, m.len16[:T], p.sm_scale, plan=m.plan,
                            out=torch.empty_like(q))
    if out is None:
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    return rotate_rows(attn, p.r_v, p.mu_v, out=out, transpose=True, mean_after=True)  # @ R_V^T + mu_V


def write_pages(kp: QuantPages, vp: QuantPages, k16: Tensor, v16: Tensor, flat_k: Tensor, flat_v: Tensor,
                p: LayerParams, m: StepMeta) -> None:
    """K and V of the pages this step completes (``m.page_*``), whole, from their 16-bit rows: this step's rows
    ``k16/v16 [T, Hkv, d]`` or the flat 16-bit pools. A page of padding (slots -1) is skipped."""
    if m.page_slots is None or not m.page_slots.numel():
        return
    sel = m.page_from_new[:, None, None]
    k = torch.where(sel, k16[m.page_new], flat_k[m.page_ring])
    v = torch.where(sel, v16[m.page_new], flat_v[m.page_ring])
    ops()[0](kp, vp, k, v, m.page_slots, k_clip=p.k_clip, v_clip=p.v_clip, check_pages=False)


@functools.cache
def _flash_varlen() -> tuple[Callable, int | None] | None:
    """vLLM's FlashAttention varlen function and the version it picks for this GPU (FA3 on Hopper), or None where
    this vLLM build has none (the CPU platform, a build without its FlashAttention library)."""
    try:
        from vllm.v1.attention.backends import fa_utils
    except ImportError:
        return None
    if not fa_utils.is_flash_attn_varlen_func_available():
        return None
    return fa_utils.flash_attn_varlen_func, fa_utils.get_flash_attn_version()


def fresh_chunk_attention(q: Tensor, k: Tensor, v: Tensor, spans: list[tuple[int, int]], sm_scale: float,
                          out: Tensor) -> None:
    """Causal attention of each chunk ``q[a:b]`` to its own ``k/v[a:b]`` (no prefix), written into ``out[a:b]``;
    q/out ``[T, Hq, d]``, k/v ``[T, Hkv, d]``, CUDA. One varlen FlashAttention call over the chunks (vLLM's
    library, the kernel its own backend prefills with) in 16-bit dtypes; torch SDPA otherwise and as the
    reference (tests/integrations/vllm/test_core.py compares the two on a GPU)."""
    fa = _flash_varlen() if q.dtype in (torch.float16, torch.bfloat16) else None
    if fa is None:
        for a, b in spans:
            out[a:b] = causal_self_attention(q[a:b], k[a:b], v[a:b], sm_scale)
        return
    flash, version = fa
    lo, hi = spans[0][0], spans[-1][1]
    rows = [a for a, _ in spans] + [hi]
    if any(b != a2 for (_, b), a2 in zip(spans, rows[1:])):  # chunks not adjacent: one call each
        for span in spans:
            fresh_chunk_attention(q, k, v, [span], sm_scale, out)
        return
    cu = torch.tensor(rows, dtype=torch.int32).sub_(lo).to(q.device, non_blocking=True)
    longest = max(b - a for a, b in spans)
    kw = {} if version is None else {"fa_version": version}
    flash(q[lo:hi], k[lo:hi], v[lo:hi], max_seqlen_q=longest, cu_seqlens_q=cu, max_seqlen_k=longest,
          cu_seqlens_k=cu, softmax_scale=sm_scale, causal=True, out=out[lo:hi], **kw)


def causal_self_attention(q: Tensor, k: Tensor, v: Tensor, sm_scale: float) -> Tensor:
    """A chunk's causal attention to itself, q ``[T, Hq, d]``, k/v ``[T, Hkv, d]`` -> ``[T, Hq, d]`` (torch SDPA,
    i.e. FlashAttention on CUDA: the extend kernel's result when no prefix is stored, within its error budget)."""
    from ...cache.attention import sdpa  # 4-D inputs, so that torch picks a fused backend, not the math one

    g = q.shape[1] // k.shape[1]
    kh, vh = (x.transpose(0, 1).repeat_interleave(g, 0) for x in (k, v))
    return sdpa(q.transpose(0, 1), kh, vh, is_causal=True, scale=sm_scale).transpose(0, 1)


def dense_step(q: Tensor, k: Tensor, v: Tensor, kv16: Tensor, p: LayerParams, m: StepMeta) -> Tensor:
    """One layer over a 16-bit paged cache ``[num_blocks, 2, Hkv, block_size, d]`` (quantization off): the same
    rotations and centering, every token kept exactly. Returns ``[T, Hq, d]`` float32 (unrotated)."""
    _, _, extend_attention, _ = ops()
    B = kv16.shape[3]
    qr = rotate_rows_ref(q, p.r_k)
    kr, vr = rotate_rows_ref(k, p.r_k, p.mu_k), rotate_rows_ref(v, p.r_v, p.mu_v)
    blk, off = m.slot_mapping // B, m.slot_mapping % B
    kv16[blk, 0, :, off] = kr.to(kv16.dtype)
    kv16[blk, 1, :, off] = vr.to(kv16.dtype)
    H, d = k.shape[1], k.shape[2]
    dummy = QuantPages.allocate(PageFormat(H, d, page_size=B), 1, device=q.device)
    zeros = torch.zeros(1, dtype=torch.int32, device=q.device)
    rows = [(r, r, r + 1, m.seq_lens[r] - 1) for r in range(m.num_decodes)] + list(m.prefills)
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for row, a, b, n0 in rows:
        nblk = -(-max(n0, 1) // B)
        pages = kv16[m.block_table[row, :nblk].long()]  # [nblk, 2, H, B, d]
        k16 = pages[:, 0].permute(1, 0, 2, 3).reshape(H, nblk * B, d)[None]
        v16 = pages[:, 1].permute(1, 0, 2, 3).reshape(H, nblk * B, d)[None]
        len16 = torch.full((1,), n0, dtype=torch.int32, device=q.device)
        out[a:b] = extend_attention(qr[None, a:b], kr[None, a:b], vr[None, a:b], dummy, dummy,
                                    m.block_table[row:row + 1, :1], zeros, k16, v16, len16, p.sm_scale,
                                    backend="reference")[0]
    return unrotate_rows(out, p)


__all__ = ["LayerParams", "StepMeta", "build_step", "carve", "causal_self_attention", "decode_plan", "dense_step",
           "ops", "page_bytes", "prebuild_decode_kernels", "quant_step", "write_pages"]
