"""The CUDA C++ decode kernel (GPU only): against float64 attention over the dequantized cache, both launch
shapes (one kernel per tier, or fused), and inside a captured CUDA graph replayed with new lengths."""

import pytest
import torch
from kernel_helpers import DEVICE, build_cache, rel_err

from oscarkv.kernels.plan import DecodePlan
from oscarkv.kernels.reference import decode_attention_ref

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(DEVICE.type != "cuda", reason="needs a CUDA GPU")]

CASES = [  # (B, Hkv, group, d, 2-bit lengths range, dtype of the 16-bit tiers)
    (1, 8, 4, 128, 3000, torch.bfloat16),
    (13, 8, 4, 128, 3000, torch.float16),
    (5, 8, 1, 64, 2000, torch.bfloat16),
    (3, 4, 8, 256, 2000, torch.bfloat16),
    (97, 2, 6, 128, 1500, torch.bfloat16),
]


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_cuda_decode_matches_float64_reference(case, fused):
    from oscarkv.kernels.decode_cuda import decode_attention_cuda

    B, hkv, g, d, maxlen, dt = case
    lens = torch.randint(0, maxlen, (B,)).tolist()
    lens[0] = maxlen - 17
    lens16 = torch.randint(0, 320, (B,)).tolist()
    args = build_cache(B, hkv, g, d, 64, lens, lens16, 320, dtype16=dt)
    q = torch.randn(B, hkv * g, d, device=DEVICE, dtype=torch.bfloat16)
    plan = DecodePlan(B, hkv * g, hkv, d, 64, args[2].shape[1], 320, device=DEVICE).update(B)
    ref = decode_attention_ref(q, *args, dtype=torch.float64)
    out32 = torch.full((B, hkv * g, d), float("nan"), device=DEVICE)
    decode_attention_cuda(q, *args, plan=plan, out=out32, fused=fused)
    assert rel_err(out32, ref) < 1e-3
    out = decode_attention_cuda(q, *args, plan=plan, fused=fused)
    assert out.dtype == torch.bfloat16 and rel_err(out, ref) < 6e-3


def test_cuda_decode_in_cuda_graph_sees_new_lengths():
    from oscarkv.kernels.decode_cuda import decode_attention_cuda

    B, hkv, g, d = 4, 8, 4, 128
    kp, vp, bt, ql, k16, v16, l16 = build_cache(B, hkv, g, d, 64, [900, 1200, 64, 700], [10, 300, 0, 5], 320)
    q = torch.randn(B, hkv * g, d, device=DEVICE, dtype=torch.bfloat16)
    plan = DecodePlan(B, hkv * g, hkv, d, 64, bt.shape[1], 320, device=DEVICE).update(B)
    out = torch.empty(B, hkv * g, d, device=DEVICE, dtype=torch.float32)
    decode_attention_cuda(q, kp, vp, bt, ql, k16, v16, l16, plan=plan, out=out)  # build + load outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_attention_cuda(q, kp, vp, bt, ql, k16, v16, l16, plan=plan, out=out)
    ql.copy_(torch.tensor([500, 1199, 1, 64], dtype=torch.int32))
    l16.copy_(torch.tensor([300, 0, 7, 1], dtype=torch.int32))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(out, decode_attention_ref(q, kp, vp, bt, ql, k16, v16, l16, dtype=torch.float64)) < 1e-3
