"""The vLLM backend's per-step logic (tiers, window slots, page carving, one attention layer) against a brute-force
model of the method's cache, with no vLLM import: runs in the project's own venv in well under a minute."""

import numpy as np
import pytest
import torch

from oscarkv.integrations.vllm.core import (LayerParams, build_step, carve, causal_self_attention, decode_plan,
                                           dense_step, page_bytes, prebuild_decode_kernels, quant_step)
from oscarkv.integrations.vllm.options import Tiering
from oscarkv.integrations.vllm.windows import WindowSlots
from oscarkv.kernels.layout import PageFormat
from oscarkv.kernels.plan import DecodePlan
from oscarkv.quant import fake_quantize
from oscarkv.rotation import random_orthogonal


def test_tiering_matches_method_demotion():
    t = Tiering(sink=64, window=256, page=64)
    assert [t.qlen(n) for n in (1, 64, 320, 383, 384, 447, 448, 1000)] == [0, 0, 0, 0, 64, 64, 128, 640]
    for n in range(1, 2000, 7):  # recent window holds W .. W + page - 1 tokens once it is full
        rec = n - min(n, 64) - t.qlen(n)
        assert rec < 256 + 64 and (n < 64 + 256 or rec >= 256)
    off = Tiering(64, 256, 64, enabled=False)
    assert off.qlen(1000) == 1000 and off.rows16 == 0


def test_page_bytes_and_carve_tile_the_cache_with_contiguous_pools():
    fmt = PageFormat(num_kv_heads=8, head_dim=128, page_size=64)
    assert page_bytes(fmt) == 2 * 8 * 64 * (32 + 4)  # 576 bytes/token vs 4096 for BF16: 7.1x
    kv = torch.zeros(3, page_bytes(fmt), dtype=torch.uint8)
    k, v = carve(kv, fmt)
    pools = (k.codes, v.codes, k.scale, k.offset, v.scale, v.offset)
    assert all(t.is_contiguous() for t in pools) and k.codes.shape == (3, 8, 64, 32) and k.scale.shape == (3, 8, 64, 1)
    for i, t in enumerate(pools):
        t.view(torch.uint8).fill_(i + 1)
    counts = torch.bincount(kv.view(-1).long(), minlength=7).tolist()
    assert counts == [0, 3 * 8 * 64 * 32, 3 * 8 * 64 * 32] + [3 * 8 * 64 * 2] * 4


def test_window_slots_recycle_least_recent_and_degrade():
    s = WindowSlots(2)
    assert s.assign(np.array([5, 9]), np.array([True, True])).tolist() == [0, 1]
    assert s.assign(np.array([5]), np.array([False])).tolist() == [0]
    assert s.assign(np.array([7]), np.array([True])).tolist() == [1]  # 9 was least recently used
    assert s.assign(np.array([9]), np.array([False])).tolist() == [-1] and s.degraded == 1


class Sim:
    """Sequences through vLLM-like steps (block tables, slot mapping), checked against a dense model."""

    def __init__(self, tiers, num_slots=4, H=2, g=2, d=64, block=16, nb=64, seed=0, plan=False, static=False):
        self.use_plan, self.plan = plan, None  # plan: one DecodePlan re-planned per step, as the metadata builder
        self.static = static  # static: decode-only steps padded into persistent buffers, as for CUDA graphs
        gen = torch.Generator().manual_seed(seed)
        self.gen, self.tiers, self.H, self.g, self.d, self.block = gen, tiers, H, g, d, block
        fmt = PageFormat(H, d, page_size=block)
        self.kv = torch.zeros(nb, page_bytes(fmt), dtype=torch.uint8)
        self.pages = carve(self.kv, fmt)
        shape = (num_slots + 1, tiers.rows16, H, d)
        self.pools = (torch.zeros(shape, dtype=torch.bfloat16), torch.zeros(shape, dtype=torch.bfloat16)) if tiers.enabled else None
        self.slots, self.num_slots = (WindowSlots(num_slots) if tiers.enabled else None), num_slots
        rot = torch.stack([random_orthogonal(d, gen) for _ in range(2 * H)])
        self.p = LayerParams(r_k=rot[:H], r_v=rot[H:], mu_k=torch.randn(H, d, generator=gen),
                             mu_v=torch.randn(H, d, generator=gen), k_clip=0.96, v_clip=0.92, sm_scale=d**-0.5)
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
                       torch.tensor(slot_map), self.block)
        if self.use_plan and self.pools is not None:
            self.plan = decode_plan(self.plan, m, lambda width: DecodePlan(
                self.num_slots, self.H * self.g, self.H, self.d, self.block, width, self.tiers.rows16))
            m.plan = self.plan if m.num_decodes else None
        buf = None if out_dtype is None else torch.full((T, Hq, self.d), float("nan"), dtype=out_dtype)
        if self.static is True:
            from oscarkv.integrations.vllm.graphs import StaticDecode

            plan = DecodePlan(self.num_slots, Hq, self.H, self.d, self.block, 16, self.tiers.rows16)
            self.static = StaticDecode(self.num_slots, 16, self.tiers.rows16, self.num_slots * self.tiers.rows16,
                                       plan, torch.device("cpu"))
        if self.static and m.num_decodes == len(batch):  # padded rows: garbage inputs that must write nothing
            m = self.static.fill(m)
            pad = m.num_tokens - T
            got = quant_step(torch.cat([q, torch.randn(pad, Hq, self.d) * 9]), torch.cat([k, torch.randn(pad, self.H,
                             self.d) * 9]), torch.cat([v, torch.randn(pad, self.H, self.d) * 9]), self.pages, self.pools,
                             self.p, m)[:T]
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

    def rot(self, x, mu, r, clip):
        """(exact rotated rows, their 16-bit rounding, the 2-bit value quantized from that rounding)"""
        xr = torch.einsum("nhd,hde->nhe", x - mu, r)
        x16 = xr.to(self.p.dtype16).float()
        return xr, x16, fake_quantize(x16, bits=2, clip_ratio=clip, meta_dtype=torch.float16)

    def dense(self, sid, q, n, t, decode, windows=True):
        """The method's cache read by hand: the prefix as stored before the step (16-bit tiers, 2-bit middle),
        then the step's own tokens (a prefill chunk unrounded; a decode token from the 16-bit ring)."""
        hk, hv = (torch.stack(x) for x in self.hist[sid])
        kr, k16, kq = self.rot(hk, self.p.mu_k, self.p.r_k, self.p.k_clip)
        vr, v16, vq = self.rot(hv, self.p.mu_v, self.p.r_v, self.p.v_clip)
        n0 = n - t
        K, V = kq.clone(), vq.clone()
        K[n0:], V[n0:] = kr[n0:], vr[n0:]  # the chunk itself
        if windows and self.tiers.enabled:
            qlen, S = self.tiers.qlen(n0), self.tiers.sink
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


@pytest.mark.parametrize("tiers", [Tiering(sink=16, window=16, page=16), Tiering(sink=16, window=0, page=16),
                                   Tiering(0, 0, 16, enabled=False)])
def test_quant_step_matches_dense_model_of_the_cache(tiers):
    sim = Sim(tiers)  # sequences cross several demotions (every 16 tokens) by prefill chunks and decodes
    steps = [[("a", 40)], [("a", 1), ("b", 23)], [("a", 1), ("b", 1), ("c", 45)]]
    steps += [[("a", 1), ("b", 1), ("c", 1)]] * 18 + [[("a", 1), ("c", 1), ("b", 33)]]
    for batch in steps:
        got, expected = sim.step(batch)
        torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-4)


def test_lost_window_slot_degrades_to_2bit_without_reading_other_rows():
    sim = Sim(Tiering(sink=16, window=16, page=16), num_slots=2)
    sim.step([("a", 20), ("b", 20)])
    sim.step([("c", 20)])  # recycles a's slot (least recently used): a is then served from its 2-bit pages only
    got, expected = sim.step([("a", 1), ("b", 1)], all_2bit={"a"})
    assert sim.slots.degraded == 1
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-4)


def test_dense_step_is_exact_attention():
    gen = torch.Generator().manual_seed(1)
    H, g, d, blk = 2, 2, 64, 16
    sim = Sim(Tiering(0, 0, blk, enabled=False), H=H, g=g, d=d, block=blk)
    kv16 = torch.zeros(8, 2, H, blk, d)
    hist = {"a": ([], []), "b": ([], [])}
    tables = {"a": [1, 2, 3], "b": [4, 5, 6]}
    for batch in ([("a", 30)], [("a", 1), ("b", 5)], [("a", 1), ("b", 1)]):
        n0 = [len(hist[s][0]) for s, _ in batch]
        qsl = np.cumsum([0] + [t for _, t in batch])
        seq = np.array([a + t for a, (_, t) in zip(n0, batch)])
        bt = torch.tensor([tables[s] for s, _ in batch], dtype=torch.int32)
        slot_map = torch.tensor([tables[s][p // blk] * blk + p % blk for (s, t), a in zip(batch, n0)
                                 for p in range(a, a + t)])
        m = build_step(sim.tiers, None, 1, qsl, seq, None, bt, slot_map, blk)
        T = int(qsl[-1])
        q = torch.randn(T, H * g, d, generator=gen)
        k, v = torch.randn(T, H, d, generator=gen), torch.randn(T, H, d, generator=gen)
        out = dense_step(q, k, v, kv16, sim.p, m)
        for r, (s, t) in enumerate(batch):
            hist[s][0].extend(k[qsl[r]:qsl[r + 1]])
            hist[s][1].extend(v[qsl[r]:qsl[r + 1]])
            K, V = (torch.stack(x).repeat_interleave(g, 1) for x in hist[s])
            sc = torch.einsum("thd,jhd->thj", q[qsl[r]:qsl[r + 1]], K) * sim.p.sm_scale
            pos = torch.arange(n0[r], n0[r] + t)[:, None, None]
            sc = sc.masked_fill(torch.arange(len(K))[None, None] > pos, float("-inf"))
            ref = torch.einsum("thj,jhd->thd", sc.softmax(-1), V)
            torch.testing.assert_close(out[qsl[r]:qsl[r + 1]], ref, atol=2e-4, rtol=1e-4)


def test_causal_self_attention_is_the_extend_reference_without_a_prefix():
    """The fresh-chunk path (SDPA) computes what the extend reference computes for a chunk with nothing stored."""
    from oscarkv.kernels.reference import extend_attention_ref

    gen = torch.Generator().manual_seed(3)
    T, H, g, d = 23, 2, 3, 64
    q, k, v = torch.randn(T, H * g, d, generator=gen), torch.randn(T, H, d, generator=gen), torch.randn(T, H, d, generator=gen)
    fmt = PageFormat(H, d, page_size=16)
    from oscarkv.kernels.layout import QuantPages

    pages = QuantPages.allocate(fmt, 1)
    zeros, z16 = torch.zeros(1, dtype=torch.int32), torch.zeros(1, H, 1, d)
    want = extend_attention_ref(q[None], k[None], v[None], pages, pages, torch.zeros(1, 1, dtype=torch.int32), zeros,
                                z16, z16, zeros, d**-0.5)[0]
    got = causal_self_attention(q, k, v, d**-0.5)
    torch.testing.assert_close(got, want.to(got.dtype), rtol=1e-4, atol=1e-5)


def test_decode_plan_is_built_once_and_replanned_per_step():
    tiers = Tiering(sink=16, window=16, page=16)
    sim = Sim(tiers, plan=True)
    for batch in ([("a", 40), ("b", 3)], [("a", 1), ("b", 1)], [("a", 1), ("b", 1), ("c", 5)], [("a", 1)]):
        got, want = sim.step(batch)
        torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
        if batch == [("a", 1), ("b", 1)]:
            first = sim.plan
    assert sim.plan is first and sim.plan.batch == 1 and sim.plan.max_batch == sim.num_slots


def test_quant_step_writes_the_output_buffer():
    sim = Sim(Tiering(sink=16, window=16, page=16))
    for batch in ([("a", 30)], [("a", 1), ("b", 7)], [("a", 1), ("b", 1)]):  # prefill, mixed, decode-only
        got, want = sim.step(batch, out_dtype=torch.bfloat16)
        assert got.dtype == torch.bfloat16 and not got.isnan().any()
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=1e-2)


def test_padded_decode_steps_equal_unpadded():
    """Decode-only steps padded to a graph bucket (persistent buffers, inert padded rows with garbage inputs): the
    real rows' outputs, and everything later steps read, are those of the unpadded steps."""
    from oscarkv.integrations.vllm.graphs import bucket_for

    assert [bucket_for(b, 48) for b in (1, 3, 5, 13, 33, 47, 48)] == [1, 4, 8, 16, 40, 48, 48]
    sim = Sim(Tiering(sink=16, window=16, page=16), num_slots=6, static=True)
    steps = [[("a", 40)], [("b", 23)], [("c", 3)]] + [[("a", 1), ("b", 1), ("c", 1)]] * 20
    steps += [[("a", 1), ("c", 1), ("b", 9)], [("a", 1), ("b", 1), ("c", 1)]]
    for batch in steps:
        got, expected = sim.step(batch)
        torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-4)


def test_prebuild_decode_kernels_reports_and_never_raises(monkeypatch):
    """At start the plugin builds the CUDA decode cubins for every batch up to max_seqs; a failed build warns
    (the kernel then builds on first use) instead of stopping the server."""
    from oscarkv.kernels import decode_cuda

    fmt, seen, warned = PageFormat(8, 128, page_size=64), [], []
    monkeypatch.setattr(decode_cuda, "prebuild", lambda *a, **k: seen.append((a, k)) or ["a", "b", "c", "d"])
    assert prebuild_decode_kernels(fmt, 16, torch.bfloat16, torch.bfloat16, 34, warned.append) == 4
    assert seen == [((fmt, 16, torch.bfloat16, torch.bfloat16, 34), {})] and warned == []

    def fail(*a, **k):
        raise RuntimeError("nvcc failed (sm_90)")

    monkeypatch.setattr(decode_cuda, "prebuild", fail)
    assert prebuild_decode_kernels(fmt, 16, torch.bfloat16, torch.bfloat16, 34, warned.append) == 0
    assert len(warned) == 1 and "nvcc failed" in warned[0] and "first use" in warned[0]
