"""Triton ops of the engine against their PyTorch specification (interpreter on CPU, float32, tiny shapes), and
the engine's whole Triton decode path (fused K/V write, fused GEMV) against transformers under the interpreter.
The interpreter stores bfloat16 as raw bits and truncates float32 -> bfloat16, so bf16 numerics are GPU-tested
(tests/engine/test_engine_gpu.py)."""

import os
import subprocess
import sys

import pytest

SCRIPT = r'''
import torch
from oscarkv.engine import ops, triton_ops
torch.manual_seed(0)
N, hq, hkv, d = 3, 4, 2, 16
x, r, w = torch.randn(N, 32), torch.randn(N, 32), torch.randn(32)
y, h = triton_ops.rmsnorm(x, w, 1e-6, r)
torch.testing.assert_close(h, x + r); torch.testing.assert_close(y, ops.rmsnorm_torch(x + r, w, 1e-6))
gu = torch.randn(N, 40)
torch.testing.assert_close(triton_ops.silu_mul(gu), torch.nn.functional.silu(gu[:, :20]) * gu[:, 20:])
qkv = torch.randn(N, (hq + 2 * hkv) * d)
ang = torch.rand(N, d // 2); ang = torch.cat([ang, ang], -1)
cos, sin = ang.cos(), ang.sin()
qn, kn = torch.rand(d) + 0.5, torch.rand(d) + 0.5
rk = torch.linalg.qr(torch.randn(hkv, d, d))[0]; mu = torch.randn(hkv, d)
for args in ((None, None, None, None), (qn, kn, rk, mu)):
    a = triton_ops.qk_prep(qkv, hq, hkv, d, cos, sin, args[0], args[1], 1e-6, args[2], args[3])
    b = ops.qk_prep_torch(qkv, hq, hkv, d, cos, sin, args[0], args[1], 1e-6, args[2], args[3])
    torch.testing.assert_close(a[0], b[0], atol=1e-5, rtol=1e-5); torch.testing.assert_close(a[1], b[1], atol=1e-5, rtol=1e-5)
B, P, pages = 3, 16, 9
kv = torch.randn(2, pages, hkv, P, d)
bt = torch.tensor([[1, 2, 3, 0], [4, 5, 0, 0], [0, 0, 0, 0]], dtype=torch.int32)
lens = torch.tensor([40, 17, 0], dtype=torch.int32)
q = torch.randn(B, hq, d)
got = triton_ops.paged_decode(q, kv, bt, lens, 0.25, max_len=64)
torch.testing.assert_close(got, ops.paged_decode_torch(q, kv, bt, lens, 0.25), atol=1e-4, rtol=1e-4)
# a block table (and grid) made for 256 tokens: each sequence spreads its own pages over the splits
wide = torch.cat([bt, torch.zeros(B, 12, dtype=torch.int32)], 1)
got = triton_ops.paged_decode(q, kv, wide, lens, 0.25, max_len=256)
torch.testing.assert_close(got, ops.paged_decode_torch(q, kv, wide, lens, 0.25), atol=1e-4, rtol=1e-4)
o, lse = next(w for k, w in triton_ops._WORK.items() if k[3] == 3)  # 3 splits of up to 6 pages
assert bool((lse.view(B, hq, 3)[0] > -1e29).all())  # 3 pages of sequence 0: one per split, none idle
print("OK")
'''

FUSED_WRITE = r'''
import torch
from oscarkv.engine import triton_ops
from oscarkv.engine.attention import DecodeCtx
from oscarkv.engine.kv import Bf16Pool, CacheConfig, OscarPool
torch.manual_seed(0)
N, hq, hkv, d, L, P = 3, 4, 2, 16, 2, 8
qkv = torch.randn(N, (hq + 2 * hkv) * d)
ang = torch.rand(N, d // 2); ang = torch.cat([ang, ang], -1)
cos, sin = ang.cos(), ang.sin()
qn, kn = torch.rand(d) + 0.5, torch.rand(d) + 0.5
rk = torch.linalg.qr(torch.randn(hkv, d, d))[0]; mu = torch.randn(hkv, d)
calib = dict(r_k=rk[None].expand(L, -1, -1, -1), mu_k=mu[None].expand(L, -1, -1), k_clip=torch.ones(L),
             v_clip=torch.ones(L))
pools = [Bf16Pool(CacheConfig("bf16", page_size=P), L, hkv, d, 6, 4, 64, torch.float32, "cpu")]
pools += [OscarPool(CacheConfig("oscar", page_size=4, sink=4, window=8), L, hkv, d, 6, 4, 64, wdt, "cpu", **calib)
          for wdt in (torch.float32, torch.bfloat16)]
for pool in pools:
    ctx = DecodeCtx(pool, N, d ** -0.5)
    bf16 = isinstance(pool, Bf16Pool)
    # two live rows and one padded row (page 0 / the scratch column)
    ctx.fill([1, 2, 3], [7, 9, 0], [2 * P + 3, 5 * P + 7, 0] if bf16 else [5, 0, pool.cfg.c16], [1, 1, 0], [0] * 3)
    rot = (None, None) if bf16 else (rk, mu)
    store = pool.kv if bf16 else pool.buf
    for layer in range(L):
        q0, kv = triton_ops.qk_prep(qkv, hq, hkv, d, cos, sin, qn, kn, 1e-6, *rot)
        before = store.clone()
        ctx.write_kv(layer, kv)  # the reference write (PyTorch path)
        ref = store.clone()
        store.copy_(before)
        q1, none = triton_ops.qk_prep(qkv, hq, hkv, d, cos, sin, qn, kn, 1e-6, *rot, out=ctx.kv_dest(layer))
        assert none is None and torch.equal(q0, q1)
        assert not torch.equal(store, before)
        if store.dtype == torch.float32:
            assert torch.equal(store, ref), type(pool).__name__
        else:  # the interpreter truncates to bf16 where the GPU (and torch) round: one ulp at most
            torch.testing.assert_close(store.float(), ref.float(), atol=0, rtol=2 ** -7)
print("OK")
'''

GEMV = r'''
import torch
from oscarkv.engine import ops, triton_ops
from oscarkv.engine.triton_ops import GemvConfig
torch.manual_seed(0)
cfgs = [GemvConfig("fma", 8, 32, 4, 1), GemvConfig("fma", 4, 64, 4, 2), GemvConfig("dot", 16, 32, 4, 2),
        GemvConfig("fma", 8, 16, 4, 1, split_k=3), GemvConfig("fma", 16, 32, 4, 1, split_k=2),
        GemvConfig("dot", 16, 16, 4, 2, split_k=4)]  # split-K: ragged slices (K=72: 5 tiles of 16 in 3)
for dt, M, N, K in ((torch.float32, 1, 48, 64), (torch.float32, 3, 40, 72), (torch.float32, 8, 48, 64),
                    (torch.float16, 2, 40, 72)):  # even and ragged tiles
    w = (torch.randn(N, K) / K ** 0.5).to(dt)
    b, nw = torch.randn(N).to(dt), (torch.rand(K) + 0.5).to(dt)
    x, gu, res = torch.randn(M, K).to(dt), torch.randn(M, 2 * K).to(dt), torch.randn(M, N).to(dt)
    cases = ((x, {}), (x, dict(b=b, residual=res)), (x, dict(norm=nw, eps=1e-6)), (gu, dict(act="silu", residual=res)))
    for cfg in cfgs + [None]:
        for xin, kw in cases:
            got = triton_ops.gemv(xin, w, config=cfg, **kw)
            ref = ops.gemv_torch(xin.float(), w.float(), **{k: v.float() if torch.is_tensor(v) else v for k, v in kw.items()})
            tol = 1e-5 if dt == torch.float32 else 2e-2
            torch.testing.assert_close(got.float(), ref, atol=tol, rtol=tol, msg=lambda m: f"{dt} {M}x{N}x{K} {cfg} {list(kw)}: {m}")
            # again (split-K: the tickets were reset), and as float32 output (the same rounded values)
            again = triton_ops.gemv(xin, w, config=cfg, out_dtype=torch.float32, **kw)
            assert again.dtype == torch.float32 and torch.equal(again, got.float()), (dt, M, N, K, cfg, list(kw))
assert all(not c.any() for k, c in triton_ops._SPLIT_WORK.items() if c.dtype == torch.int32)  # tickets back to 0
for bad in (dict(act="gelu"), dict(norm=torch.ones(64), act="silu")):
    try:
        triton_ops.gemv(torch.randn(1, 64), torch.randn(8, 64), **bad)
        raise AssertionError(bad)
    except ValueError:
        pass
print("OK")
'''

# The whole decode path with Triton ops forced on CPU: greedy tokens of a BF16-cache engine with the fused GEMV
# equal transformers'; an OSCAR engine (float32 windows, biases from the value folding) equals the PyTorch path.
ENGINE = r'''
import sys
import torch
sys.path.insert(0, "tests/engine")
from conftest import tiny_hf
from test_engine_oscar import SMALL, make_calib
from oscarkv.engine import LLM, SamplingParams, ops, triton_ops
calls = {"gemv": 0, "fused_write": 0}
gemv, qk_prep = triton_ops.gemv, triton_ops.qk_prep
def count_gemv(*a, **k):
    calls["gemv"] += 1
    return gemv(*a, **k)
def count_qk(*a, **k):
    calls["fused_write"] += a[-1] is not None if len(a) > 11 else 0
    return qk_prep(*a, **k)
triton_ops.gemv, triton_ops.qk_prep = count_gemv, count_qk
params = SamplingParams(max_tokens=6, ignore_eos=True)
kw = dict(kv_budget_gb=0.01, max_num_seqs=4, max_model_len=64)
g = torch.Generator().manual_seed(1)
prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (1, 9, 21)]
hf = tiny_hf("qwen3")
ref = [hf.generate(torch.tensor([p]), max_new_tokens=6, min_new_tokens=6, do_sample=False)[0, len(p):].tolist()
       for p in prompts]
ops._FORCE_TRITON = True
got = [o.token_ids for o in LLM(hf, kv="bf16", gemv="triton", **kw).generate(prompts, params)]
ops._FORCE_TRITON = False
assert got == ref, (got, ref)
assert calls["gemv"] == 5 * (2 * 4 + 1) and calls["fused_write"] == 5 * 2, calls  # 5 decode steps, 2 layers
hf = tiny_hf("qwen2")
calib = make_calib(hf, SMALL)  # sink 4, window 8, page 4: decode steps demote pages
base = [o.token_ids for o in LLM(hf, calib, kv="oscar", window_dtype=torch.float32, **kw).generate(prompts, params)]
ops._FORCE_TRITON = True
osc = LLM(hf, calib, kv="oscar", window_dtype=torch.float32, gemv="triton", **kw)
got = [o.token_ids for o in osc.generate(prompts, params)]
ops._FORCE_TRITON = False
assert got == base, (got, base)
assert osc.pool.alloc.num_free == osc.pool.alloc.capacity
print("OK")
'''


def _interpret(script: str) -> None:
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    root = os.path.join(os.path.dirname(__file__), "..", "..")
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600,
                         cwd=root)
    assert res.returncode == 0 and "OK" in res.stdout, res.stderr[-3000:]


def test_triton_ops_match_torch_in_interpreter():
    _interpret(SCRIPT)


def test_fused_kv_write_equals_reference_write_in_interpreter():
    _interpret(FUSED_WRITE)


def test_gemv_matches_spec_in_interpreter():
    _interpret(GEMV)


def test_triton_decode_path_greedy_in_interpreter():
    _interpret(ENGINE)
