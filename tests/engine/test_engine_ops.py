"""Triton ops of the engine against their PyTorch specification (interpreter on CPU, float32, tiny shapes)."""

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


def test_triton_ops_match_torch_in_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "OK" in res.stdout, res.stderr[-3000:]
