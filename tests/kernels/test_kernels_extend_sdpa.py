"""``fold="sdpa"`` (:mod:`oscarkv.kernels.extend_sdpa`): the prefix dequantized segment by segment into a bounded
workspace, attended with its log-sum-exp (cuDNN on a GPU; float32 math in the interpreter), the chunk causally,
the partials merged by a Triton kernel. Against float64 attention over the dequantized cache, with the budgets of
``test_kernels_extend_variants.py`` (2e-3 float16 inputs, 1e-2 bfloat16), at segment sizes that split the prefix
into one page per segment, a few pages, and one segment; with the prefix lengths from the host and from the device.
"""

import warnings

import pytest
import torch
from kernel_helpers import DEVICE, build_cache, rel_err, sharp_extend_case

from oscarkv.kernels import extend_sdpa
from oscarkv.kernels.extend_sdpa import _merge, _by_head, sdpa_supported
from oscarkv.kernels.extend_triton import extend_attention_triton
from oscarkv.kernels.reference import extend_attention_ref

GPU = DEVICE.type == "cuda"
BUDGET = {torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float32: 2e-3}

# (B, Hkv, group, d, page, 2-bit lengths, 16-bit lengths, C16, chunk T, dtype): mixed and empty tiers, GQA 1/4/6/8
CASES = [(2, 2, 4, 64, 16, [37, 0], [5, 9], 20, 7, torch.float16),
         (3, 1, 6, 64, 16, [33, 16, 0], [0, 3, 0], 8, 5, torch.bfloat16),
         (1, 2, 1, 128, 16, [50], [4], 8, 9, torch.float32),
         (1, 1, 8, 64, 16, [70], [0], 4, 3, torch.float16)]
SEGMENTS = [16, 48, 1 << 15]  # one page, three pages, everything at once
if GPU:
    CASES = [(2, 8, 4, 128, 64, [1500, 333], [100, 7], 320, 300, torch.bfloat16),
             (3, 4, 6, 64, 64, [64, 0, 999], [0, 1, 64], 64, 129, torch.float16),
             (1, 8, 8, 128, 64, [4000], [200], 256, 64, torch.float32)]
    SEGMENTS = [64, 1024, 1 << 15]


def _inputs(case, key_layout="token"):
    B, hkv, g, d, ps, lens, lens16, c16, T, dt = case
    dt16 = torch.float16 if dt == torch.float32 else dt
    cache = build_cache(B, hkv, g, d, ps, lens, lens16, c16, dtype16=dt16, key_layout=key_layout)
    q = torch.randn(B, T, hkv * g, d, device=DEVICE, dtype=dt)
    kn = torch.randn(B, T, hkv, d, device=DEVICE, dtype=dt16)
    vn = torch.randn(B, T, hkv, d, device=DEVICE, dtype=dt16)
    return q, kn, vn, cache


@pytest.mark.parametrize("segment", SEGMENTS)
@pytest.mark.parametrize("case", CASES)
def test_sdpa_fold_matches_float64_reference(case, segment):
    q, kn, vn, (kp, vp, bt, ql, k16, v16, l16) = _inputs(case)
    out = torch.full_like(q, float("nan"))
    extend_attention_triton(q, kn, vn, kp, vp, bt, ql, k16, v16, l16, out=out, fold="sdpa", segment_tokens=segment)
    ref = extend_attention_ref(q, kn, vn, kp, vp, bt, ql, k16, v16, l16, dtype=torch.float64)
    assert rel_err(out, ref) < BUDGET[case[-1]]
    # host lengths instead of the device read: the same launches, so the same bits
    out2 = extend_attention_triton(q, kn, vn, kp, vp, bt, ql, k16, v16, l16, fold="sdpa", segment_tokens=segment,
                                   host_lengths=(ql.tolist(), l16.tolist()))
    assert torch.equal(out2, out)


def test_sdpa_fold_channel_keys():
    case = CASES[0]
    q, kn, vn, (kp, vp, bt, ql, k16, v16, l16) = _inputs(case, key_layout="channel")
    out = extend_attention_triton(q, kn, vn, kp, vp, bt, ql, k16, v16, l16, fold="sdpa", segment_tokens=SEGMENTS[1])
    ref = extend_attention_ref(q, kn, vn, kp, vp, bt, ql, k16, v16, l16, dtype=torch.float64)
    assert rel_err(out, ref) < BUDGET[case[-1]]


def test_sdpa_fold_sharp_attention_growing_scales():
    """The running max moves page after page and V scales grow 100x after the first page (segments must merge
    exactly, whatever their log-sum-exps)."""
    q, kn, vn, args, ref = sharp_extend_case()
    out = extend_attention_triton(q, kn, vn, *args, fold="sdpa", segment_tokens=args[0].fmt.page_size)
    assert rel_err(out, ref) < BUDGET[torch.float16]


def test_merge_kernel_against_torch():
    """Two partials (one folded [Hkv, T G], one by head [Hq, T]) with rows empty in one, the other or both."""
    hkv, G, T, d = 2, 3, 5, 64
    hq = hkv * G
    oa = torch.randn(1, hkv, T * G, d, device=DEVICE)
    la = torch.randn(1, hkv, T * G, device=DEVICE) * 3
    ob = torch.randn(hq, T, d, device=DEVICE)
    lb = torch.randn(hq, T, device=DEVICE) * 3
    la[0, 0, :2] = float("-inf")  # token 0, heads 0, 1: only b
    lb[5, 2] = float("-inf")      # token 2, head 5: only a
    la[0, 1, 3 * G + 1] = float("-inf")
    lb[4, 3] = float("-inf")      # token 3, head 4 = (h 1, g 1): neither
    out = torch.full((T, hq, d), float("nan"), device=DEVICE)
    a = (oa, la, (G * oa.stride(2), oa.stride(1), oa.stride(2)), (G * la.stride(2), la.stride(1), la.stride(2)))
    _merge(a, (ob, lb, *_by_head(ob, lb, G)), out, (out.stride(0), G * out.stride(1), out.stride(1)), None,
           (0, 0, 0), T, hq, G, d)
    # torch: a to [Hq, T]
    oa_h = oa[0].view(hkv, T, G, d).permute(0, 2, 1, 3).reshape(hq, T, d)
    la_h = la[0].view(hkv, T, G).permute(0, 2, 1).reshape(hq, T)
    lse = torch.logaddexp(la_h, lb)
    wa = torch.where(lse > float("-inf"), torch.exp(la_h - lse), 0.0)
    wb = torch.where(lse > float("-inf"), torch.exp(lb - lse), 0.0)
    ref = (oa_h * wa[..., None] + ob * wb[..., None]).transpose(0, 1)
    assert torch.isfinite(out).all()
    assert not out[3, 4].any()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_sdpa_fold_rejects_fused_knobs_and_small_segments():
    kp, vp, bt, ql, k16, v16, l16 = build_cache(1, 1, 4, 64, 16, [20], [3], 4)
    q = torch.randn(1, 3, 4, 64, device=DEVICE).half()
    kn = torch.randn(1, 3, 1, 64, device=DEVICE).half()
    for bad in ({"pages_per_step": 2}, {"block_m": 32}, {"rescale": "lazy"}, {"tma": True}, {"segment_tokens": 8}):
        with pytest.raises(ValueError):
            extend_attention_triton(q, kn, kn, kp, vp, bt, ql, k16.half(), v16.half(), l16, fold="sdpa", **bad)
    with pytest.raises(ValueError, match="host_lengths"):
        extend_attention_triton(q, kn, kn, kp, vp, bt, ql, k16.half(), v16.half(), l16, fold="sdpa",
                                host_lengths=([20, 1], [3]))


@pytest.mark.skipif(GPU, reason="the CPU default")
def test_default_fold_off_cuda_is_the_fused_kernel():
    q = torch.randn(1, 3, 4, 64, device=DEVICE).half()
    assert not sdpa_supported(q, 64)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA")
def test_default_fold_on_cuda_is_sdpa_and_falls_back(monkeypatch):
    """On a GPU with cuDNN attention the default is fold="sdpa"; when cuDNN fails, the default warns once and
    runs the fused kernel (same result within the budget), while an explicit fold="sdpa" raises; out of memory,
    it warns and runs the fused kernel for that call only."""
    case = CASES[0]
    q, kn, vn, (kp, vp, bt, ql, k16, v16, l16) = _inputs(case)
    assert sdpa_supported(q, case[3])
    # several short chunks stay with the fused kernel (extend_sdpa.min_chunk)
    assert not sdpa_supported(torch.empty(4, 16, 32, 128, device=DEVICE, dtype=torch.bfloat16), 128)
    calls = []
    real = extend_sdpa._attend_lse
    monkeypatch.setattr(extend_sdpa, "_attend_lse", lambda *a, **k: calls.append(1) or real(*a, **k))
    ref = extend_attention_ref(q, kn, vn, kp, vp, bt, ql, k16, v16, l16, dtype=torch.float64)
    assert rel_err(extend_attention_triton(q, kn, vn, kp, vp, bt, ql, k16, v16, l16), ref) < BUDGET[case[-1]]
    assert calls, "the default did not take fold='sdpa'"

    def oom(*a, **k):
        raise torch.OutOfMemoryError("no memory for the workspace (test)")

    monkeypatch.setattr(extend_sdpa, "_attend_lse", oom)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = extend_attention_triton(q, kn, vn, kp, vp, bt, ql, k16, v16, l16)
    assert any("out of memory" in str(x.message) for x in w)
    assert rel_err(out, ref) < BUDGET[case[-1]]
    assert sdpa_supported(q, case[3])  # an out-of-memory call is not remembered against cuDNN

    def boom(*a, **k):
        raise RuntimeError("cuDNN refused (test)")

    monkeypatch.setattr(extend_sdpa, "_attend_lse", boom)
    monkeypatch.setattr(extend_sdpa, "_CUDNN_BROKEN", {})
    with pytest.raises(RuntimeError):
        extend_attention_triton(q, kn, vn, kp, vp, bt, ql, k16, v16, l16, fold="sdpa")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = extend_attention_triton(q, kn, vn, kp, vp, bt, ql, k16, v16, l16)
    assert any("cuDNN attention failed" in str(x.message) for x in w)
    assert rel_err(out, ref) < BUDGET[case[-1]]
    assert not sdpa_supported(q, case[3])  # remembered: later calls go straight to the fused kernel
