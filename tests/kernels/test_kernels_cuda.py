"""The CUDA C++ decode kernel (GPU only): against float64 attention over the dequantized cache, both launch
shapes (one kernel per tier, or fused), and inside a captured CUDA graph replayed with new lengths."""

import pytest
import torch
from kernel_helpers import DEVICE, build_cache, rel_err

from oscarkv.kernels.plan import DecodePlan
from oscarkv.kernels.reference import decode_attention_ref

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(DEVICE.type != "cuda", reason="needs a CUDA GPU")]

CASES = [  # (B, Hkv, group, d, 2-bit lengths range, dtype of the 16-bit tiers, page size, metadata dtype)
    (1, 8, 4, 128, 3000, torch.bfloat16, 64, torch.float16),
    (13, 8, 4, 128, 3000, torch.float16, 64, torch.float16),
    (5, 8, 1, 64, 2000, torch.bfloat16, 64, torch.bfloat16),
    (3, 4, 8, 256, 2000, torch.bfloat16, 64, torch.float32),
    (97, 2, 6, 128, 1500, torch.bfloat16, 64, torch.float16),
    (7, 8, 4, 128, 1100, torch.bfloat16, 16, torch.float16),   # one chunk per page: pages alternate buffers
    (6, 8, 4, 128, 1100, torch.bfloat16, 48, torch.float16),   # three chunks per page (odd)
    (4, 8, 4, 64, 1100, torch.float16, 128, torch.bfloat16),   # eight chunks per page
]


@pytest.mark.parametrize("merge", ["fused", "kernel"])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_cuda_decode_matches_float64_reference(case, fused, merge):
    from oscarkv.kernels.decode_cuda import decode_attention_cuda

    B, hkv, g, d, maxlen, dt, ps, meta = case
    lens = torch.randint(0, maxlen, (B,)).tolist()
    lens[0] = maxlen - 17
    lens16 = torch.randint(0, 320, (B,)).tolist()
    args = build_cache(B, hkv, g, d, ps, lens, lens16, 320, dtype16=dt, meta_dtype=meta)
    q = torch.randn(B, hkv * g, d, device=DEVICE, dtype=torch.bfloat16)
    plan = DecodePlan(B, hkv * g, hkv, d, ps, args[2].shape[1], 320, device=DEVICE).update(B)
    ref = decode_attention_ref(q, *args, dtype=torch.float64)
    out32 = torch.full((B, hkv * g, d), float("nan"), device=DEVICE)
    decode_attention_cuda(q, *args, plan=plan, out=out32, fused=fused, merge=merge)
    assert rel_err(out32, ref) < 1e-3
    out = decode_attention_cuda(q, *args, plan=plan, fused=fused, merge=merge)
    assert out.dtype == torch.bfloat16 and rel_err(out, ref) < 6e-3
    assert int(plan.counters.abs().sum()) == 0  # the fused merge leaves its ticket counters at zero
    again = torch.full_like(out32, float("nan"))
    decode_attention_cuda(q, *args, plan=plan, out=again, fused=fused, merge=merge)
    assert torch.equal(again, out32)  # deterministic: the same CTA order-independent merge


@pytest.mark.parametrize("ppsm", [1, 4, 16])
def test_cuda_decode_split_counts(ppsm):
    """Few long splits and many short ones (the fused merge reads every split's partial)."""
    from oscarkv.kernels.decode_cuda import decode_attention_cuda

    B, hkv, g, d = 2, 8, 4, 128
    args = build_cache(B, hkv, g, d, 64, [20000, 7000], [320, 100], 320)
    q = torch.randn(B, hkv * g, d, device=DEVICE, dtype=torch.bfloat16)
    plan = DecodePlan(B, hkv * g, hkv, d, 64, args[2].shape[1], 320, device=DEVICE, programs_per_sm=ppsm,
                      min_pages_per_split=1).update(B)
    out = torch.full((B, hkv * g, d), float("nan"), device=DEVICE)
    decode_attention_cuda(q, *args, plan=plan, out=out)
    assert rel_err(out, decode_attention_ref(q, *args, dtype=torch.float64)) < 1e-3


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
