"""A vLLM-like driver of the backend's per-step core (block tables, slot mapping, window slots), checked against a
dense model of the method's cache read by hand: shared by the tests of this folder (no vLLM import)."""

import numpy as np
import torch

from oscarkv.cache import PageGeometry, TierPolicy
from oscarkv.formats import LayerFormat, TensorFormat
from oscarkv.integrations.vllm.core import LayerParams, build_step, carve, decode_plan, page_bytes, quant_step
from oscarkv.integrations.vllm.options import windows_of
from oscarkv.integrations.vllm.windows import WindowSlots
from oscarkv.kernels.plan import DecodePlan
from oscarkv.quant import dequantize_per_channel, fake_quantize, quantize_per_channel
from oscarkv.rotation import random_orthogonal

TOKEN2 = LayerFormat(TensorFormat("token", 2, "calibrated", 0.96), TensorFormat("token", 2, "calibrated", 0.92))
WINDOWS = TierPolicy(sink=16, window=16, unit=16)
SINK_ONLY = TierPolicy(sink=16, window=0, unit=16)
NO_WINDOWS = TierPolicy(0, 0, 1)


def quantized_value(x16: torch.Tensor, fmt: TensorFormat, page: int) -> torch.Tensor:
    """What a 2-bit page of format ``fmt`` holds for rows ``x16`` ``[n, Hkv, d]`` (positions 0..n-1): token rows
    quantized one by one, or channel pages of ``page`` positions (a partial last page is never read: left as is)."""
    if not fmt.channel:
        return fake_quantize(x16, bits=fmt.bits, clip_ratio=fmt.clip, meta_dtype=torch.float16)
    out = x16.clone()
    for j in range(x16.shape[0] // page):
        rows = x16[j * page:(j + 1) * page].transpose(0, 1)  # [Hkv, page, d]
        q = quantize_per_channel(rows, bits=fmt.bits, group_size=page, meta_dtype=torch.float16)
        out[j * page:(j + 1) * page] = dequantize_per_channel(q).transpose(0, 1)
    return out


class Sim:
    """Sequences through vLLM-like steps (block tables, slot mapping), checked against a dense model."""

    def __init__(self, tiers: TierPolicy, num_slots=4, H=2, g=2, d=64, block=16, nb=64, seed=0, plan=False,
                 static=False, fmt: LayerFormat = TOKEN2, pad_rows=None):
        self.use_plan, self.plan = plan, None  # plan: one DecodePlan re-planned per step, as the metadata builder
        self.static = static  # static: decode-only steps padded into persistent buffers, as for CUDA graphs
        self.pad_rows = pad_rows  # padded to this many rows (vLLM's full-graph capture size), else to the bucket
        gen = torch.Generator().manual_seed(seed)
        self.gen, self.tiers, self.H, self.g, self.d, self.block = gen, tiers, H, g, d, block
        self.fmt, self.rows16 = fmt, windows_of(tiers)[1]
        kf, vf = PageGeometry(H, d, block).page_formats(fmt)
        self.kv = torch.zeros(nb, page_bytes(kf, vf), dtype=torch.uint8)
        self.pages = carve(self.kv, kf, vf)
        shape = (num_slots + 1, self.rows16, H, d)
        windows = tiers.windows
        pools = (torch.zeros(shape, dtype=torch.bfloat16), torch.zeros(shape, dtype=torch.bfloat16))
        self.pools = pools if windows else None
        self.slots, self.num_slots = (WindowSlots(num_slots) if windows else None), num_slots
        rot = torch.stack([random_orthogonal(d, gen) for _ in range(2 * H)])
        self.p = LayerParams(r_k=rot[:H], r_v=rot[H:], mu_k=torch.randn(H, d, generator=gen),
                             mu_v=torch.randn(H, d, generator=gen), k_clip=fmt.k.clip, v_clip=fmt.v.clip,
                             sm_scale=d**-0.5, channel=fmt.k.channel)
        self.tables, self.hist, self.next_block = {}, {}, 1

    def step(self, batch, all_2bit=(), out_dtype=None):
        """batch: [(seq, new_tokens)], decodes (1 token, existing seq) first; ``all_2bit``: sequences expected
        to have lost their window slot. Returns (got, expected)."""
        qsl, seq, slot_map = [0], [], []
        for sid, t in batch:
            n0 = len(self.hist.get(sid, ([], []))[0])
            table = self.tables.setdefault(sid, [])
            while len(table) * self.block < n0 + t:
                table.append(self.next_block)
                self.next_block += 1
            slot_map += [table[p // self.block] * self.block + p % self.block for p in range(n0, n0 + t)]
            qsl.append(qsl[-1] + t)
            seq.append(n0 + t)
        T, Hq = qsl[-1], self.H * self.g
        q = torch.randn(T, Hq, self.d, generator=self.gen)
        k = torch.randn(T, self.H, self.d, generator=self.gen) * 2 + 1
        v = torch.randn(T, self.H, self.d, generator=self.gen)
        width = max(len(self.tables[s]) for s, _ in batch)
        bt = torch.tensor([self.tables[s] + [0] * (width - len(self.tables[s])) for s, _ in batch], dtype=torch.int32)
        keys = np.array([self.tables[s][0] for s, _ in batch]) if self.slots else None
        m = build_step(self.tiers, self.slots, self.num_slots, np.array(qsl), np.array(seq), keys, bt,
                       torch.tensor(slot_map), self.block, pages=self.fmt.k.channel)
        if self.use_plan and self.pools is not None:
            self.plan = decode_plan(self.plan, m, lambda width: DecodePlan(
                self.num_slots, self.H * self.g, self.H, self.d, self.block, width, self.rows16))
            m.plan = self.plan if m.num_decodes else None
        buf = None if out_dtype is None else torch.full((T, Hq, self.d), float("nan"), dtype=out_dtype)
        if self.static is True:
            from oscarkv.integrations.vllm.graphs import StaticDecode

            plan = DecodePlan(self.num_slots, Hq, self.H, self.d, self.block, 16, self.rows16)
            self.static = StaticDecode(self.num_slots, 16, self.rows16, self.num_slots * self.rows16,
                                       plan, torch.device("cpu"), self.block if self.fmt.k.channel else 0)
        if self.static and m.num_decodes == len(batch):  # padded rows: garbage inputs that must write nothing
            m = self.static.fill(m, self.pad_rows)
            pad = m.num_tokens - T
            junk = lambda x: torch.cat([x, torch.randn(pad, *x.shape[1:]) * 9])  # noqa: E731
            got = quant_step(junk(q), junk(k), junk(v), self.pages, self.pools, self.p, m)[:T]
        else:
            got = quant_step(q, k, v, self.pages, self.pools, self.p, m, out=buf)  # buf: the backend's output
        assert buf is None or got is buf or self.static
        expected = torch.empty(got.shape, dtype=torch.float32)
        for r, (sid, t) in enumerate(batch):
            hk, hv = self.hist.setdefault(sid, ([], []))
            hk += list(k[qsl[r]:qsl[r + 1]])
            hv += list(v[qsl[r]:qsl[r + 1]])
            expected[qsl[r]:qsl[r + 1]] = self.dense(sid, q[qsl[r]:qsl[r + 1]], seq[r], t, decode=r < m.num_decodes,
                                                     windows=sid not in all_2bit)
        return got, expected

    def rot(self, x, mu, r, fmt):
        """(exact rotated rows, their 16-bit rounding, the 2-bit value quantized from that rounding)"""
        xr = torch.einsum("nhd,hde->nhe", x - mu, r)
        x16 = xr.to(self.p.dtype16).float()
        return xr, x16, quantized_value(x16, fmt, self.block)

    def dense(self, sid, q, n, t, decode, windows=True):
        """The method's cache read by hand: the prefix as stored before the step (16-bit tiers, 2-bit middle),
        then the step's own tokens (a prefill chunk unrounded; a decode token from the 16-bit ring)."""
        hk, hv = (torch.stack(x) for x in self.hist[sid])
        kr, k16, kq = self.rot(hk, self.p.mu_k, self.p.r_k, self.fmt.k)
        vr, v16, vq = self.rot(hv, self.p.mu_v, self.p.r_v, self.fmt.v)
        n0 = n - t
        K, V = kq.clone(), vq.clone()
        K[n0:], V[n0:] = kr[n0:], vr[n0:]  # the chunk itself
        if windows and self.tiers.windows:
            qlen, S = self.tiers.quantized(n0), self.tiers.sink
            w16 = torch.zeros(n, dtype=torch.bool)
            w16[:S], w16[S + qlen:] = True, True
            if not decode:
                w16[n0:] = False
            K[w16], V[w16] = k16[w16], v16[w16]
        elif windows is False and decode:  # a decode row that lost its slot reads itself from the 2-bit pages
            K[n0:], V[n0:] = kq[n0:], vq[n0:]
        K, V = K.repeat_interleave(self.g, 1), V.repeat_interleave(self.g, 1)
        qr = torch.einsum("nhgd,hde->nhge", q.view(t, self.H, self.g, self.d), self.p.r_k).reshape(t, -1, self.d)
        s = torch.einsum("thd,jhd->thj", qr, K) * self.p.sm_scale
        pos = torch.arange(n0, n)[:, None, None]
        s = s.masked_fill(torch.arange(n)[None, None] > pos, float("-inf"))
        o = torch.einsum("thj,jhd->thd", s.softmax(-1), V).view(t, self.H, self.g, self.d)
        return (torch.einsum("nhge,hde->nhgd", o, self.p.r_v) + self.p.mu_v[None, :, None]).reshape(t, -1, self.d)
