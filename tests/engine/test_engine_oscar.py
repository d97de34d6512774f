"""The OSCAR pool: value folding, tier rule, stored content, and agreement with the transformers integration."""

import pytest
import torch

from oscarkv.artifact import Calibration, ModelIdentity
from oscarkv.config import QuantSpec
from oscarkv.engine import LLM, SamplingParams
from oscarkv.quant import quantize
from oscarkv.rotation import random_orthogonal


def make_calib(hf, spec: QuantSpec, seed: int = 0) -> Calibration:
    ident = ModelIdentity.from_config(hf.config)
    L, H, d = ident.num_layers, ident.num_kv_heads, ident.head_dim
    g = torch.Generator().manual_seed(seed)
    shape = (L, H) if spec.granularity == "head" else (L,)
    rot = lambda: torch.stack([random_orthogonal(d, g) for _ in range(int(torch.tensor(shape).prod()))]).view(*shape, d, d)  # noqa
    return Calibration(spec=spec, model=ident, r_k=rot(), r_v=rot(), eig_k=torch.zeros(*shape, d),
                       eig_v=torch.zeros(*shape, d), mu_k=torch.randn(L, H, d, generator=g) * 0.3,
                       mu_v=torch.randn(L, H, d, generator=g) * 0.3, k_clip=torch.full((L,), 0.9),
                       v_clip=torch.full((L,), 0.85))


SMALL = QuantSpec(sink=4, window=8, page_size=4, k_clip=0.9, v_clip=0.85)


def test_engine_store_follows_the_calibration_tiers(make_hf):
    from oscarkv.cache import TierPolicy

    hf = make_hf("llama")
    llm = LLM(hf, make_calib(hf, SMALL), kv="oscar", kv_budget_gb=0.01, max_num_seqs=2)
    st = llm.store
    assert st.policy == TierPolicy(sink=4, window=8, unit=4) and st.page_size == 4
    assert st.c16 == st.policy.max_16bit + 1  # one more: a step's token is held before the step's demotion
    assert llm.recipe.formats == tuple(llm.recipe.layers[i].format for i in range(2)) == st.formats


@pytest.mark.parametrize("granularity", ["layer", "head"])
def test_folding_and_rotation_are_exact_without_demotion(make_hf, granularity):
    hf = make_hf("qwen2")
    calib = make_calib(hf, QuantSpec(sink=64, window=512, page_size=64, granularity=granularity))
    prompts = [torch.randint(0, 256, (n,)).tolist() for n in (5, 40)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    ref = LLM(hf, kv="bf16", kv_budget_gb=0.01, max_num_seqs=2).generate(prompts, params)
    osc = LLM(hf, calib, kv="oscar", kv_budget_gb=0.05, max_num_seqs=2, window_dtype=torch.float32)
    out = osc.generate(prompts, params)
    assert [o.token_ids for o in out] == [r.token_ids for r in ref]
    assert osc.store.allocator.num_free == osc.store.allocator.capacity


def _layer0_rows(hf, calib, tokens):
    """Layer-0 post-RoPE keys and values of ``tokens`` from transformers, centered and rotated (float64)."""
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

    m = hf.model
    ids = torch.tensor([tokens])
    h = m.layers[0].input_layernorm(m.embed_tokens(ids))
    att = m.layers[0].self_attn
    d = att.head_dim
    k = att.k_proj(h).view(1, len(tokens), -1, d).transpose(1, 2)
    v = att.v_proj(h).view(1, len(tokens), -1, d).transpose(1, 2)
    cos, sin = m.rotary_emb(h, torch.arange(len(tokens))[None])
    k, _ = apply_rotary_pos_emb(k, k, cos, sin)
    r_k, r_v = calib.layer(0)["r_k"].double(), calib.layer(0)["r_v"].double()
    k = torch.einsum("htd,hde->the", k[0].double() - calib.mu_k[0][:, None].double(), r_k)
    v = torch.einsum("htd,hde->the", v[0].double() - calib.mu_v[0][:, None].double(), r_v)
    return k, v  # [T, H, d]


def test_stored_pages_equal_reference_quantization(make_hf):
    hf = make_hf("qwen2")
    calib = make_calib(hf, SMALL)
    llm = LLM(hf, calib, kv="oscar", kv_budget_gb=0.01, max_num_seqs=2, window_dtype=torch.float32)
    seq = llm.submit(torch.randint(0, 256, (23,)).tolist(), SamplingParams(max_tokens=100, ignore_eos=True))
    while len(seq.out) < 14:
        llm.step()
    st, n = llm.store, seq.n_cached
    # the step in flight has stored its input, the 14th output token, whose successor the host has not read
    assert n == 23 + 14 == seq.num_tokens and st.qlens[seq.slot] == st.policy.quantized(n) == 24
    k, v = _layer0_rows(hf, calib, seq.tokens[:n])
    for which, (x, clip) in enumerate(((k, 0.9), (v, 0.85))):
        rows = x[4:4 + 24].float()  # the 2-bit tier: tokens [S, S + q)
        q = quantize(rows, clip_ratio=clip)
        pages = torch.tensor(st.table.pages[seq.slot][:6])
        pool = (st.k_pages, st.v_pages)[which][0]
        codes = pool.codes[pages].transpose(1, 2).reshape(24, *q.packed.shape[1:])
        scale = pool.scale[pages].transpose(1, 2).reshape(24, *q.scale.shape[1:])
        assert (codes == q.packed).float().mean() > 0.99  # float-order differences may flip a rare code
        torch.testing.assert_close(scale, q.scale, rtol=2e-3, atol=1e-4)
    # 16-bit tiers: sink then the recent window in order
    buf = st.buf[0, 0, seq.slot]
    torch.testing.assert_close(buf[:, :4].transpose(0, 1).double(), k[:4], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(buf[:, 4:4 + n - 28].transpose(0, 1).double(), k[28:n], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_equals_transformers_integration(make_hf, arch):
    hf_mod = pytest.importorskip("oscarkv.hf")
    hf = make_hf(arch)
    calib = make_calib(hf, SMALL)
    prompt = torch.randint(0, 256, (30,)).tolist()
    llm = LLM(hf, calib, kv="oscar", kv_budget_gb=0.01, max_num_seqs=2)  # default windows: bf16, like hf
    ours = llm.generate([prompt], SamplingParams(max_tokens=20, ignore_eos=True))[0].token_ids
    with hf_mod.apply(hf, calib, "oscar") as handle:
        out = hf.generate(torch.tensor([prompt]), cache=handle.cache(), max_new_tokens=20,
                          min_new_tokens=20, do_sample=False)
    assert ours == out[0, 30:].tolist()


def test_chunked_prefill_passes_the_prefix_lengths_from_the_host(make_hf, monkeypatch):
    """Chunks after the first attend to a stored prefix through ``dispatch.extend_attention``; the engine hands it
    the prefix lengths as host integers (the CUDA cuDNN fold needs them; a device read would stall each layer):
    they must be the device tensors' values."""
    from oscarkv.kernels import dispatch

    seen = []
    real = dispatch.extend_attention

    def spy(*args, host_lengths=None, **kw):
        if args[0].shape[1] > 1:  # prefill chunks (the CPU decode step also runs this op, one token per sequence)
            seen.append((host_lengths, (args[6].tolist(), args[9].tolist())))
        return real(*args, host_lengths=host_lengths, **kw)

    monkeypatch.setattr(dispatch, "extend_attention", spy)
    hf = make_hf("qwen2")
    llm = LLM(hf, make_calib(hf, SMALL), kv="oscar", kv_budget_gb=0.01, max_num_seqs=1, prefill_chunk=8)
    out = llm.generate([torch.randint(0, 256, (29,)).tolist()], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out[0].token_ids) == 3
    assert len(seen) >= 3 * hf.config.num_hidden_layers  # chunks 2..4 of 29 tokens at 8 a chunk, every layer
    for host, dev in seen:
        assert host is not None and tuple(map(list, host)) == dev
    assert any(dev[0][0] > 0 for _, dev in seen)  # some chunk saw 2-bit pages, not only the 16-bit tiers
