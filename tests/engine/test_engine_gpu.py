"""GPU checks of the engine's fused decode ops (run on the H200 with ``pytest -m gpu tests/engine``): the decode
GEMV against cuBLAS at Qwen3-8B shapes in bfloat16, the K/V write fused into QK-prep bit-equal to the reference
write, and greedy tokens of CUDA-graph engines with ``gemv="triton"``."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DEV = "cuda"
# (N, K) of Qwen3-8B's decode projections: qkv, o_proj, gate_up, down, and a lm_head slice (ragged N)
SHAPES = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (151936 // 8 + 8, 4096)]


def _configs():
    from oscarkv.kernels.gemv_triton import GemvConfig

    return [None, GemvConfig("fma", 8, 512, 4, 2), GemvConfig("fma", 16, 256, 8, 3), GemvConfig("dot", 16, 256, 4, 4),
            GemvConfig("dot", 32, 128, 4, 3)]


@pytest.mark.parametrize("M", [1, 4, 8])
def test_gemv_matches_cublas_bf16(M):
    from oscarkv.kernels import gemv_triton
    from oscarkv.kernels import reference as ref

    g = torch.Generator(device=DEV).manual_seed(M)
    for N, K in SHAPES:
        w = torch.randn(N, K, device=DEV, generator=g).mul_(0.02).bfloat16()
        b = torch.randn(N, device=DEV, generator=g).bfloat16()
        nw = (torch.rand(K, device=DEV, generator=g) + 0.5).bfloat16()
        x = torch.randn(M, K, device=DEV, generator=g).bfloat16()
        gu = torch.randn(M, 2 * K, device=DEV, generator=g).bfloat16()
        res = torch.randn(M, N, device=DEV, generator=g).bfloat16()
        cases = ((x, {}), (x, dict(b=b, residual=res)), (x, dict(norm=nw, eps=1e-6)),
                 (gu, dict(act="silu", residual=res)))
        for xin, kw in cases:
            exact = ref.gemv_ref(xin.float(), w.float(), **{k: v.float() if torch.is_tensor(v) else v
                                                              for k, v in kw.items()})
            cublas = (ref.gemv_ref(xin, w, **kw).float() - exact).abs().max().item()
            for cfg in _configs():
                err = (gemv_triton.gemv(xin, w, config=cfg, **kw).float() - exact).abs().max().item()
                assert err <= 2 * cublas + 1e-2, (M, N, K, list(kw), cfg, err, cublas)


def test_fused_kv_write_is_bit_equal_bf16():
    from oscarkv.cache import Paged16Store, PagedStore, PageGeometry, TierPolicy
    from oscarkv.engine.attention import DecodeCtx
    from oscarkv.formats import LayerFormat, TensorFormat
    from oscarkv.kernels import dense_triton

    torch.manual_seed(0)
    N, hq, hkv, d, L = 4, 32, 8, 128, 2
    qkv = torch.randn(N, (hq + 2 * hkv) * d, device=DEV).bfloat16()
    ang = torch.rand(N, d // 2, device=DEV) * 100
    cos, sin = (f(torch.cat([ang, ang], -1)).bfloat16() for f in (torch.cos, torch.sin))
    nw = (torch.rand(d, device=DEV) + 0.5).bfloat16()
    rk = torch.linalg.qr(torch.randn(hkv, d, d, device=DEV))[0]
    mu = torch.randn(hkv, d, device=DEV)
    fmt = LayerFormat(TensorFormat(), TensorFormat())
    pools = [Paged16Store(L, hkv, d, 64, num_slots=4, num_pages=8, max_pages=8, dtype=torch.bfloat16, device=DEV),
             PagedStore([fmt] * L, TierPolicy(64, 256, 64), PageGeometry(hkv, d, 64), num_slots=4, num_pages=8,
                        max_pages=8, dtype16=torch.bfloat16, device=DEV)]
    for pool in pools:
        bf16 = isinstance(pool, Paged16Store)
        ctx = DecodeCtx(pool, N, d ** -0.5)
        widx = [64 + 5, 3 * 64 + 63, 7 * 64, 0] if bf16 else [17, 0, 300, pool.c16]
        ctx.fill([5, 9, 100, 0], widx, [1] * N, [0] * N)
        rot = (None, None) if bf16 else (rk, mu)
        store = pool.kv if bf16 else pool.buf
        for layer in range(L):
            q0, kv = dense_triton.qk_prep(qkv, hq, hkv, d, cos, sin, nw, nw, 1e-6, *rot)
            before = store.clone()
            ctx.write_kv(layer, kv)
            ref = store.clone()
            store.copy_(before)
            q1, _ = dense_triton.qk_prep(qkv, hq, hkv, d, cos, sin, nw, nw, 1e-6, *rot, out=ctx.kv_dest(layer))
            assert torch.equal(q0, q1) and torch.equal(store, ref) and not torch.equal(store, before)


def _tiny_qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
                      initializer_range=0.2, tie_word_embeddings=False)
    return Qwen3ForCausalLM(cfg).to(DEV).eval()


def test_engine_gemv_triton_greedy_equals_transformers():
    from oscarkv.engine import LLM, SamplingParams

    hf = _tiny_qwen3()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (5, 40, 300)]
    with torch.no_grad():
        ref = [hf.generate(torch.tensor([p], device=DEV), max_new_tokens=24, min_new_tokens=24,
                           do_sample=False)[0, len(p):].tolist() for p in prompts]
    llm = LLM(hf, kv="bf16", kv_budget_gb=0.05, max_num_seqs=4, gemv="triton")
    got = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))]
    assert llm.engine.graphs, "decode did not run through CUDA graphs"
    match = sum(a == b for x, y in zip(got, ref) for a, b in zip(x, y)) / (24 * 3)
    assert match >= 0.95, (match, got, ref)  # float32 on the GPU: transformers' own kernels differ slightly


def test_engine_oscar_gemv_triton_equals_cublas():
    from oscarkv.artifact import Calibration
    from oscarkv.config import QuantSpec
    from oscarkv.engine import LLM, SamplingParams
    from oscarkv.engine.llm import identity_of
    from oscarkv.engine.model import ModelConfig
    from oscarkv.rotation import random_orthogonal

    hf = _tiny_qwen3()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (5, 40, 300)]
    spec = QuantSpec(sink=16, window=64, page_size=16, k_clip=0.96, v_clip=0.92)
    ident = identity_of(ModelConfig.from_hf(hf.config))
    rot = torch.stack([random_orthogonal(64, g) for _ in range(2)])
    calib = Calibration(spec=spec, model=ident, r_k=rot, r_v=rot.flip(0), eig_k=torch.zeros(2, 64),
                        eig_v=torch.zeros(2, 64), mu_k=torch.randn(2, 2, 64) * 0.2, mu_v=torch.randn(2, 2, 64) * 0.2,
                        k_clip=torch.full((2,), 0.96), v_clip=torch.full((2,), 0.92))
    outs = {}
    for gemv in ("cublas", "triton"):
        llm = LLM(hf, calib, kv="oscar", kv_budget_gb=0.05, max_num_seqs=4, window_dtype=torch.float32, gemv=gemv)
        outs[gemv] = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))]
        assert llm.engine.graphs
    match = sum(a == b for x, y in zip(outs["triton"], outs["cublas"]) for a, b in zip(x, y)) / (24 * 3)
    assert match >= 0.95, outs
