"""Forward contexts: what the decoder's attention layers call (``rotation(layer)``, ``attention(layer, q, kv)``).

``DecodeCtx`` holds static, preallocated metadata for a batch of slots ``[0, bs)`` (so a CUDA graph captured
with it stays valid; the runner refreshes the contents before each replay). ``PrefillCtx`` runs one chunk of
one sequence eagerly and writes the chunk's K/V into the tiers layer by layer, after that layer's attention
has read the prefix as stored.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import Tensor

from ..kernels import reference as ref
from ..kernels import dispatch as ops
from .kv import Bf16Pool, KVPool, OscarPool


def _accepts(fn, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _triton_decode():
    """(decode function, plan class) of the kernels' graph-safe 2-bit decode, or None where unavailable. The
    function takes ``pdl=`` (the CUDA kernel's programmatic dependent launch; dropped on the other paths)."""
    try:
        from ..kernels import dispatch  # noqa: PLC0415

        if hasattr(dispatch, "decode_attention") and hasattr(dispatch, "DecodePlan"):
            takes_pdl = _accepts(dispatch.decode_attention, "pdl")

            def fast(*a, pdl: bool = False, **kw):
                if pdl and takes_pdl:
                    kw["pdl"] = True
                try:
                    return dispatch.decode_attention(*a, **kw)
                except ImportError:  # a dispatch path whose module is not installed: the Triton kernel
                    from ..kernels.decode_triton import decode_attention_triton  # noqa: PLC0415

                    kw.pop("pdl", None)
                    return decode_attention_triton(*a, **kw)
            return fast, dispatch.DecodePlan
    except ImportError:
        pass
    try:
        from ..kernels.decode_triton import decode_attention_triton  # noqa: PLC0415
        from ..kernels.plan import DecodePlan  # noqa: PLC0415
    except ImportError:
        return None
    return (lambda *a, pdl=False, **kw: decode_attention_triton(*a, **kw)), DecodePlan


def _kernel_op(name: str):
    """The dispatch layer's op where it exists (CUDA kernels, reference on CPU), else the reference."""
    try:
        from ..kernels import dispatch  # noqa: PLC0415
    except ImportError:
        return getattr(ref, f"{name}_ref")
    return getattr(dispatch, name, None) or getattr(ref, f"{name}_ref")


def sdpa(q: Tensor, k: Tensor, v: Tensor, **kw) -> Tensor:
    """``F.scaled_dot_product_attention`` on ``[H, T, d]`` tensors, given a batch dimension: torch's fused
    backends (FlashAttention, memory-efficient, cuDNN) take 4-D inputs only; 3-D ones fall back to the math
    backend, which materialises the ``[H, T, T]`` scores (61 GiB for one 32K chunk of 16 heads)."""
    return F.scaled_dot_product_attention(q[None], k[None], v[None], **kw)[0]


class _Ctx:
    def __init__(self, pool: KVPool, sm_scale: float):
        self.pool, self.sm_scale = pool, sm_scale
        self.oscar = isinstance(pool, OscarPool)

    def rotation(self, layer: int) -> tuple[Tensor | None, Tensor | None]:
        if self.oscar:
            return self.pool.r_k[layer], self.pool.mu_k[layer]
        return None, None

    def kv_dest(self, layer: int) -> ops.KVDest | None:
        """None: the context writes K/V itself (prefill: through the pools' own code)."""
        return None


class DecodeCtx(_Ctx):
    """Decode of one new token for each of the slots ``[0, bs)``."""

    def __init__(self, pool: KVPool, bs: int, sm_scale: float):
        super().__init__(pool, sm_scale)
        dev = pool.device
        self.bs = bs
        # static inputs, refreshed by two host-to-device copies per step (the graph keeps their addresses)
        self._i64 = torch.zeros(6, bs, dtype=torch.long, device=dev)
        # widx: bf16 page*P+row, oscar 16-bit index; page/row: bf16 only; kv_off: the new token's K/V element
        # offset in the layer's pool view (see ``kv_dest``)
        self.tokens, self.positions, self.widx, self.page, self.row, self.kv_off = self._i64
        self._i32 = torch.zeros(2, bs, dtype=torch.int32, device=dev)
        self.lens, self.qlen = self._i32  # bf16: tokens; oscar: 16-bit tokens (with the new one); 2-bit tokens
        self.rows = torch.arange(bs, device=dev)
        self.block_table = pool.block_table[:bs]
        self._decode = _kernel_op("decode_attention") if self.oscar else None
        self._decode_pdl = self.oscar and _accepts(self._decode, "pdl")  # may ``pdl=`` reach self._decode
        self._extend = _kernel_op("extend_attention") if self.oscar else None
        self.plan = None
        fast = _triton_decode() if self.oscar and dev.type == "cuda" else None
        if fast is not None:  # one plan per captured batch size: graph-safe split geometry and workspace
            self._decode, plan_cls = fast
            self._decode_pdl = True
            m = pool.max_pages
            self.plan = plan_cls(bs, pool.n_q_heads, pool.H, pool.d, pool.cfg.page_size, m, pool.cfg.c16 + 1,
                                 device=dev).update(bs)

    def fill(self, tokens: list[int], positions: list[int], widx: list[int], lens: list[int],
             qlen: list[int]) -> None:
        """Refresh the static inputs from host lists of length ``bs`` (padded rows included); the per-step
        index math (page, row, pool offsets) is done here once, not per layer."""
        pool = self.pool
        if isinstance(pool, Bf16Pool):
            P = pool.cfg.page_size
            page, row = [w // P for w in widx], [w % P for w in widx]
            s_page, s_row = pool.kv.stride(2), pool.kv.stride(4)  # of the layer view [2, pages, H, P, d]
            off = [p * s_page + r * s_row for p, r in zip(page, row)]
        else:
            page = row = [0] * len(widx)
            s_slot, s_col = pool.buf.stride(2), pool.buf.stride(4)  # of the layer view [2, slots, H, C16+1, d]
            off = [t * s_slot + w * s_col for t, w in enumerate(widx)]
        self._i64.copy_(torch.tensor([tokens, positions, widx, page, row, off], dtype=torch.long))
        self._i32.copy_(torch.tensor([lens, qlen], dtype=torch.int32))

    def kv_dest(self, layer: int) -> ops.KVDest:
        """Where QK-prep stores this step's K/V of ``layer`` (the fused write, Triton path)."""
        pool = self.pool
        if isinstance(pool, Bf16Pool):
            return ops.KVDest(pool.kv[layer], self.kv_off, pool.kv.stride(1), pool.kv.stride(3))
        return ops.KVDest(pool.buf[:, layer], self.kv_off, pool.buf.stride(0), pool.buf.stride(3))

    def write_kv(self, layer: int, kv: Tensor) -> None:
        """Reference write of the new token's K/V ``[2, bs, Hkv, d]`` (PyTorch path; the spec of the fused one)."""
        pool = self.pool
        if isinstance(pool, Bf16Pool):
            pool.kv[layer][:, self.page, :, self.row] = kv.transpose(0, 1)
        else:
            buf = pool.buf[:, layer]
            buf[:, self.rows, :, self.widx] = kv.transpose(0, 1).to(buf.dtype)

    def attention(self, layer: int, q: Tensor, kv: Tensor | None, pdl: bool = False) -> Tensor:
        """``kv=None``: QK-prep has already stored the new token's K/V at ``kv_dest(layer)``. ``pdl``: the decode
        kernels as programmatic dependent launches (the BF16 paged decode's two Triton kernels; the CUDA 2-bit
        kernel's ``pdl=True``: its split kernel waits at its start, its merge kernel lets the next one start)."""
        pool = self.pool
        if isinstance(pool, Bf16Pool):
            if kv is not None:
                self.write_kv(layer, kv)
            return ops.paged_decode(q, pool.kv[layer], self.block_table, self.lens, self.sm_scale, pool.max_len,
                                    pdl=pdl)
        assert isinstance(pool, OscarPool)
        buf = pool.buf[:, layer]
        kp, vp = pool.pages[0][layer], pool.pages[1][layer]
        if not ops.uses_kernels(q) and kv is not None:  # reference: the new token attends to itself unrounded
            out = self._extend(q[:, None], kv[0][:, None], kv[1][:, None], kp, vp, self.block_table, self.qlen,
                               buf[0, : self.bs], buf[1, : self.bs], self.lens - 1, sm_scale=self.sm_scale)[:, 0]
            self.write_kv(layer, kv)
            return out.to(q.dtype)
        if kv is not None:
            self.write_kv(layer, kv)
        extra = {"plan": self.plan} if self.plan is not None else {}
        if pdl and self._decode_pdl:
            extra["pdl"] = True
        out = self._decode(q, kp, vp, self.block_table, self.qlen, buf[0, : self.bs], buf[1, : self.bs], self.lens,
                           sm_scale=self.sm_scale, **extra)
        return out if out.dtype == q.dtype else out.to(q.dtype)


class PrefillCtx(_Ctx):
    """One chunk of one sequence: tokens at positions ``[n0, n1)`` of slot ``slot``; for OSCAR, ``new_pages``
    are the page ids (already in the block table) that this chunk's demotions fill."""

    def __init__(self, pool: KVPool, slot: int, n0: int, n1: int, sm_scale: float, new_pages: list[int]):
        super().__init__(pool, sm_scale)
        self.slot, self.n0, self.n1 = slot, n0, n1
        self.dev = pool.device
        cfg = pool.cfg
        if self.oscar:
            self.q0 = pool.qlens[slot]
            self.q1 = cfg.qlen(n1)
            self.len16 = n0 - self.q0
            self.pages = torch.tensor(new_pages, dtype=torch.long, device=self.dev)
            self._extend = _kernel_op("extend_attention")
            # the prefix lengths as host integers: the CUDA extend's cuDNN fold needs them, and reading them back
            # from the device would stall every layer (the bare reference takes no such argument)
            self._host_lengths = ({"host_lengths": ([self.q0], [self.len16])}
                                 if self._extend is not ref.extend_attention_ref else {})
        else:
            pos = torch.arange(n0, n1, device=self.dev)
            pages = pool.block_table[slot, pos // cfg.page_size].long()
            self.page_ids, self.page_rows = pages, pos % cfg.page_size

    def attention(self, layer: int, q: Tensor, kv: Tensor, pdl: bool = False) -> Tensor:
        """``pdl`` is accepted for the decode context's signature and ignored (prefill runs eagerly)."""
        return self._oscar(layer, q, kv) if self.oscar else self._bf16(layer, q, kv)

    def _bf16(self, layer: int, q: Tensor, kv: Tensor) -> Tensor:
        pool, P = self.pool, self.pool.cfg.page_size
        pool.kv[layer][:, self.page_ids, :, self.page_rows] = kv.transpose(0, 1)
        n1, T = self.n1, q.shape[0]
        pages = pool.block_table[self.slot, : (n1 + P - 1) // P].long()
        k, v = (pool.kv[layer][i, pages].transpose(0, 1).reshape(pool.H, -1, pool.d)[:, :n1] for i in range(2))
        g = q.shape[1] // pool.H
        k, v = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)
        qh = q.transpose(0, 1)
        if self.n0 == 0:
            o = sdpa(qh, k, v, is_causal=True, scale=self.sm_scale)
        else:
            mask = torch.arange(n1, device=self.dev)[None] <= torch.arange(self.n0, n1, device=self.dev)[:, None]
            o = sdpa(qh, k, v, attn_mask=mask, scale=self.sm_scale)
        return o.transpose(0, 1).reshape(T, -1, pool.d)

    def _oscar(self, layer: int, q: Tensor, kv: Tensor) -> Tensor:
        pool, s = self.pool, self.slot
        assert isinstance(pool, OscarPool)
        buf = pool.buf[:, layer, s]  # [2, H, C16, d]
        meta = dict(block_table=pool.block_table[s: s + 1],
                    qlen=torch.tensor([self.q0], dtype=torch.int32, device=self.dev),
                    len16=torch.tensor([self.len16], dtype=torch.int32, device=self.dev))
        if self.n0 == 0:  # nothing stored yet: plain causal attention in full precision
            k, v = (x.transpose(0, 1).repeat_interleave(q.shape[1] // pool.H, 0) for x in kv)
            out = sdpa(q.transpose(0, 1), k, v, is_causal=True, scale=self.sm_scale)
            out = out.transpose(0, 1)
        else:
            out = self._extend(q[None], kv[0][None], kv[1][None], pool.pages[0][layer], pool.pages[1][layer],
                               meta["block_table"], meta["qlen"], buf[0][None], buf[1][None], meta["len16"],
                               sm_scale=self.sm_scale, **self._host_lengths)[0].to(q.dtype)
        self._write_tiers(layer, kv)
        return out

    def _write_tiers(self, layer: int, kv: Tensor) -> None:
        pool, cfg = self.pool, self.pool.cfg
        S, P = cfg.sink, cfg.page_size
        buf = pool.buf[:, layer, self.slot]  # [2, H, C16, d]
        rows = kv.transpose(1, 2).to(buf.dtype)  # [2, H, T, d], rounded to the 16-bit dtype as stored
        t_sink = max(0, min(self.n1, S) - self.n0)
        if t_sink:
            buf[:, :, self.n0:self.n0 + t_sink] = rows[:, :, :t_sink]
        r0 = self.len16 - min(self.n0, S)
        recent = torch.cat([buf[:, :, S:S + r0], rows[:, :, t_sink:]], dim=2)
        m = self.q1 - self.q0
        if m:
            x = recent[:, :, :m].reshape(2, pool.H, m // P, P, pool.d).transpose(1, 2)  # [2, np, H, P, d]
            for which in range(2):
                pool.quantize_into(x[which][None], which, self.pages, slice(layer, layer + 1))
        keep = recent.shape[2] - m
        buf[:, :, S:S + keep] = recent[:, :, m:]


__all__ = ["DecodeCtx", "PrefillCtx"]
