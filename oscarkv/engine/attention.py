"""Forward contexts: what the decoder's attention layers call (``rotation(layer)``, ``kv_dest(layer)``,
``attention(layer, q, kv)``), over a :class:`~oscarkv.cache.PagedStore` (OSCAR) or a
:class:`~oscarkv.cache.Paged16Store` (BF16).

``DecodeCtx`` holds static, preallocated metadata for a batch of slots ``[0, bs)`` (so a CUDA graph captured
with it stays valid; the runner refreshes the contents before each replay). A decode forward writes each row's
new token into its own 16-bit row (or 16-bit page slot) and nothing else: the store counts it and demotes only
after the forward succeeded (``commit_decode``). ``PrefillCtx`` runs one chunk of one sequence eagerly and writes
the chunk into the store layer by layer, after that layer's attention has read the prefix as stored.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..cache import Paged16Store, PagedStore
from ..cache.attention import sdpa
from ..kernels import dispatch
from ..kernels.layout import KVDest
from ..kernels.plan import DecodePlan


class KeyRotation:
    """The key side of an OSCAR calibration on the model's device: ``r_k [L, Hkv, d, d]``, ``mu_k [L, Hkv, d]``
    float32 (QK-prep applies ``(k - mu_k) @ R_K`` and ``q @ R_K``; the value side is folded into the weights)."""

    def __init__(self, r_k: Tensor, mu_k: Tensor, device: torch.device):
        self.r_k = r_k.to(device, torch.float32)
        self.mu_k = mu_k.to(device, torch.float32)


class _Ctx:
    def __init__(self, store: PagedStore | Paged16Store, sm_scale: float, rotation: KeyRotation | None):
        self.store, self.sm_scale, self.rot = store, sm_scale, rotation
        self.oscar = isinstance(store, PagedStore)

    def rotation(self, layer: int) -> tuple[Tensor | None, Tensor | None]:
        if self.rot is None:
            return None, None
        return self.rot.r_k[layer], self.rot.mu_k[layer]

    def kv_dest(self, layer: int) -> KVDest | None:
        """None: the context writes K/V itself (prefill)."""
        return None


class DecodeCtx(_Ctx):
    """Decode of one new token for each of the slots ``[0, bs)`` (rows of slots that do not decode write to the
    16-bit scratch column or to page 0 and attend to nothing)."""

    def __init__(self, store: PagedStore | Paged16Store, bs: int, sm_scale: float,
                 rotation: KeyRotation | None = None, num_q_heads: int | None = None, tokens: Tensor | None = None):
        """``tokens``: int64 ``[>= bs]`` on the store's device, the input token of each slot (the engine's
        next-token buffer, which sampling writes on the device); default a buffer of this context's own."""
        super().__init__(store, sm_scale, rotation)
        dev = store.device
        self.bs = bs
        self.tokens = torch.zeros(bs, dtype=torch.long, device=dev) if tokens is None else tokens[:bs]
        # static inputs, refreshed by two host-to-device copies per step (the graph keeps their addresses)
        self._i64 = torch.zeros(5, bs, dtype=torch.long, device=dev)
        # widx: bf16 page*P+row, oscar 16-bit row; page/row: bf16 only; kv_off: the new token's K/V element
        # offset in the layer's store view (see ``kv_dest``)
        self.positions, self.widx, self.page, self.row, self.kv_off = self._i64
        self._i32 = torch.zeros(2, bs, dtype=torch.int32, device=dev)
        self.lens, self.qlen = self._i32  # bf16: tokens; oscar: 16-bit tokens (with the new one); 2-bit tokens
        self.rows = torch.arange(bs, device=dev)
        self.block_table = store.block_table[:bs]
        self.plan = None
        if self.oscar and dev.type == "cuda":  # one plan per captured batch size: graph-safe splits and workspace
            self.plan = DecodePlan(bs, num_q_heads or store.H, store.H, store.d, store.page_size,
                                   store.table.max_pages, store.c16 + 1, device=dev).update(bs)

    def fill(self, positions: list[int], widx: list[int], lens: list[int], qlen: list[int]) -> None:
        """Refresh the static inputs from host lists of length ``bs`` (padded rows included); the per-step
        index math (page, row, store offsets) is done here once, not per layer. The copies do not wait for the
        device (pageable sources are staged by CUDA at once), so the host can prepare a step while the previous
        one runs."""
        st = self.store
        if not self.oscar:
            P = st.page_size
            page, row = [w // P for w in widx], [w % P for w in widx]
            s_page, s_row = st.kv.stride(2), st.kv.stride(4)  # of the layer view [2, pages, H, P, d]
            off = [p * s_page + r * s_row for p, r in zip(page, row)]
        else:
            page = row = [0] * len(widx)
            s_slot, s_col = st.buf.stride(2), st.buf.stride(4)  # of the layer view [2, slots, H, C16+1, d]
            off = [t * s_slot + w * s_col for t, w in enumerate(widx)]
        self._i64.copy_(torch.tensor([positions, widx, page, row, off], dtype=torch.long), non_blocking=True)
        self._i32.copy_(torch.tensor([lens, qlen], dtype=torch.int32), non_blocking=True)

    def kv_dest(self, layer: int) -> KVDest:
        """Where QK-prep stores this step's K/V of ``layer`` (the fused write, Triton path)."""
        st = self.store
        if not self.oscar:
            return KVDest(st.kv[layer], self.kv_off, st.kv.stride(1), st.kv.stride(3))
        return KVDest(st.buf[:, layer], self.kv_off, st.buf.stride(0), st.buf.stride(3))

    def write_kv(self, layer: int, kv: Tensor) -> None:
        """Reference write of the new token's K/V ``[2, bs, Hkv, d]`` (PyTorch path; the spec of the fused one)."""
        st = self.store
        if not self.oscar:
            st.kv[layer][:, self.page, :, self.row] = kv.transpose(0, 1)
        else:
            buf = st.buf[:, layer]
            buf[:, self.rows, :, self.widx] = kv.transpose(0, 1).to(buf.dtype)

    def attention(self, layer: int, q: Tensor, kv: Tensor | None, pdl: bool = False) -> Tensor:
        """``kv=None``: QK-prep has already stored the new token's K/V at ``kv_dest(layer)``. ``pdl``: the decode
        kernels as programmatic dependent launches."""
        st = self.store
        if not self.oscar:
            if kv is not None:
                self.write_kv(layer, kv)
            return dispatch.paged_decode(q, st.kv[layer], self.block_table, self.lens, self.sm_scale,
                                    st.table.max_pages * st.page_size, pdl=pdl)
        buf = st.buf[:, layer]
        kp, vp = st.k_pages[layer], st.v_pages[layer]
        k16, v16 = buf[0, : self.bs], buf[1, : self.bs]
        if not dispatch.uses_kernels(q) and kv is not None:  # reference: the new token attends to itself unrounded
            out = dispatch.extend_attention(q[:, None], kv[0][:, None], kv[1][:, None], kp, vp, self.block_table,
                                            self.qlen, k16, v16, self.lens - 1, sm_scale=self.sm_scale)[:, 0]
            self.write_kv(layer, kv)
            return out.to(q.dtype)
        if kv is not None:
            self.write_kv(layer, kv)
        out = dispatch.decode_attention(q, kp, vp, self.block_table, self.qlen, k16, v16, self.lens,
                                        sm_scale=self.sm_scale, plan=self.plan, pdl=pdl)
        return out if out.dtype == q.dtype else out.to(q.dtype)


class PrefillCtx(_Ctx):
    """One chunk of one sequence: tokens at positions ``[n0, n1)`` of slot ``slot`` (pages for the chunk's
    demotions already reserved)."""

    def __init__(self, store: PagedStore | Paged16Store, slot: int, n0: int, n1: int, sm_scale: float,
                 rotation: KeyRotation | None = None):
        super().__init__(store, sm_scale, rotation)
        self.slot, self.n0, self.n1 = slot, n0, n1
        self.dev = store.device
        if self.oscar:
            q0, n16 = store.qlens[slot], store.len16(slot)
            self.qlen = torch.tensor([q0], dtype=torch.int32, device=self.dev)
            self.len16 = torch.tensor([n16], dtype=torch.int32, device=self.dev)
            # the prefix lengths as host integers: the CUDA extend's cuDNN fold needs them, and reading them back
            # from the device would stall every layer
            self.host_lengths = ([q0], [n16])
        else:
            pos = torch.arange(n0, n1, device=self.dev)
            P = store.page_size
            self.page_ids, self.page_rows = store.block_table[slot, pos // P].long(), pos % P

    def attention(self, layer: int, q: Tensor, kv: Tensor, pdl: bool = False) -> Tensor:
        """``pdl`` is accepted for the decode context's signature and ignored (prefill runs eagerly)."""
        return self._oscar(layer, q, kv) if self.oscar else self._bf16(layer, q, kv)

    def _bf16(self, layer: int, q: Tensor, kv: Tensor) -> Tensor:
        st, P = self.store, self.store.page_size
        st.kv[layer][:, self.page_ids, :, self.page_rows] = kv.transpose(0, 1)
        n1, T = self.n1, q.shape[0]
        pages = st.block_table[self.slot, : (n1 + P - 1) // P].long()
        k, v = (st.kv[layer][i, pages].transpose(0, 1).reshape(st.H, -1, st.d)[:, :n1] for i in range(2))
        g = q.shape[1] // st.H
        k, v = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)
        qh = q.transpose(0, 1)
        if self.n0 == 0:
            o = sdpa(qh, k, v, is_causal=True, scale=self.sm_scale)
        else:
            mask = torch.arange(n1, device=self.dev)[None] <= torch.arange(self.n0, n1, device=self.dev)[:, None]
            o = sdpa(qh, k, v, attn_mask=mask, scale=self.sm_scale)
        return o.transpose(0, 1).reshape(T, -1, st.d)

    def _oscar(self, layer: int, q: Tensor, kv: Tensor) -> Tensor:
        st, s = self.store, self.slot
        if self.n0 == 0:  # nothing stored yet: plain causal attention in full precision
            k, v = (x.transpose(0, 1).repeat_interleave(q.shape[1] // st.H, 0) for x in kv)
            out = sdpa(q.transpose(0, 1), k, v, is_causal=True, scale=self.sm_scale).transpose(0, 1)
        else:
            buf = st.buf[:, layer, s: s + 1]
            out = dispatch.extend_attention(q[None], kv[0][None], kv[1][None], st.k_pages[layer], st.v_pages[layer],
                                            st.block_table[s: s + 1], self.qlen, buf[0], buf[1], self.len16,
                                            sm_scale=self.sm_scale, host_lengths=self.host_lengths)[0].to(q.dtype)
        st.write(layer, s, kv[0], kv[1])
        return out


__all__ = ["DecodeCtx", "KeyRotation", "PrefillCtx", "sdpa"]
