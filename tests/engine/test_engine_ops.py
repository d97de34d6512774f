"""Triton ops of the engine against their PyTorch specification (interpreter on CPU, float32, tiny shapes). The
interpreter truncates float32 -> bfloat16 where the GPU rounds, so bf16 stores are checked to one ulp here."""

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

