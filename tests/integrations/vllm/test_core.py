"""The vLLM backend's per-step logic (tiers, window slots, page carving, one attention layer) against a brute-force
model of the method's cache, with no vLLM import: runs in the project's own venv in well under a minute."""

import numpy as np
import pytest
import torch

from oscarkv.cache import PageGeometry, TierPolicy
from oscarkv.formats import LayerFormat, TensorFormat
from oscarkv.integrations.vllm.core import (build_step, carve, causal_self_attention, dense_step, fresh_chunk_attention,
                                           page_bytes, prebuild_decode_kernels)
from oscarkv.integrations.vllm.windows import WindowSlots
from oscarkv.kernels.layout import PageFormat

from vllm_sim import NO_WINDOWS, SINK_ONLY, WINDOWS, Sim  # noqa: E402  (pytest puts this folder on sys.path)


def test_backend_reads_the_stores_tier_rule():
    """The backend has no tier rule of its own: TierPolicy's, with the recent window in a ring of window + unit."""
    from oscarkv.integrations.vllm.options import windows_of

    t = TierPolicy(sink=64, window=256, unit=64)
    assert [t.quantized(n) for n in (1, 64, 320, 383, 384, 447, 448, 1000)] == [0, 0, 0, 0, 64, 64, 128, 640]
    for n in range(1, 2000, 7):  # recent window holds W .. W + page - 1 tokens once it is full
        rec = n - min(n, 64) - t.quantized(n)
        assert rec < 256 + 64 and (n < 64 + 256 or rec >= 256)
    assert windows_of(t) == (320, 384) and windows_of(NO_WINDOWS) == (0, 0) and NO_WINDOWS.quantized(1000) == 1000


def test_page_bytes_and_carve_tile_the_cache_with_contiguous_pools():
    fmt = PageFormat(num_kv_heads=8, head_dim=128, page_size=64)
    assert page_bytes(fmt, fmt) == 2 * 8 * 64 * (32 + 4)  # 576 bytes/token vs 4096 for BF16: 7.1x
    kv = torch.zeros(3, page_bytes(fmt, fmt), dtype=torch.uint8)
    k, v = carve(kv, fmt, fmt)
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


@pytest.mark.parametrize("tiers", [WINDOWS, SINK_ONLY, NO_WINDOWS])
def test_quant_step_matches_dense_model_of_the_cache(tiers):
    sim = Sim(tiers)  # sequences cross several demotions (every 16 tokens) by prefill chunks and decodes
    steps = [[("a", 40)], [("a", 1), ("b", 23)], [("a", 1), ("b", 1), ("c", 45)]]
    steps += [[("a", 1), ("b", 1), ("c", 1)]] * 18 + [[("a", 1), ("c", 1), ("b", 33)]]
    for batch in steps:
        got, expected = sim.step(batch)
        torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-4)


def test_lost_window_slot_degrades_to_2bit_without_reading_other_rows():
    sim = Sim(WINDOWS, num_slots=2)
    sim.step([("a", 20), ("b", 20)])
    sim.step([("c", 20)])  # recycles a's slot (least recently used): a is then served from its 2-bit pages only
    got, expected = sim.step([("a", 1), ("b", 1)], all_2bit={"a"})
    assert sim.slots.degraded == 1
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-4)


def test_dense_step_is_exact_attention():
    gen = torch.Generator().manual_seed(1)
    H, g, d, blk = 2, 2, 64, 16
    sim = Sim(NO_WINDOWS, H=H, g=g, d=d, block=blk)
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
        m = build_step(NO_WINDOWS, None, 1, qsl, seq, None, bt, slot_map, blk)
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
    q = torch.randn(T, H * g, d, generator=gen)
    k, v = torch.randn(T, H, d, generator=gen), torch.randn(T, H, d, generator=gen)
    fmt = PageFormat(H, d, page_size=16)
    from oscarkv.kernels.layout import QuantPages

    pages = QuantPages.allocate(fmt, 1)
    zeros, z16 = torch.zeros(1, dtype=torch.int32), torch.zeros(1, H, 1, d)
    want = extend_attention_ref(q[None], k[None], v[None], pages, pages, torch.zeros(1, 1, dtype=torch.int32), zeros,
                                z16, z16, zeros, d**-0.5)[0]
    got = causal_self_attention(q, k, v, d**-0.5)
    torch.testing.assert_close(got, want.to(got.dtype), rtol=1e-4, atol=1e-5)


def _fresh_chunks(device, dtype, spans, seed=5):
    gen = torch.Generator().manual_seed(seed)
    T, H, g, d = spans[-1][1] + 3, 2, 4, 128
    q = torch.randn(T, H * g, d, generator=gen).to(device, dtype)
    k, v = (torch.randn(T, H, d, generator=gen).to(device, dtype) for _ in range(2))
    want = torch.full(q.shape, 7.0, dtype=dtype, device=device)  # rows outside the spans stay untouched
    for a, b in spans:
        want[a:b] = causal_self_attention(q[a:b], k[a:b], v[a:b], d**-0.5)
    return q, k, v, want


@pytest.mark.parametrize("spans", [[(0, 40)], [(2, 19), (19, 50), (50, 51)], [(0, 9), (12, 30)]])
def test_fresh_chunk_attention_attends_within_each_chunk(spans):
    """Adjacent and separated chunks: each chunk alone, causal; other rows of ``out`` are not written."""
    q, k, v, want = _fresh_chunks("cpu", torch.float32, spans)
    got = torch.full(q.shape, 7.0)
    fresh_chunk_attention(q, k, v, spans, 128**-0.5, got)
    torch.testing.assert_close(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("spans", [[(0, 4000)], [(0, 1000), (1000, 3500), (3500, 3501)], [(0, 700), (900, 2000)]])
def test_fresh_chunk_attention_flash_matches_sdpa(spans):
    """vLLM's varlen FlashAttention (bfloat16) against torch SDPA per chunk: within bfloat16 rounding of the
    outputs (atol 8e-3, rtol 1.6e-2)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("vllm")
    from oscarkv.integrations.vllm import core

    if core._flash_varlen() is None:
        pytest.skip("this vLLM build has no FlashAttention varlen")
    q, k, v, want = _fresh_chunks("cuda", torch.bfloat16, spans)
    got = torch.full(q.shape, 7.0, dtype=torch.bfloat16, device="cuda")
    fresh_chunk_attention(q, k, v, spans, 128**-0.5, got)
    torch.testing.assert_close(got, want, atol=8e-3, rtol=1.6e-2)


def test_decode_plan_is_built_once_and_replanned_per_step():
    sim = Sim(WINDOWS, plan=True)
    for batch in ([("a", 40), ("b", 3)], [("a", 1), ("b", 1)], [("a", 1), ("b", 1), ("c", 5)], [("a", 1)]):
        got, want = sim.step(batch)
        torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
        if batch == [("a", 1), ("b", 1)]:
            first = sim.plan
    assert sim.plan is first and sim.plan.batch == 1 and sim.plan.max_batch == sim.num_slots


def test_quant_step_writes_the_output_buffer():
    sim = Sim(WINDOWS)
    for batch in ([("a", 30)], [("a", 1), ("b", 7)], [("a", 1), ("b", 1)]):  # prefill, mixed, decode-only
        got, want = sim.step(batch, out_dtype=torch.bfloat16)
        assert got.dtype == torch.bfloat16 and not got.isnan().any()
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("pad_rows", [None, 6])
def test_padded_decode_steps_equal_unpadded(pad_rows):
    """Decode-only steps padded to a graph bucket, or to a fixed size as vLLM pads a batch for its full graphs
    (persistent buffers, inert padded rows with garbage inputs): the real rows' outputs, and everything later
    steps read, are those of the unpadded steps."""
    from oscarkv.integrations.vllm.graphs import bucket_for

    assert [bucket_for(b, 48) for b in (1, 3, 5, 13, 33, 47, 48)] == [1, 4, 8, 16, 40, 48, 48]
    sim = Sim(WINDOWS, num_slots=6, static=True, pad_rows=pad_rows)
    steps = [[("a", 40)], [("b", 23)], [("c", 3)]] + [[("a", 1), ("b", 1), ("c", 1)]] * 20
    steps += [[("a", 1), ("c", 1), ("b", 9)], [("a", 1), ("b", 1), ("c", 1)]]
    for batch in steps:
        got, expected = sim.step(batch)
        torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-4)


def test_prebuild_decode_kernels_reports_and_never_raises(monkeypatch):
    """At start the plugin builds the CUDA decode cubins for every batch up to max_seqs; a failed build warns
    (the kernel then builds on first use) instead of stopping the server."""
    from oscarkv.kernels import decode_cuda

    k_fmt, v_fmt = PageFormat(8, 128, page_size=64, layout="channel"), PageFormat(8, 128, page_size=64, bits=4)
    seen, warned = [], []
    monkeypatch.setattr(decode_cuda, "prebuild", lambda *a, **k: seen.append((a, k)) or ["a", "b", "c", "d"])
    assert prebuild_decode_kernels(k_fmt, v_fmt, 16, torch.bfloat16, torch.bfloat16, 34, warned.append) == 4
    # the value pages' own format reaches the build (a 2-bit key layer with 4-bit values is another kernel)
    assert seen == [((k_fmt, 16, torch.bfloat16, torch.bfloat16, 34), {"v_fmt": v_fmt})] and warned == []

    def fail(*a, **k):
        raise RuntimeError("nvcc failed (sm_90)")

    monkeypatch.setattr(decode_cuda, "prebuild", fail)
    assert prebuild_decode_kernels(k_fmt, v_fmt, 16, torch.bfloat16, torch.bfloat16, 34, warned.append) == 0
    assert len(warned) == 1 and "nvcc failed" in warned[0] and "first use" in warned[0]


CHANNEL2_TOKEN4 = LayerFormat(TensorFormat("channel", 2, "none"), TensorFormat("token", 4, "calibrated", 0.9))
CHANNEL4_TOKEN2 = LayerFormat(TensorFormat("channel", 4, "calibrated"), TensorFormat("token", 2, "none", 0.92))
TOKEN4_TOKEN2 = LayerFormat(TensorFormat("token", 4, "hadamard", 0.95), TensorFormat("token", 2, "none"))
TOKEN2_TOKEN2 = LayerFormat(TensorFormat("token", 2, "hadamard", 0.96), TensorFormat("token", 2, "none"))


@pytest.mark.parametrize("fmt,static", [(CHANNEL2_TOKEN4, False), (TOKEN4_TOKEN2, False), (CHANNEL4_TOKEN2, True)],
                         ids=["ch2-tok4-eager", "tok4-tok2-eager", "ch4-tok2-padded"])
def test_per_layer_formats_match_dense_model_of_the_cache(fmt, static):
    """Channel-page keys (pages written whole when their last token arrives, from the 16-bit rows: a long chunk's
    own rows, or the ring for a page a decode completes) and 4-bit pages, against the method's cache read by hand;
    decode-only steps also padded into the graph buffers."""
    sim = Sim(WINDOWS, fmt=fmt, num_slots=6, static=static)
    steps = [[("a", 40)], [("a", 1), ("b", 23)], [("a", 1), ("b", 1), ("c", 45)]]
    steps += [[("a", 1), ("b", 1), ("c", 1)]] * 8 + [[("a", 1), ("c", 1), ("b", 33)], [("b", 1), ("a", 7)]]
    for batch in steps:  # pages completed by one chunk, across chunks, by a decode; graph-padded decode steps
        got, expected = sim.step(batch)
        torch.testing.assert_close(got, expected, atol=3e-4, rtol=1e-4)
    assert sim.tiers.quantized(sim.tiers.sink + 90) > 0  # the 2-bit tier was read


@pytest.mark.parametrize("fmt", [CHANNEL2_TOKEN4, CHANNEL4_TOKEN2, TOKEN4_TOKEN2, TOKEN2_TOKEN2],
                         ids=["ch2-tok4", "ch4-tok2", "tok4-tok2", "tok2-tok2"])
def test_three_writers_store_bit_identical_pages(fmt):
    """The same 16-bit rows written by the three writers hold the same 2-bit pages, bit for bit: vLLM's backend
    (tokens at arrival, or channel pages whole when complete), the store's chunk write (the transformers cache and
    the engine's prefill) and the store's decode demotion (the engine's decode, through the demote op). Every key
    format (token2/token4/channel2/channel4) and value format (token2/token4), at 2 KV heads of d 64 (the geometry
    of Qwen2.5-Coder-0.5B and of the tiny Llama of test_engine.py)."""
    from oscarkv.cache import PagedStore

    sim = Sim(WINDOWS, fmt=fmt)
    assert (sim.H, sim.d) == (2, 64)
    for batch in ([("a", 50)], *[[("a", 1)]] * 14):  # the last decode completes (and demotes) tier page 1
        sim.step(batch)
    n = 64
    k16, v16 = (sim.rot(torch.stack(x), mu, r, f)[1] for x, mu, r, f in
                zip(sim.hist["a"], (sim.p.mu_k, sim.p.mu_v), (sim.p.r_k, sim.p.r_v), fmt))
    stores = [PagedStore([fmt], WINDOWS, PageGeometry(2, 64, 16), num_slots=1, num_pages=8, max_pages=8,
                         dtype16=torch.bfloat16, device="cpu") for _ in range(2)]
    chunk, decode = stores
    chunk.reserve(0, n)
    chunk.write(0, 0, k16, v16)
    chunk.commit(0, n)
    decode.reserve(0, 50)
    decode.write(0, 0, k16[:50], v16[:50])
    decode.commit(0, 50)
    for t in range(50, n):  # a decode forward stores the token's row, the demotion follows
        decode.reserve(0, t + 1)
        row = decode.decode_row(0)
        decode.buf[0, 0, 0, :, row], decode.buf[1, 0, 0, :, row] = k16[t], v16[t]
        decode.commit_decode([0])
    q = WINDOWS.quantized(n)
    assert q == 32 and decode.qlens[0] == 32
    table = sim.tables["a"]
    for which, vllm_pages in enumerate(sim.pages):
        for j in range(q // 16):  # tier page j: vLLM block S/16 + j of sequence a, store page j of slot 0
            for st in stores:
                ours = (st.k_pages, st.v_pages)[which][0]
                vb, sb = table[WINDOWS.sink // 16 + j], st.table.pages[0][j]
                for name in ("codes", "scale", "offset"):
                    assert torch.equal(getattr(vllm_pages, name)[vb], getattr(ours, name)[sb]), (which, j, name)
