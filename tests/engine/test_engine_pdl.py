"""Programmatic dependent launch (PDL) of the decode step's kernels (``LLM(pdl=True)``, ``$OSCARKV_PDL``).

CPU: the switch is a no-op there (same tokens and logits as ``pdl=False``), ``_launch`` turns it into the
``PDL`` constexpr and Triton's ``launch_pdl`` option, and, with availability forced under the interpreter, every
kernel of a decode step (and only those) is launched that way, the OSCAR decode attention gets ``pdl=True``.
GPU (``pytest -m gpu``): each PDL kernel equals its plain launch bit for bit, the split-K GEMV (tickets reset
across replays), the fused embedding/RoPE prologue against torch, and engine logits with ``pdl`` on vs off
through CUDA graphs for both caches."""

import os
import subprocess
import sys

import pytest
import torch

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
    from oscarkv.engine import LLM, ops

    from test_engine_oscar import SMALL, make_calib

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
    assert not ops.pdl_available(torch.zeros(1))
    assert runs[True][0] == runs[False][0]
    assert len(runs[True][1]) == len(runs[False][1])
    for a, b in zip(runs[True][1], runs[False][1]):
        assert torch.equal(a, b)


def test_pdl_env_default(monkeypatch):
    from oscarkv.engine.model import PDL_ENV, PRESETS, Transformer, pdl_default

    for val, want in (("1", True), ("0", False), ("", True), ("on", True), ("off", False)):
        monkeypatch.setenv(PDL_ENV, val)
        assert pdl_default() is want
        with torch.device("meta"):
            m = Transformer(PRESETS["tiny-llama"])
        assert m.pdl is want
        m.set_pdl(not want)  # an explicit value wins over the environment
        assert m.pdl is (not want)
    monkeypatch.delenv(PDL_ENV)
    assert pdl_default() is True  # on unless switched off
    monkeypatch.setenv(PDL_ENV, "maybe")
    with pytest.raises(ValueError):
        pdl_default()


def test_launch_turns_pdl_into_constexpr_and_launch_option():
    pytest.importorskip("triton")
    from oscarkv.engine import triton_ops

    calls = []

    class Kernel:  # stands for a JITFunction: kernel[grid](*args, **kwargs)
        def __getitem__(self, grid):
            return lambda *a, **kw: calls.append((grid, a, kw))

    triton_ops._launch(Kernel(), (3, 1), 1, 2, pdl=True, num_warps=4, BLOCK=8)
    triton_ops._launch(Kernel(), (3,), 1, pdl=False, num_warps=4)
    (g1, a1, kw1), (g2, a2, kw2) = calls
    assert g1 == (3, 1) and a1 == (1, 2) and kw1 == {"PDL": True, "launch_pdl": True, "num_warps": 4, "BLOCK": 8}
    assert g2 == (3,) and kw2 == {"PDL": False, "num_warps": 4}  # no launch_pdl key: old Tritons lack the option
    assert not triton_ops.pdl_available(torch.zeros(1))


# Under the interpreter with PDL availability forced: each kernel's launch is recorded (and run without the
# grid dependency control, which the interpreter has no model of). A decode step with pdl=True launches all its
# kernels with PDL (1 prologue + 7 per layer + lm_head on the fused-GEMV path), prefill none; pdl=False none;
# tokens equal; the OSCAR decode attention receives pdl=True exactly on pdl=True decode steps.
RECORD = r'''
import sys
import torch
sys.path.insert(0, "tests/engine")
from conftest import tiny_hf
from test_engine_oscar import SMALL, make_calib
from oscarkv.engine import LLM, SamplingParams, ops, triton_ops
from oscarkv.kernels import dispatch
log = []
orig = triton_ops._launch
def rec(kernel, grid, *args, pdl=False, **meta):
    log.append((kernel.fn.__name__ if hasattr(kernel, "fn") else kernel.__name__, pdl))
    return orig(kernel, grid, *args, pdl=False, **meta)
triton_ops._launch = rec
triton_ops.pdl_available = lambda t: True
attn = []
orig_decode = dispatch.decode_attention
def rec_decode(*a, pdl=False, **kw):
    attn.append(pdl)
    return orig_decode(*a, **kw)
dispatch.decode_attention = rec_decode
params = SamplingParams(max_tokens=4, ignore_eos=True)
kw = dict(kv_budget_gb=0.01, max_num_seqs=4, max_model_len=64, gemv="triton")
g = torch.Generator().manual_seed(1)
prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (2, 9)]
L = 2
for kv in ("bf16", "oscar"):
    hf = tiny_hf("qwen3")
    calib = make_calib(hf, SMALL) if kv == "oscar" else None
    toks = {}
    for pdl in (False, True):
        log.clear(); attn.clear()
        ops._FORCE_TRITON = True
        llm = LLM(hf, calib, kv=kv, pdl=pdl, **kw)
        toks[pdl] = [o.token_ids for o in llm.generate(prompts, params)]
        ops._FORCE_TRITON = False
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
print("OK")
'''


def test_pdl_reaches_every_decode_kernel_in_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    root = os.path.join(os.path.dirname(__file__), "..", "..")
    res = subprocess.run([sys.executable, "-c", RECORD], env=env, capture_output=True, text=True, timeout=600,
                         cwd=root)
    assert res.returncode == 0 and "OK" in res.stdout, res.stderr[-3000:]


# ----------------------------------------------------------------------------------------------- GPU
DEV = "cuda"
BF = torch.bfloat16  # the dtype of the GPU op checks


@pytest.mark.gpu
@needs_gpu
def test_pdl_kernels_equal_plain_launches_gpu():
    """Each op with pdl=True (programmatic launches on the stream, eager) is bit-equal to pdl=False."""
    from oscarkv.engine import triton_ops as T
    from oscarkv.engine.triton_ops import GemvConfig

    assert T.pdl_available(torch.zeros(1, device=DEV)), "PDL should be available on an sm_90 GPU"
    torch.manual_seed(0)
    bf = BF
    x, r = torch.randn(1, 4096, device=DEV, dtype=bf), torch.randn(1, 4096, device=DEV, dtype=bf)
    nw = (torch.rand(4096, device=DEV) + 0.5).to(bf)
    a = [T.rmsnorm(x, nw, 1e-6, r, pdl=p) for p in (False, True)]
    assert all(torch.equal(u, v) for u, v in zip(*a))
    gu = torch.randn(1, 2 * 12288, device=DEV, dtype=bf)
    assert torch.equal(T.silu_mul(gu, pdl=False), T.silu_mul(gu, pdl=True))
    # the decode projections of Qwen3-8B (and a ragged lm_head slice) at one row, as the model fuses them, with
    # the default config; other configs (split-K, narrow tiles, tensor cores) on one shape
    extra = (GemvConfig("fma", 8, 1024, 4, 1), GemvConfig("dot", 16, 256, 4, 4))  # split-K: test_split_k_gemv_gpu
    for N, K, fusion in ((6144, 4096, "norm"), (4096, 4096, "residual"), (24576, 4096, "norm"),
                         (4096, 12288, "silu"), (151936 // 8 + 8, 4096, "norm")):
        w = torch.randn(N, K, device=DEV).mul_(0.02).to(bf)
        b = torch.randn(N, device=DEV).to(bf)
        res = torch.randn(1, N, device=DEV).to(bf)
        xin = torch.randn(1, K, device=DEV).to(bf)
        nwk = (torch.rand(K, device=DEV) + 0.5).to(bf)
        xi, kw = {"norm": (xin, dict(norm=nwk)), "residual": (xin, dict(b=b, residual=res)),
                  "silu": (torch.randn(1, 2 * K, device=DEV).to(bf), dict(act="silu", residual=res))}[fusion]
        for cfg in (None,) + (extra if (N, K) == (4096, 4096) else ()):
            plain = T.gemv(xi, w, config=cfg, **kw)
            fast = T.gemv(xi, w, config=cfg, pdl=True, **kw)
            assert torch.equal(plain, fast), (N, K, fusion, cfg)
        if fusion == "norm":
            logits = T.gemv(xin, w, norm=nwk, out_dtype=torch.float32, pdl=True)
            assert logits.dtype == torch.float32 and torch.equal(logits, T.gemv(xin, w, norm=nwk).float())
    # QK-prep into a pool, the paged BF16 decode (split + merge)
    hq, hkv, d = 32, 8, 128
    qkv = torch.randn(1, (hq + 2 * hkv) * d, device=DEV, dtype=bf)
    ang = torch.rand(1, d // 2, device=DEV) * 100
    cos, sin = (f(torch.cat([ang, ang], -1)).to(bf) for f in (torch.cos, torch.sin))
    qn = (torch.rand(d, device=DEV) + 0.5).to(bf)
    outs = [T.qk_prep(qkv, hq, hkv, d, cos, sin, qn, qn, 1e-6, pdl=p) for p in (False, True)]
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    kvp = torch.randn(2, 40, hkv, 64, d, device=DEV, dtype=bf)
    bt = torch.randperm(39, device=DEV)[:32].add(1).int()[None]
    lens = torch.tensor([1900], dtype=torch.int32, device=DEV)
    q = outs[0][0]
    o = [T.paged_decode(q, kvp, bt, lens, d ** -0.5, max_len=2048, pdl=p) for p in (False, True)]
    assert torch.equal(o[0], o[1])
    # the fused prologue: embedding rows exact, cos/sin as torch computes them (libdevice cosf / sinf)
    emb = torch.randn(1000, 4096, device=DEV, dtype=bf)
    toks = torch.tensor([5, 999, 0, 17], device=DEV)
    pos = torch.tensor([0, 1, 40000, 131071], device=DEV)
    f = 1.0 / (1e6 ** (torch.arange(0, d, 2, dtype=torch.float32, device=DEV) / d))
    f2 = torch.cat([f, f])
    from oscarkv.engine import ops

    for scale in (1.0, 0.7):
        got = T.embed_rope(toks, pos, emb, f2, scale, pdl=True)
        ref = ops.embed_rope_torch(toks, pos, emb, f2, scale)
        assert torch.equal(got[0], ref[0])
        for u, v in zip(got[1:], ref[1:]):
            ulp = (u.float() - v.float()).abs().max().item()
            assert ulp <= 2 ** -7, ulp  # one bf16 ulp at |x| <= 1 at most (equal when cosf matches torch's)


@pytest.mark.gpu
@needs_gpu
def test_split_k_gemv_gpu():
    """Split-K at 8B shapes against float64-exact, deterministic, and tickets reset across CUDA-graph replays."""
    from oscarkv.engine import ops, triton_ops as T
    from oscarkv.engine.triton_ops import GemvConfig

    g = torch.Generator(device=DEV).manual_seed(0)
    for N, K in ((6144, 4096), (4096, 4096), (4096, 12288)):
        w = torch.randn(N, K, device=DEV, generator=g).mul_(0.02).bfloat16()
        x = torch.randn(1, K, device=DEV, generator=g).bfloat16()
        res = torch.randn(1, N, device=DEV, generator=g).bfloat16()
        exact = ops.gemv_torch(x.double(), w.double(), residual=res.double())
        base = (T.gemv(x, w, residual=res).double() - exact).abs().max().item()
        for split in (3, 4):  # 3 on K = 4096: slices of 2, 2 and 0 tiles -> 2 slices
            for pdl in (False, True):
                cfg = GemvConfig("fma", 16, 1024, 4, 1, split_k=split)
                y = T.gemv(x, w, residual=res, config=cfg, pdl=pdl)
                err = (y.double() - exact).abs().max().item()
                assert err <= 2 * base + 1e-2, (N, K, split, err, base)
                out = torch.empty_like(y)
                graph = torch.cuda.CUDAGraph()
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    T.gemv(x, w, residual=res, config=cfg, pdl=pdl)
                torch.cuda.current_stream().wait_stream(s)
                with torch.cuda.graph(graph):
                    out.copy_(T.gemv(x, w, residual=res, config=cfg, pdl=pdl))
                for _ in range(3):
                    out.zero_()
                    graph.replay()
                    torch.cuda.synchronize()
                    assert torch.equal(out, y), (N, K, split, pdl)


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
