"""Programmatic dependent launch (PDL) of the decode step's kernels (``LLM(pdl=True)``, ``EngineConfig.pdl``).

CPU: the switch is a no-op there (same tokens and logits as ``pdl=False``), and, with availability forced under
the interpreter, every kernel of a decode step (and only those) is launched that way, the OSCAR decode attention
gets ``pdl=True``. GPU (``pytest -m gpu``): engine logits with ``pdl`` on vs off through CUDA graphs for both
caches. The kernels' own PDL launches are tested in tests/kernels/test_kernels_dense.py."""

import pytest
import torch

pytestmark = pytest.mark.interpret if not torch.cuda.is_available() else []  # CPU interpreter: CI's slow tier

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# ----------------------------------------------------------------------------------------------- CPU
def _logits_per_step(llm, prompts, n):
    """Greedy tokens and the logits each sampling step saw (``core.sample`` wrapped)."""
    from oscarkv.engine import SamplingParams, core

    seen, orig = [], core.sample

    def rec(logits, *a, **kw):
        seen.append(logits.detach().float().cpu().clone())
        return orig(logits, *a, **kw)

    core.sample = rec
    try:
        toks = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True))]
    finally:
        core.sample = orig
    return toks, seen


@pytest.mark.parametrize("kv", ["bf16", "oscar"])
def test_pdl_is_a_noop_on_cpu(make_hf, kv):
    from test_engine_oscar import SMALL, make_calib

    from oscarkv.engine import LLM
    from oscarkv.kernels import dispatch

    hf = make_hf("qwen3")
    calib = make_calib(hf, SMALL) if kv == "oscar" else None
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 17, 30)]
    runs = {}
    for pdl in (False, True):
        llm = LLM(hf, calib, kv=kv, kv_budget_gb=0.01, max_num_seqs=4, max_model_len=64, pdl=pdl, gemv="triton")
        assert llm.model.pdl is pdl
        assert not llm.model.step_pdl(next(llm.model.parameters()))  # CPU: never effective
        runs[pdl] = _logits_per_step(llm, prompts, 8)
    assert not dispatch.pdl_available(torch.zeros(1))
    assert runs[True][0] == runs[False][0]
    assert len(runs[True][1]) == len(runs[False][1])
    for a, b in zip(runs[True][1], runs[False][1]):
        assert torch.equal(a, b)


def test_pdl_is_a_config_field():
    from oscarkv.engine import EngineConfig
    from oscarkv.engine.model import PRESETS, Transformer

    assert EngineConfig().pdl is True and EngineConfig(pdl=False).pdl is False
    with pytest.raises(ValueError, match="pdl must be true or false"):
        EngineConfig(pdl="maybe")
    with torch.device("meta"):
        m = Transformer(PRESETS["tiny-llama"])
    assert m.pdl is True  # on by default; no environment variable changes it
    m.set_pdl(False)
    assert m.pdl is False



def test_pdl_reaches_every_decode_kernel_in_interpreter(monkeypatch):
    """Under the interpreter, PDL availability forced and the dense ops on their kernels: each kernel's launch is
    recorded (and run without the grid dependency control, which the interpreter has no model of). A decode step
    with pdl=True launches all its kernels with PDL (1 prologue + 7 per layer + lm_head on the fused-GEMV path),
    prefill none; pdl=False none; tokens equal; the OSCAR decode attention receives pdl=True exactly on pdl=True
    decode steps."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("the interpreter stage")
    from engine_helpers import tiny_hf
    from test_engine_oscar import SMALL, make_calib

    from oscarkv.engine import LLM, SamplingParams
    from oscarkv.kernels import dense_triton, dispatch, gemv_triton

    dense_ops = {"rmsnorm", "silu_mul", "qk_prep", "gemv", "embed_rope", "paged_decode", "uses_kernels"}
    real_pick = dispatch._pick
    monkeypatch.setattr(dispatch, "_pick", lambda backend, device, op, *a, **k: "triton"
                        if op in dense_ops and backend == "auto" else real_pick(backend, device, op, *a, **k))
    log, attn = [], []
    orig = dense_triton._launch

    def rec(kernel, grid, *args, pdl=False, **meta):
        log.append((kernel.fn.__name__ if hasattr(kernel, "fn") else kernel.__name__, pdl))
        return orig(kernel, grid, *args, pdl=False, **meta)

    monkeypatch.setattr(dense_triton, "_launch", rec)
    monkeypatch.setattr(gemv_triton, "_launch", rec)
    monkeypatch.setattr(dense_triton, "pdl_available", lambda t: True)
    monkeypatch.setattr(gemv_triton, "pdl_available", lambda t: True)
    orig_decode = dispatch.decode_attention

    def rec_decode(*a, pdl=False, **kw):
        attn.append(pdl)
        return orig_decode(*a, **kw)

    monkeypatch.setattr(dispatch, "decode_attention", rec_decode)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    kw = {"kv_budget_gb": 0.01, "max_num_seqs": 4, "max_model_len": 64, "gemv": "triton"}
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (2, 9)]
    L = 2
    for kv in ("bf16", "oscar"):
        hf = tiny_hf("qwen3")
        calib = make_calib(hf, SMALL) if kv == "oscar" else None
        toks = {}
        for pdl in (False, True):
            log.clear()
            attn.clear()
            llm = LLM(hf, calib, kv=kv, pdl=pdl, **kw)
            toks[pdl] = [o.token_ids for o in llm.generate(prompts, params)]
            on = ["_gemv" if n.startswith("_gemv_") else n for n, p in log if p]  # fma (1 row) or dot (2 rows)
            steps = 3  # 4 tokens: the first from prefill, then 3 decode steps (both prompts in one batch)
            if not pdl:
                assert not on and not any(attn), (kv, log, attn)
                continue
            per_step = {"_embed_rope_kernel": 1, "_gemv": 4 * L + 1, "_qk_prep_kernel": L}
            if kv == "bf16":
                per_step.update(_paged_decode_kernel=L, _merge_kernel=L)
            got = {n: on.count(n) for n in set(on)}
            assert got == {n: c * steps for n, c in per_step.items()}, (kv, got)
            prefill = [n for n, p in log if not p]
            assert prefill and all(n != "_embed_rope_kernel" for n in prefill), prefill
            if kv == "oscar":
                assert attn.count(True) == L * steps, attn
        assert toks[True] == toks[False], (kv, toks)


# ----------------------------------------------------------------------------------------------- GPU
DEV = "cuda"


def _tiny_qwen3_bf16():
    """Two layers with Qwen3-8B's head geometry (32 / 8 heads of 128) and tile-divisible widths: the GEMV,
    QK-prep and CUDA decode specializations are those of the 8B benchmark (compiled once per GPU run)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=512, hidden_size=1024, intermediate_size=1024, num_hidden_layers=2,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096,
                      initializer_range=0.05, tie_word_embeddings=False)
    return Qwen3ForCausalLM(cfg).to(DEV, torch.bfloat16).eval()


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("kv", ["bf16", "oscar"])
def test_engine_logits_pdl_on_equal_off_gpu(kv):
    """Decode logits through the CUDA graphs with pdl on vs off: bf16 weights, both caches (OSCAR with bf16
    windows and the default tiers, head_dim 128, page 64: the CUDA 2-bit kernel with its pdl launch, the cubin
    the 8B benchmark uses), a single sequence (the fused-GEMV chain under gemv="auto") and three (cuBLAS
    projections between our PDL kernels)."""
    gemv = "auto"
    from oscarkv.artifact import Calibration
    from oscarkv.config import QuantSpec
    from oscarkv.engine import LLM
    from oscarkv.engine.llm import identity_of
    from oscarkv.engine.model import ModelConfig
    from oscarkv.rotation import random_orthogonal

    hf = _tiny_qwen3_bf16()
    g = torch.Generator().manual_seed(1)
    calib = None
    if kv == "oscar":
        spec = QuantSpec(k_clip=0.96, v_clip=0.92)  # sink 64, window 256, pages of 64
        d = 128
        rot = torch.stack([random_orthogonal(d, g) for _ in range(2)])
        calib = Calibration(spec=spec, model=identity_of(ModelConfig.from_hf(hf.config)), r_k=rot, r_v=rot.flip(0),
                            eig_k=torch.zeros(2, d), eig_v=torch.zeros(2, d), mu_k=torch.randn(2, 8, d) * 0.2,
                            mu_v=torch.randn(2, 8, d) * 0.2, k_clip=torch.full((2,), 0.96),
                            v_clip=torch.full((2,), 0.92))
    runs = {}
    for pdl in (False, True):
        for batch in ([700], [90, 420, 700]):  # one sequence (fused GEMV under "auto"), then three; 2-bit pages
            prompts = [torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in batch]
            llm = LLM(hf, calib, kv=kv, kv_budget_gb=0.05, max_num_seqs=4, gemv=gemv, pdl=pdl)
            assert llm.model.step_pdl(next(llm.model.parameters())) is pdl
            runs[(pdl, len(batch))] = _logits_per_step(llm, prompts, 24)
            assert llm.engine.graphs, "decode did not run through CUDA graphs"
    for n in (1, 3):
        (t0, l0), (t1, l1) = runs[(False, n)], runs[(True, n)]
        assert len(l0) == len(l1)
        exact = all(torch.equal(a, b) for a, b in zip(l0, l1))
        # the same kernels' arithmetic, so bit-equal unless the RoPE tables differ by an ulp somewhere; then
        # compare the logits of the steps before the first token that differs (same inputs up to there)
        same = next((i for i, (a, b) in enumerate(zip(l0, l1)) if not torch.equal(a.argmax(-1), b.argmax(-1))),
                    len(l0))
        diff = max([(a - b).abs().max().item() for a, b in zip(l0[: same + 1], l1[: same + 1])] + [0.0])
        match = sum(a == b for x, y in zip(t0, t1) for a, b in zip(x, y)) / sum(len(x) for x in t0)
        print(f"{kv} gemv={gemv} batch {n}: logits pdl on vs off bit-equal: {exact}; max |diff| {diff:.3g} over the "
              f"first {same + 1} sampling steps; token match {match:.3f}")
        assert exact or (match >= 0.95 and diff <= 0.05), (n, diff, match)
