"""Extend (prefill over a quantized prefix) for every storage format: the fused kernel (the CPU interpreter at tiny
shapes, the GPU at real ones) and the cuDNN fold (GPU; the prefix dequantized segment by segment, attended with
its log-sum-exp, the partials merged), against float64 attention over the dequantized cache; the page
dequantization into a workspace; the default path's choice and its fallback.

Error budget (relative Frobenius norm vs the float64 reference): 2e-3 with float16 inputs, 1e-2 with bfloat16
inputs (P rounded to bfloat16 for the 16-bit products, the output to bfloat16).
"""

import warnings

import pytest
import torch
from kernel_helpers import (
    DEVICE,
    FORMATS,
    build_cache,
    fmt_id,
    rel_err,
    sharp_extend_case,
)

from oscarkv.kernels import extend_sdpa
from oscarkv.kernels.extend_sdpa import _by_head, _merge, sdpa_supported
from oscarkv.kernels.reference import extend_attention_ref, gather_dequant_ref

GPU = DEVICE.type == "cuda"
BUDGET = {torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float32: 2e-3}

# (B, Hkv, group, page, quantized lengths, 16-bit lengths, C16, chunk T, dtype), d = 32 on CPU
CPU_CASES = [(2, 2, 4, 16, [37, 0], [5, 9], 20, 7, torch.float16),
             (2, 1, 1, 16, [33, 16], [0, 3], 8, 5, torch.bfloat16)]
GPU_CASES = [(2, 8, 4, 64, [1500, 333], [100, 7], 320, 300, torch.bfloat16),
             (3, 4, 8, 64, [64, 0, 999], [0, 1, 64], 64, 129, torch.float16),
             (4, 8, 1, 16, [129, 400, 17, 2048], [3, 0, 320, 64], 320, 16, torch.float32)]


def _inputs(fmt, case, d):
    kb, lay, vb = fmt
    B, hkv, g, ps, lens, lens16, c16, T, dt = case
    dt16 = torch.float16 if dt == torch.float32 else dt
    cache = build_cache(B, hkv, g, d, ps, lens, lens16, c16, dtype16=dt16, key_layout=lay, k_bits=kb, v_bits=vb)
    q = torch.randn(B, T, hkv * g, d, device=DEVICE, dtype=dt)
    kn = torch.randn(B, T, hkv, d, device=DEVICE, dtype=dt16)
    vn = torch.randn(B, T, hkv, d, device=DEVICE, dtype=dt16)
    return q, kn, vn, cache


@pytest.mark.interpret
@pytest.mark.skipif(GPU, reason="the interpreter stage")
@pytest.mark.parametrize("fmt", FORMATS, ids=fmt_id)
def test_fused_extend_every_format_interpreter(fmt):
    from oscarkv.kernels.extend_triton import extend_attention_triton

    for case in CPU_CASES:
        q, kn, vn, cache = _inputs(fmt, case, 32)
        out = torch.full_like(q, float("nan"))
        extend_attention_triton(q, kn, vn, *cache, out=out)
        ref = extend_attention_ref(q, kn, vn, *cache, dtype=torch.float64)
        assert rel_err(out, ref) < BUDGET[case[-1]], case


@pytest.mark.interpret
@pytest.mark.skipif(GPU, reason="the interpreter stage")
def test_fused_extend_sharp_attention_growing_scales():
    """The running max moves page after page, V scales grow 100x after the first page, a sharp softmax."""
    from oscarkv.kernels.extend_triton import extend_attention_triton

    q, kn, vn, args, ref = sharp_extend_case()
    assert rel_err(extend_attention_triton(q, kn, vn, *args), ref) < BUDGET[torch.float16]


@pytest.mark.interpret
@pytest.mark.skipif(GPU, reason="the interpreter stage")
@pytest.mark.parametrize("fmt", FORMATS, ids=fmt_id)
def test_dequant_workspace_is_the_rounded_dequantization(fmt):
    """Rows of the workspace = the reference's dequantized rows rounded once to float16; zeros past the end."""
    from oscarkv.kernels.dequant_triton import dequant_pages_into

    kb, lay, vb = fmt
    kp, vp, bt, ql, *_ = build_cache(2, 2, 1, 32, 16, [37, 5], [0, 0], 4, key_layout=lay, k_bits=kb, v_bits=vb)
    kw = torch.full((2, 2, 48, 32), float("nan"), dtype=torch.float16)
    vw = kw.clone()
    dequant_pages_into(kp, vp, bt, ql, kw, vw, 3)
    for b, n in enumerate(ql.tolist()):
        for w, pages in ((kw, kp), (vw, vp)):
            want = gather_dequant_ref(pages, bt, b, n).half()
            assert torch.equal(w[b, :, :n], want), (fmt, b)
            assert not w[b, :, n:].any()


def _sdpa(q, kn, vn, cache, segment):
    """The cuDNN fold as the launcher calls it (sm_scale resolved, output allocated, float32 q prescaled)."""
    d = q.shape[-1]
    sm = d**-0.5
    if q.dtype == torch.float32:
        q, sm = (q * sm).half(), 1.0
    out = torch.full(q.shape, float("nan"), device=q.device, dtype=q.dtype)
    return extend_sdpa.extend_attention_sdpa(q, kn, vn, *cache, sm, out, segment_tokens=segment)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("fmt", FORMATS, ids=fmt_id)
def test_extend_every_format_gpu(fmt):
    """The fused kernel, the default path (with host lengths, as a captured step calls it) and the cuDNN fold
    in segments of one page, a few pages and the whole prefix; and the fused kernel inside a CUDA graph."""
    from oscarkv.kernels.extend_triton import extend_attention_triton

    for case in GPU_CASES:
        q, kn, vn, cache = _inputs(fmt, case, 128 if case[2] != 8 else 64)
        ref = extend_attention_ref(q, kn, vn, *cache, dtype=torch.float64)
        budget = BUDGET[case[-1]]
        out = torch.full_like(q, float("nan"))
        extend_attention_triton(q, kn, vn, *cache, out=out, fold="fused")
        assert rel_err(out, ref) < budget, ("fused", case[:4])
        hl = (cache[3].tolist(), cache[6].tolist())
        assert rel_err(extend_attention_triton(q, kn, vn, *cache, host_lengths=hl), ref) < budget
        if q.dtype != torch.float32:
            for seg in (case[3], 8 * case[3], 1 << 15):
                assert rel_err(_sdpa(q, kn, vn, cache, seg), ref) < budget, ("sdpa", seg, case[:4])
    q, kn, vn, cache = _inputs(fmt, GPU_CASES[1], 64)
    out = torch.empty_like(q)
    extend_attention_triton(q, kn, vn, *cache, out=out, fold="fused")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        extend_attention_triton(q, kn, vn, *cache, out=out, fold="fused")
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(out, extend_attention_ref(q, kn, vn, *cache, dtype=torch.float64)) < BUDGET[torch.float16]


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
def test_sdpa_fold_sharp_attention_growing_scales():
    q, kn, vn, args, ref = sharp_extend_case()
    assert rel_err(_sdpa(q, kn, vn, args, args[0].fmt.page_size), ref) < BUDGET[torch.float16]


def test_merge_kernel_against_torch():
    """Two partials (one folded [Hkv, T G], one by head [Hq, T]) with rows empty in one, the other or both."""
    if not GPU:
        pytest.importorskip("triton")
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
    oa_h = oa[0].view(hkv, T, G, d).permute(0, 2, 1, 3).reshape(hq, T, d)
    la_h = la[0].view(hkv, T, G).permute(0, 2, 1).reshape(hq, T)
    lse = torch.logaddexp(la_h, lb)
    wa = torch.where(lse > float("-inf"), torch.exp(la_h - lse), 0.0)
    wb = torch.where(lse > float("-inf"), torch.exp(lb - lse), 0.0)
    ref = (oa_h * wa[..., None] + ob * wb[..., None]).transpose(0, 1)
    assert torch.isfinite(out).all()
    assert not out[3, 4].any()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_extend_rejects_bad_arguments():
    from oscarkv.kernels.extend_triton import extend_attention_triton

    kp, vp, bt, ql, k16, v16, l16 = build_cache(1, 1, 4, 32, 16, [20], [3], 4)
    q = torch.randn(1, 3, 4, 32, device=DEVICE).half()
    kn = torch.randn(1, 3, 1, 32, device=DEVICE).half()
    with pytest.raises(ValueError, match="fold"):
        extend_attention_triton(q, kn, kn, kp, vp, bt, ql, k16, v16, l16, fold="dequant")
    with pytest.raises(ValueError, match="k_new"):
        extend_attention_triton(q, kn[:, :2], kn, kp, vp, bt, ql, k16, v16, l16)
    with pytest.raises(ValueError, match="host_lengths"):
        extend_sdpa.extend_attention_sdpa(q, kn, kn, kp, vp, bt, ql, k16, v16, l16, 0.1, torch.empty_like(q),
                                          host_lengths=([20, 1], [3]))
    with pytest.raises(ValueError, match="segment_tokens"):
        extend_sdpa.extend_attention_sdpa(q, kn, kn, kp, vp, bt, ql, k16, v16, l16, 0.1, torch.empty_like(q),
                                          segment_tokens=8)


@pytest.mark.skipif(GPU, reason="the CPU default")
def test_default_off_cuda_is_the_fused_kernel():
    assert not sdpa_supported(torch.randn(1, 3, 4, 64).half(), 64)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA")
def test_default_on_cuda_is_sdpa_and_falls_back(monkeypatch):
    """On a GPU with cuDNN attention the default is the cuDNN fold; when cuDNN fails, the default warns once and
    runs the fused kernel (same result within the budget), while an explicit fold="sdpa" raises; out of memory,
    it warns and runs the fused kernel for that call only."""
    from oscarkv.kernels.extend_triton import extend_attention_triton

    case = GPU_CASES[0]
    q, kn, vn, cache = _inputs((2, "token", 2), case, 128)
    assert sdpa_supported(q, 128)
    assert not sdpa_supported(torch.empty(4, 16, 32, 128, device=DEVICE, dtype=torch.bfloat16), 128)
    calls = []
    real = extend_sdpa._attend_lse
    monkeypatch.setattr(extend_sdpa, "_attend_lse", lambda *a, **k: calls.append(1) or real(*a, **k))
    ref = extend_attention_ref(q, kn, vn, *cache, dtype=torch.float64)
    assert rel_err(extend_attention_triton(q, kn, vn, *cache), ref) < BUDGET[case[-1]]
    assert calls, "the default did not take the cuDNN fold"

    def oom(*a, **k):
        raise torch.OutOfMemoryError("no memory for the workspace (test)")

    monkeypatch.setattr(extend_sdpa, "_attend_lse", oom)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = extend_attention_triton(q, kn, vn, *cache)
    assert any("out of memory" in str(x.message) for x in w)
    assert rel_err(out, ref) < BUDGET[case[-1]]
    assert sdpa_supported(q, 128)  # an out-of-memory call is not remembered against cuDNN

    def boom(*a, **k):
        raise RuntimeError("cuDNN refused (test)")

    monkeypatch.setattr(extend_sdpa, "_attend_lse", boom)
    monkeypatch.setattr(extend_sdpa, "_CUDNN_BROKEN", {})
    with pytest.raises(RuntimeError):
        extend_attention_triton(q, kn, vn, *cache, fold="sdpa")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = extend_attention_triton(q, kn, vn, *cache)
    assert any("cuDNN attention failed" in str(x.message) for x in w)
    assert rel_err(out, ref) < BUDGET[case[-1]]
    assert not sdpa_supported(q, 128)  # remembered: later calls go straight to the fused kernel
