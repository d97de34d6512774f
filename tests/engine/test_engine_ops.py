"""The engine's decode path on the dense kernels (:mod:`oscarkv.kernels.dispatch`): the fused K/V write of the
QK preparation into the engine's pools equals the reference write, and the whole decode path with the dense
kernels in the CPU interpreter (fused K/V write, fused GEMV) gives transformers' greedy tokens (BF16 cache) and
the reference path's (OSCAR cache). The dense ops are routed to their kernels on CPU tensors by a stand-in for
the dispatcher's rule (on a GPU they are its default)."""

import pytest
import torch

from oscarkv.kernels import dispatch

pytestmark = [pytest.mark.interpret, pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter stage")]
DENSE_OPS = {"rmsnorm", "silu_mul", "qk_prep", "gemv", "embed_rope", "paged_decode", "uses_kernels"}


@pytest.fixture
def dense_kernels_on_cpu(monkeypatch):
    """The dense ops with ``backend="auto"`` run their Triton kernels on CPU tensors (the interpreter)."""
    pytest.importorskip("triton")
    real = dispatch._pick

    def pick(backend, device, op, *a, **k):
        return "triton" if op in DENSE_OPS and backend == "auto" else real(backend, device, op, *a, **k)

    monkeypatch.setattr(dispatch, "_pick", pick)


def test_fused_kv_write_equals_reference_write_in_interpreter():
    from oscarkv.cache import Paged16Store, PagedStore, PageGeometry, TierPolicy
    from oscarkv.engine.attention import DecodeCtx
    from oscarkv.formats import LayerFormat, TensorFormat
    from oscarkv.kernels import dense_triton

    N, hq, hkv, d, L, P = 3, 4, 2, 16, 2, 8
    qkv = torch.randn(N, (hq + 2 * hkv) * d)
    ang = torch.rand(N, d // 2)
    ang = torch.cat([ang, ang], -1)
    cos, sin = ang.cos(), ang.sin()
    qn, kn = torch.rand(d) + 0.5, torch.rand(d) + 0.5
    rk = torch.linalg.qr(torch.randn(hkv, d, d))[0]
    mu = torch.randn(hkv, d)
    fmt = LayerFormat(TensorFormat(), TensorFormat())
    pools = [Paged16Store(L, hkv, d, P, num_slots=4, num_pages=6, max_pages=8, dtype=torch.float32, device="cpu")]
    pools += [PagedStore([fmt] * L, TierPolicy(4, 8, 4), PageGeometry(hkv, d, 4), num_slots=4, num_pages=6,
                         max_pages=16, dtype16=wdt, device="cpu") for wdt in (torch.float32, torch.bfloat16)]
    for pool in pools:
        ctx = DecodeCtx(pool, N, d ** -0.5)
        bf16 = isinstance(pool, Paged16Store)
        # two live rows and one padded row (page 0 / the scratch column)
        ctx.fill([7, 9, 0], [2 * P + 3, 5 * P + 7, 0] if bf16 else [5, 0, pool.c16], [1, 1, 0], [0] * 3)
        rot = (None, None) if bf16 else (rk, mu)
        store = pool.kv if bf16 else pool.buf
        for layer in range(L):
            q0, kv = dense_triton.qk_prep(qkv, hq, hkv, d, cos, sin, qn, kn, 1e-6, *rot)
            before = store.clone()
            ctx.write_kv(layer, kv)  # the reference write (PyTorch path)
            ref = store.clone()
            store.copy_(before)
            q1, none = dense_triton.qk_prep(qkv, hq, hkv, d, cos, sin, qn, kn, 1e-6, *rot, out=ctx.kv_dest(layer))
            assert none is None and torch.equal(q0, q1)
            assert not torch.equal(store, before)
            if store.dtype == torch.float32:
                assert torch.equal(store, ref), type(pool).__name__
            else:  # the interpreter truncates to bf16 where the GPU (and torch) round: one ulp at most
                torch.testing.assert_close(store.float(), ref.float(), atol=0, rtol=2 ** -7)


def test_decode_path_greedy_in_interpreter(dense_kernels_on_cpu, monkeypatch):
    from engine_helpers import tiny_hf
    from test_engine_oscar import SMALL, make_calib

    from oscarkv.engine import LLM, SamplingParams
    from oscarkv.kernels import dense_triton, gemv_triton

    calls = {"gemv": 0, "fused_write": 0}
    gemv, qk_prep = gemv_triton.gemv, dense_triton.qk_prep

    def count_gemv(*a, **k):
        calls["gemv"] += 1
        return gemv(*a, **k)

    def count_qk(*a, **k):
        calls["fused_write"] += a[-1] is not None if len(a) > 11 else 0
        return qk_prep(*a, **k)

    monkeypatch.setattr(gemv_triton, "gemv", count_gemv)
    monkeypatch.setattr(dense_triton, "qk_prep", count_qk)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    kw = {"kv_budget_gb": 0.01, "max_num_seqs": 4, "max_model_len": 64}
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (1, 9, 21)]
    hf = tiny_hf("qwen3")
    ref = [hf.generate(torch.tensor([p]), max_new_tokens=6, min_new_tokens=6, do_sample=False)[0, len(p):].tolist()
           for p in prompts]
    got = [o.token_ids for o in LLM(hf, kv="bf16", gemv="triton", **kw).generate(prompts, params)]
    assert got == ref, (got, ref)
    assert calls["gemv"] == 5 * (2 * 4 + 1) and calls["fused_write"] == 5 * 2, calls  # 5 decode steps, 2 layers
    hf = tiny_hf("qwen2")
    calib = make_calib(hf, SMALL)  # sink 4, window 8, page 4: decode steps demote pages
    monkeypatch.undo()
    base = [o.token_ids for o in LLM(hf, calib, kv="oscar", window_dtype=torch.float32, **kw).generate(prompts, params)]
    real = dispatch._pick
    monkeypatch.setattr(dispatch, "_pick", lambda backend, device, op, *a, **k: "triton"
                        if op in DENSE_OPS and backend == "auto" else real(backend, device, op, *a, **k))
    osc = LLM(hf, calib, kv="oscar", window_dtype=torch.float32, gemv="triton", **kw)
    got = [o.token_ids for o in osc.generate(prompts, params)]
    assert got == base, (got, base)
    assert osc.store.allocator.num_free == osc.store.allocator.capacity
