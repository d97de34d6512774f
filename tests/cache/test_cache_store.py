"""The paged store: tiers follow the policy whatever the chunking; quantized rows equal the reference quantizer bit
for bit; decode writes plus commit_decode equal chunk writes; bytes; slots; fixed sizing from a budget."""

import pytest
import torch

from oscarkv.cache import PagedStore, PageGeometry, TierPolicy, chunk_attention
from oscarkv.formats import FormatError, LayerFormat, TensorFormat
from oscarkv.kernels.layout import PageFormat
from oscarkv.quant import dequantize, dequantize_per_channel, quantize, quantize_per_channel

H, D = 2, 16
TOKEN2 = LayerFormat(TensorFormat("token", 2, "none", 0.9), TensorFormat("token", 2, "none", 0.0))
POLICY = TierPolicy(sink=4, window=8, unit=4)


def _rows(n, seed=0):
    return torch.randn(n, H, D, generator=torch.Generator().manual_seed(seed)) * 3


def _store(fmts=(TOKEN2,), slots=2, dtype=torch.float32, group=None, growable=True, num_pages=1):
    return PagedStore(list(fmts), POLICY, PageGeometry(H, D, 4, group), num_slots=slots, num_pages=num_pages,
                      max_pages=1, dtype16=dtype, device="cpu", growable=growable)


def _write(st, slot, k, v, chunks):
    t = 0
    for c in chunks:
        st.reserve(slot, st.lens[slot] + c)
        for layer in range(st.L):
            st.write(layer, slot, k[t:t + c], v[t:t + c])
        st.commit(slot, c)
        t += c


@pytest.mark.parametrize("chunks", [[30], [1] * 30, [3, 1, 7, 5, 14], [12, 1, 1, 16]])
def test_tiers_independent_of_chunking(chunks):
    st = _store()
    x = _rows(30, 4)
    _write(st, 1, x, -x, chunks)
    s, q, r = POLICY.split(30)
    t = st.tiers(0, 1)
    xt = x.transpose(0, 1)
    assert torch.equal(t["k_sink"], xt[:, :s]) and torch.equal(t["k_recent"], xt[:, s + q:])
    assert torch.equal(t["k_quantized"], dequantize(quantize(xt[:, s:s + q], clip_ratio=0.9)))
    assert torch.equal(t["v_quantized"], dequantize(quantize(-xt[:, s:s + q])))
    assert st.lens[:2] == [0, 30] and st.qlens[1] == q and st.len16(1) == s + r
    assert st.c16 <= POLICY.capacity16  # the 16-bit buffer stays bounded


@pytest.mark.parametrize("fmt", [TOKEN2, LayerFormat(TensorFormat("channel", 4, "none"), TensorFormat("token", 4)),
                                 LayerFormat(TensorFormat("channel", 2, "none"), TensorFormat("token", 2))])
def test_decode_then_commit_equals_chunk_writes(fmt):
    """A decode forward stores its token at decode_row; commit_decode demotes afterwards through the demote op:
    the same tiers, bit for bit, as writing the tokens as chunks."""
    x = _rows(29, 7)
    a, b = _store([fmt]), _store([fmt])
    _write(a, 0, x, x * 0.5, [29])
    _write(b, 0, x[:9], x[:9] * 0.5, [9])
    for t in range(9, 29):
        b.reserve(0, b.lens[0] + 1)
        row = b.decode_row(0)
        b.buf[0, 0, 0, :, row] = x[t].to(b.dtype16)
        b.buf[1, 0, 0, :, row] = (x[t] * 0.5).to(b.dtype16)
        b.commit_decode([0])
    ta, tb = a.tiers(0, 0), b.tiers(0, 0)
    for name in ta:
        assert torch.equal(ta[name], tb[name]), name
    assert a.qlens[0] == b.qlens[0] == 16 and a.lens[0] == b.lens[0] == 29


def test_channel_pages_match_kivi_quantizer():
    fmt = LayerFormat(TensorFormat("channel", 2, "none"), TensorFormat("token", 2, "none"))
    st = PagedStore([fmt], TierPolicy(0, 8, 8), PageGeometry(H, D, 8), num_slots=1, num_pages=1, max_pages=1,
                    dtype16=torch.float32, device="cpu", growable=True)
    x = _rows(40, 3)
    _write(st, 0, x, x, [16, 1, 23])  # 40 tokens: 32 quantized (4 whole pages), 8 in the window
    xt = x.transpose(0, 1)
    want = torch.cat([dequantize_per_channel(quantize_per_channel(xt[:, i: i + 8], group_size=8))
                      for i in range(0, 32, 8)], 1)
    assert st.qlens[0] == 32 and torch.equal(st.read_quantized(0, 0, 0, 0, 32), want)
    assert torch.equal(st.read_quantized(0, 0, 0, 5, 19), want[:, 5:19])
    kf = st.k_pages[0].fmt
    assert kf.channel and kf.bytes_per_token == H * (D * 2 // 8 * 8 + 2 * D * 2) / 8


def test_formats_the_store_cannot_pack_are_refused():
    channel = LayerFormat(TensorFormat("channel", 2, "none"), TensorFormat("token", 2))
    with pytest.raises(FormatError, match="written whole"):  # channel pages need page-wise demotion
        PagedStore([channel], TierPolicy(0, 0, 1), PageGeometry(H, D, 4), num_slots=1, num_pages=2, max_pages=1,
                   dtype16=torch.float32, device="cpu")
    with pytest.raises(FormatError, match="pages of 6 tokens"):  # 4-bit codes pack 2 tokens a byte per channel
        PageGeometry(H, D, 6).page_formats(LayerFormat(TensorFormat("channel", 2, "none"), TensorFormat()))
    with pytest.raises(FormatError, match="group"):
        PageGeometry(H, D, 4, group_size=5).page_formats(TOKEN2)
    with pytest.raises(ValueError, match="never demotes|demotes"):
        PagedStore([TOKEN2], TierPolicy(0, 2**62, 1), PageGeometry(H, D, 4), num_slots=1, num_pages=2, max_pages=1,
                   dtype16=torch.float32, device="cpu")


def test_slots_share_pages_and_move():
    st = _store(slots=3)
    x, y = _rows(30, 1), _rows(21, 2)
    _write(st, 0, x, x, [13, 17])
    _write(st, 1, y, y, [21])
    assert not set(st.table.pages[0]) & set(st.table.pages[1])
    before = st.tiers(0, 1)
    st.release(0)
    st.move(1, 0)
    assert st.lens[:2] == [21, 0] and st.qlens[:2] == [POLICY.quantized(21), 0]
    after = st.tiers(0, 0)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert st.allocator.num_free == st.allocator.capacity - st.pages_for(21)


def test_bytes_used_vs_allocated():
    st = _store(dtype=torch.bfloat16)
    _write(st, 0, _rows(29), _rows(29), [29])
    _write(st, 1, _rows(5), _rows(5), [5])
    b = st.nbytes()
    fmt = PageFormat(H, D, page_size=4)
    q0 = POLICY.quantized(29)
    assert b.tokens == 34 and b.quantized_tokens == q0
    assert b.used_16bit == 2 * (34 - q0) * H * D * 2
    assert b.used_quantized == 2 * q0 * fmt.bytes_per_token
    assert b.bf16_equivalent == 2 * 34 * H * D * 2 and b.elements == 2 * 34 * H * D
    assert b.allocated > b.used and b.unused == b.allocated - b.used
    st32 = _store(dtype=torch.float32)  # float32 windows count 4 bytes an element, not 2
    _write(st32, 0, _rows(29), _rows(29), [29])
    assert st32.nbytes().used_16bit == 2 * (29 - q0) * H * D * 4


def test_fixed_store_from_budget():
    geo = PageGeometry(H, D, 4)
    per_page = PagedStore.page_bytes([TOKEN2] * 3, geo)
    assert per_page == 3 * 4 * 2 * PageFormat(H, D, 4).bytes_per_token
    slot = PagedStore.slot_bytes(3, POLICY, geo, torch.bfloat16)
    st = PagedStore.for_budget([TOKEN2] * 3, POLICY, geo, budget_bytes=5 * slot + 10 * per_page, num_slots=4,
                               max_len=100, dtype16=torch.bfloat16, device="cpu")
    assert st.allocator.num_pages == 10 and st.block_table.shape == (5, 25) and st.c16 == POLICY.capacity16
    with pytest.raises(ValueError, match="raise kv_budget_gb"):
        PagedStore.for_budget([TOKEN2], POLICY, geo, budget_bytes=slot, num_slots=4, max_len=100,
                              dtype16=torch.bfloat16, device="cpu")


def test_chunk_attention_merges_pieces_exactly():
    g = torch.Generator().manual_seed(5)
    q = torch.randn(H, 3, 4, D, generator=g)  # 3 query heads per KV head, 4 new tokens
    pieces = [(torch.randn(H, n, D, generator=g), torch.randn(H, n, D, generator=g)) for n in (5, 0, 9)]
    kn, vn = torch.randn(H, 4, D, generator=g), torch.randn(H, 4, D, generator=g)
    out = chunk_attention(q, lambda: iter(pieces), kn, vn, None, scaling=0.3)
    torch.testing.assert_close(chunk_attention(q, lambda: iter(pieces), kn, vn, None, scaling=0.3, block=3), out)
    K = torch.cat([p[0] for p in pieces] + [kn], 1).double()
    V = torch.cat([p[1] for p in pieces] + [vn], 1).double()
    s = torch.einsum("hgtd,hnd->hgtn", q.double(), K) * 0.3
    mask = torch.ones(4, 18, dtype=torch.bool)
    mask[:, 14:] = torch.ones(4, 4, dtype=torch.bool).tril()
    ref = torch.einsum("hgtn,hnd->hgtd", torch.softmax(s.masked_fill(~mask, float("-inf")), -1), V)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    # a fully masked query row (left padding) gives zeros, not NaN
    m = torch.zeros(4, 4, dtype=torch.bool)
    m[1:] = True
    assert torch.equal(chunk_attention(q, lambda: iter([]), kn, vn, m, 0.3, block=2)[:, :, 0], torch.zeros(H, 3, D))
