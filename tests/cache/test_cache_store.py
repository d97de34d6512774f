"""Framework-free store: pools round-trip the reference quantizer bit for bit; tiers; physical bytes."""

import pytest
import torch

from oscarkv.cache import LayerStore, TierPolicy, TokenPool, chunk_attention
from oscarkv.kernels.layout import PageFormat
from oscarkv.quant import dequantize, dequantize_per_channel, quantize, quantize_per_channel

H, D = 2, 16


def _rows(n, seed=0):
    return torch.randn(H, n, D, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("bits,group", [(2, None), (2, 8), (4, None)])
def test_token_pool_roundtrip_and_ranges(bits, group):
    fmt = PageFormat(H, D, page_size=4, bits=bits, group_size=group)
    pool = TokenPool(fmt, clip=0.9, batch_size=3, device="cpu")
    x = _rows(23)
    for a, b in [(0, 5), (5, 6), (6, 23)]:  # uneven appends, partial pages
        pool.write(1, x[:, a:b])
    want = dequantize(quantize(x, bits=bits, group_size=group, clip_ratio=0.9))
    assert torch.equal(pool.read(1, 0, 23), want)
    assert torch.equal(pool.read(1, 7, 13), want[:, 7:13])
    assert torch.equal(pool.roundtrip(x), want)
    assert pool.qlen.tolist() == [0, 23, 0] and pool.tokens() == 23
    assert pool.used_bytes() == 23 * fmt.bytes_per_token
    assert pool.allocated_bytes() >= pool.used_bytes()
    with pytest.raises(IndexError):
        pool.read(1, 0, 24)


def test_token_pool_sequences_share_pages():
    fmt = PageFormat(H, D, page_size=4)
    pool = TokenPool(fmt, clip=0.0, batch_size=2, device="cpu")
    x, y = _rows(9, 1), _rows(6, 2)
    pool.write(0, x[:, :3])
    pool.write(1, y)
    pool.write(0, x[:, 3:])
    pages0, pages1 = pool._owned
    assert not set(pages0) & set(pages1)
    assert pool.block_table[0, :3].tolist() == pages0 and pool.block_table[1, :2].tolist() == pages1
    assert torch.equal(pool.read(0, 0, 9), dequantize(quantize(x)))
    assert torch.equal(pool.read(1, 0, 6), dequantize(quantize(y)))


def test_channel_pages_match_kivi_quantizer():
    pool = TokenPool(PageFormat(H, D, page_size=8, layout="channel"), 0.0, batch_size=1, device="cpu")
    x = _rows(24, 3)
    pool.write(0, x[:, :16])
    pool.write(0, x[:, 16:])
    want = torch.cat([dequantize_per_channel(quantize_per_channel(x[:, i: i + 8], group_size=8))
                      for i in range(0, 24, 8)], 1)
    assert torch.equal(pool.read(0, 0, 24), want)
    assert torch.equal(pool.read(0, 5, 19), want[:, 5:19])
    assert torch.equal(pool.roundtrip(x), want)
    assert pool.used_bytes() == 3 * H * D * (2 + 2 * 2)
    with pytest.raises(ValueError, match="written whole"):
        pool.write(0, x[:, :5])


def _store(policy, B=2, dtype=torch.float32):
    fmt = PageFormat(H, D, page_size=4)
    return LayerStore(policy, B, H, D, dtype, "cpu", TokenPool(fmt, 0.0, B, "cpu"), TokenPool(fmt, 0.0, B, "cpu"))


@pytest.mark.parametrize("chunks", [[30], [1] * 30, [3, 1, 7, 5, 14], [12, 1, 1, 16]])
def test_store_tiers_independent_of_chunking(chunks):
    pol = TierPolicy(sink=4, window=8, unit=4)
    st = _store(pol)
    x = _rows(30, 4)
    t = 0
    for c in chunks:
        st.append(0, x[:, t: t + c], -x[:, t: t + c])
        t += c
    s, q, r = pol.split(30)
    tiers = st.tiers(0)
    assert torch.equal(tiers["k_sink"], x[:, :s]) and torch.equal(tiers["k_recent"], x[:, s + q:])
    assert torch.equal(tiers["v_quantized"], dequantize(quantize(-x[:, s: s + q])))
    assert st.n == [30, 0] and st.len16.tolist() == [s + r, 0]
    assert st.k16.shape[2] <= pol.max_16bit  # the 16-bit buffer stays bounded


def test_store_bytes_used_vs_allocated():
    pol = TierPolicy(sink=4, window=8, unit=4)
    st = _store(pol, dtype=torch.bfloat16)
    st.append(0, _rows(29), _rows(29))
    st.append(1, _rows(5), _rows(5))
    b = st.nbytes()
    fmt = PageFormat(H, D, page_size=4)
    q0 = pol.quantized(29)
    assert b.tokens == 34 and b.quantized_tokens == q0
    assert b.used_16bit == 2 * (34 - q0) * H * D * 2
    assert b.used_quantized == 2 * q0 * fmt.bytes_per_token
    assert b.bf16_equivalent == 2 * 34 * H * D * 2 and b.elements == 2 * 34 * H * D
    assert b.allocated > b.used and b.unused == b.allocated - b.used


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
