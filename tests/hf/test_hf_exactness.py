"""Exactness of the transformers integration on tiny random Llama / Qwen2 / Qwen3 / Gemma3 models."""

import pytest
import torch
from transformers import DynamicCache

import oscarkv.hf as ohf
from oscarkv.kernels.layout import QuantPages
from oscarkv.kernels.reference import extend_attention_ref, gather_dequant_ref

from hf_helpers import VOCAB, decode_logits, identity_calibration, random_calibration, spec, tiny_model


def _reference(model, ids, prompt_len):
    cache = DynamicCache(config=model.config)
    return decode_logits(model, ids, cache, prompt_len=prompt_len)


def test_bf16_method_identity_equals_dynamic_cache(arch):
    model = tiny_model(arch)
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
    ref = _reference(model, ids, prompt_len=16)
    with ohf.apply(model, identity_calibration(model), "bf16", window_dtype=torch.float32) as h:
        out = decode_logits(model, ids, h.cache(), prompt_len=16)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=0)


@pytest.mark.parametrize("granularity", ["layer", "head"])
def test_rotation_without_quantization_matches_float32(arch, granularity):
    """Random rotations, centering and V folding, windows larger than the text: logits agree to rounding."""
    model = tiny_model(arch)
    calib = random_calibration(model, spec(sink=4, window=512, granularity=granularity), mu_scale=1.0)
    ids = torch.randint(0, VOCAB, (2, 30), generator=torch.Generator().manual_seed(1))
    ref = _reference(model, ids, prompt_len=20)
    with ohf.apply(model, calib, "oscar", window_dtype=torch.float32) as h:
        cache = h.cache()
        out = decode_logits(model, ids, cache, prompt_len=20)
        assert cache.nbytes().quantized_tokens == 0
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)


def _attend_one_chunk(model, layer_idx, cache, T, seed=0):
    """Drive one OscarLayer directly with random q/k/v of a T-token chunk; returns (out, q, k, v, layer)."""
    attn = model.get_decoder().layers[layer_idx].self_attn
    layer = cache.layers[layer_idx]
    g = torch.Generator().manual_seed(seed)
    B, H, d = 2, 2, 16
    q = torch.randn(B, 4, T, d, generator=g)
    k = torch.randn(B, H, T, d, generator=g)
    v = torch.randn(B, H, T, d, generator=g)
    fwd = {}
    sk, sv = cache.update(k, v, layer_idx, kwargs=fwd)
    assert fwd["oscar_layer"] is layer
    out = layer.attend(attn, q, sk, sv, None, scaling=d**-0.5)
    return out, q, k, v, layer


@pytest.mark.parametrize("method", ["oscar", "kivi-2", "naive-int2", "int4-hadamard"])
def test_quantized_attention_equals_float_attention_over_dequantized(method):
    model = tiny_model("llama")
    calib = random_calibration(model, spec(sink=4, window=8, page_size=4), clip=(0.9, 0.9))
    n = 200 if method == "kivi-2" else 70  # KIVI keeps a 128-token residual
    ids = torch.randint(0, VOCAB, (2, n), generator=torch.Generator().manual_seed(2))
    with ohf.apply(model, calib, method, window_dtype=torch.float32) as h:
        cache = h.cache()
        decode_logits(model, ids, cache, prompt_len=n - 30, chunk=3)
        lay = cache.layers[1]
        st = lay.store
        assert st.nbytes().quantized_tokens > 0
        # independent reference: dequantize the tiers, attend in float64 with hand-rotated q / k
        stored = [st.tiers(0, b) for b in range(2)]
        T = 3
        out, q, k, v, _ = _attend_one_chunk(model, 1, cache, T)
    lr = h.recipe.layers[1]
    r_k = lr.r_k.double() if lr.r_k is not None else torch.eye(16, dtype=torch.float64).expand(2, 16, 16)
    mu_k = lr.mu_k.double() if lr.mu_k is not None else torch.zeros(2, 16, dtype=torch.float64)
    for b in range(2):
        t = stored[b]
        kp = torch.cat([t["k_sink"], t["k_quantized"], t["k_recent"]], 1).double()
        vp = torch.cat([t["v_sink"], t["v_quantized"], t["v_recent"]], 1).double()
        kn = torch.einsum("htd,hde->hte", k[b].double() - mu_k[:, None], r_k)
        K = torch.cat([kp, kn], 1).repeat_interleave(2, 0)
        V = torch.cat([vp, v[b].double()], 1).repeat_interleave(2, 0)
        qr = torch.einsum("jtd,jde->jte", q[b].double(), r_k.repeat_interleave(2, 0))
        s = torch.einsum("jtd,jnd->jtn", qr, K) / 4.0
        n = kp.shape[1]
        mask = torch.ones(T, n + T, dtype=torch.bool)
        mask[:, n:] = torch.ones(T, T, dtype=torch.bool).tril()
        ref = torch.softmax(s.masked_fill(~mask, float("-inf")), -1) @ V  # [Hq, T, d]
        torch.testing.assert_close(out[b].transpose(0, 1).double(), ref, atol=1e-5, rtol=1e-5)


def test_store_layout_matches_kernel_reference():
    """The per-token pools, block table, qlen and 16-bit buffer are the kernels' layout: the kernels'
    extend_attention_ref over them gives the same output as the cache's own attention path."""
    model = tiny_model("llama")
    calib = random_calibration(model, spec(sink=4, window=8, page_size=4), clip=(0.9, 0.9))
    ids = torch.randint(0, VOCAB, (2, 50), generator=torch.Generator().manual_seed(3))
    with ohf.apply(model, calib, "oscar", window_dtype=torch.float32) as h:
        cache = h.cache()
        decode_logits(model, ids, cache, prompt_len=13, chunk=5)
        st = cache.layers[0].store
        kp, vp = st.k_pages[0], st.v_pages[0]
        for b in range(2):
            nq = st.policy.split(st.lens[b])[1]
            assert st.qlens[b] == nq
            torch.testing.assert_close(gather_dequant_ref(kp, st.block_table, b, nq), st.tiers(0, b)["k_quantized"])
        qlen, len16 = st.lengths(range(2))
        k16, v16 = st.buf[0, 0, :2].clone(), st.buf[1, 0, :2].clone()
        table = st.block_table[:2].clone()
        kp, vp = (QuantPages(p.codes.clone(), p.scale.clone(), p.offset.clone(), p.fmt) for p in (kp, vp))
        out, q, k, v, layer = _attend_one_chunk(model, 0, cache, T=4, seed=5)
    plan = layer.plan
    ref = extend_attention_ref(
        plan.rotate_queries(q).reshape(2, 4, 4, 16).transpose(1, 2), plan.rotate_keys(k).transpose(1, 2),
        v.transpose(1, 2), kp, vp, table, qlen, k16, v16, len16, dtype=torch.float64)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_kernel_dispatch_path_equals_chunked_path(monkeypatch):
    """The glue to oscarkv.kernels.dispatch.extend_attention (used on CUDA), run with the reference backend."""
    from oscarkv.kernels import dispatch

    calls = []
    real = dispatch.extend_attention
    monkeypatch.setattr(dispatch, "extend_attention", lambda *a, **k: calls.append(k["backend"]) or real(*a, **k))
    model = tiny_model("qwen2")
    calib = random_calibration(model, spec(sink=4, window=8, page_size=4), clip=(0.9, 0.9))
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(4))
    with ohf.apply(model, calib, "oscar", window_dtype=torch.float32) as h:
        a = decode_logits(model, ids, h.cache(), prompt_len=20, chunk=3)
        assert not calls
        b = decode_logits(model, ids, h.cache(kernel_backend="reference"), prompt_len=20, chunk=3)
    assert calls and set(calls) == {"reference"}
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
