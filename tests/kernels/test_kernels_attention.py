"""Decode and extend attention kernels against float64 attention over the dequantized cache.

Error budget (relative Frobenius norm vs the float64 reference), decode: 1e-3 for a float32 output (queries
and p * s_v are rounded to float16, 16-bit tiles use tf32 on tensor cores; measured ~5e-4), 6e-3 for a
bfloat16 output (its own rounding, 2^-9, dominates). Extend: 2e-3 with float16 inputs, 1e-2 with bfloat16
inputs (P is rounded to bfloat16 for the 16-bit products, and the output to bfloat16; measured ~4e-3).
"""

import pytest
import torch
from kernel_helpers import DEVICE, build_cache, rel_err

from oscarkv.kernels.decode_triton import decode_attention_triton
from oscarkv.kernels.extend_triton import extend_attention_triton
from oscarkv.kernels.plan import DecodePlan
from oscarkv.kernels.reference import decode_attention_ref, extend_attention_ref

GPU = DEVICE.type == "cuda"
BUDGET = {torch.float16: 2e-3, torch.bfloat16: 1e-2}  # extend

# (B, Hkv, group, d, page, 2-bit lengths, 16-bit lengths, C16): odd lengths, partial pages, empty tiers
CPU_CASES = [
    (3, 2, 4, 64, 16, [37, 0, 70], [5, 9, 0], 20),
    (2, 1, 6, 64, 16, [33, 16], [0, 3], 8),
    (2, 2, 1, 128, 16, [17, 1], [4, 0], 8),
    (1, 1, 8, 256, 16, [20], [2], 4),
]


def _gpu_cases():
    cases = []
    for g, d, B in ((4, 128, 1), (1, 64, 5), (6, 128, 13), (8, 256, 3), (4, 128, 97), (4, 64, 32)):
        lens = torch.randint(0, 3000, (B,)).tolist()
        lens[0] = 2113  # a partially filled last page
        lens16 = torch.randint(0, 320, (B,)).tolist()
        cases.append((B, 8 if d < 256 else 4, g, d, 64, lens, lens16, 320))
    return cases


CASES = _gpu_cases() if GPU else CPU_CASES


@pytest.mark.parametrize("case", CASES)
def test_decode_matches_float64_reference(case):
    B, hkv, g, d, ps, lens, lens16, c16 = case
    args = build_cache(B, hkv, g, d, ps, lens, lens16, c16)
    q = torch.randn(B, hkv * g, d, device=DEVICE, dtype=torch.bfloat16)
    plan = DecodePlan(B + 2, hkv * g, hkv, d, ps, args[2].shape[1], c16, device=DEVICE).update(B)
    out = decode_attention_triton(q, *args, plan=plan)
    ref = decode_attention_ref(q, *args, dtype=torch.float64)
    assert out.shape == (B, hkv * g, d) and out.dtype == q.dtype
    assert rel_err(out, ref) < 6e-3
    out32 = torch.full((B, hkv * g, d), float("nan"), device=DEVICE)
    decode_attention_triton(q, *args, plan=plan, out=out32)
    assert rel_err(out32, ref) < 1e-3


def test_decode_empty_sequence_gives_zeros_and_plan_is_reused():
    B, hkv, g, d, ps = 3, 1, 4, 64, 16
    args = build_cache(B, hkv, g, d, ps, [0, 40, 5], [0, 3, 0], 8)
    q = torch.randn(B, hkv * g, d, device=DEVICE)
    plan = DecodePlan(4, hkv * g, hkv, d, ps, args[2].shape[1], 8, device=DEVICE)
    with pytest.raises(ValueError, match="plan.update"):
        decode_attention_triton(q, *args, plan=plan)  # planned for 4 sequences, called with 3
    out = decode_attention_triton(q, *args, plan=plan.update(B))
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert rel_err(out[1:], decode_attention_ref(q, *args, dtype=torch.float64)[1:]) < 1e-3
    kp, vp, bt, ql, k16, v16, l16 = args
    out2 = decode_attention_triton(q[1:], kp, vp, bt[1:], ql[1:], k16[1:], v16[1:], l16[1:], plan=plan.update(2))
    assert rel_err(out2, out[1:]) < 1e-5


EXT_CASES = [(2, 2, 4, 64, 16, [37, 0], [5, 9], 20, 7, torch.float16),
             (1, 1, 3, 128, 16, [20], [3], 8, 21, torch.bfloat16)]
if GPU:
    EXT_CASES = [(2, 8, 4, 128, 64, [1500, 333], [100, 7], 320, 300, torch.bfloat16),
                 (3, 4, 6, 64, 64, [64, 0, 999], [0, 1, 64], 64, 129, torch.float16),
                 (1, 2, 8, 256, 64, [700], [33], 64, 77, torch.bfloat16)]


@pytest.mark.parametrize("case", EXT_CASES)
def test_extend_matches_float64_reference(case):
    B, hkv, g, d, ps, lens, lens16, c16, T, dt = case
    kp, vp, bt, ql, k16, v16, l16 = build_cache(B, hkv, g, d, ps, lens, lens16, c16, dtype16=dt)
    q = torch.randn(B, T, hkv * g, d, device=DEVICE, dtype=dt)
    kn = torch.randn(B, T, hkv, d, device=DEVICE, dtype=dt)
    vn = torch.randn(B, T, hkv, d, device=DEVICE, dtype=dt)
    out = extend_attention_triton(q, kn, vn, kp, vp, bt, ql, k16, v16, l16, block_m=32 if not GPU else 64,
                                  block_n=16 if not GPU else 64)
    ref = extend_attention_ref(q, kn, vn, kp, vp, bt, ql, k16, v16, l16, dtype=torch.float64)
    assert out.shape == q.shape
    assert rel_err(out, ref) < BUDGET[dt]


def test_decode_rejects_unsupported_format():
    from oscarkv.kernels.layout import PageFormat, QuantPages

    fmt = PageFormat(num_kv_heads=1, head_dim=64, page_size=16, group_size=32)
    pages = QuantPages.allocate(fmt, 1, DEVICE)
    z = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="reference"):
        decode_attention_triton(torch.zeros(1, 4, 64, device=DEVICE), pages, pages, z[:, None], z,
                                torch.zeros(1, 1, 1, 64, device=DEVICE), torch.zeros(1, 1, 1, 64, device=DEVICE), z)
