"""Decode attention for every storage format (keys token/channel x 2/4 bits, values 2/4 bits): the Triton kernel in
the CPU interpreter at tiny shapes, and on a GPU the CUDA C++ kernel and the Triton kernel at real shapes, against
float64 attention over the dequantized cache; CUDA-graph capture and replay with new lengths; what the dispatcher
picks.

Error budget (relative Frobenius norm vs the float64 reference): 2e-3 for a float32 output (queries, and p * s_v,
enter the tensor cores in float16, channel-page keys with their scale folded into the query: one more float16
rounding; 16-bit tiles in tf32 or float16 halves), 6e-3 for a bfloat16 output (its own rounding, 2^-9, dominates).
"""

import pytest
import torch
from kernel_helpers import DEVICE, FORMATS, build_cache, fmt_id, rel_err

from oscarkv.kernels import dispatch
from oscarkv.kernels.plan import DecodePlan
from oscarkv.kernels.reference import decode_attention_ref

GPU = DEVICE.type == "cuda"
gpu = [pytest.mark.gpu, pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")]

# (B, Hkv, group, d, page, quantized lengths, 16-bit lengths, C16): odd lengths, partial pages, empty tiers
CPU_CASES = [
    (3, 2, 4, 64, 16, [37, 0, 70], [5, 9, 0], 20),
    (2, 1, 1, 32, 16, [33, 16], [0, 3], 8),
]


def _case(fmt, case, q_dtype=torch.bfloat16, dtype16=torch.float16, meta=torch.float16):
    kb, lay, vb = fmt
    B, hkv, g, d, ps, lens, lens16, c16 = case
    args = build_cache(B, hkv, g, d, ps, lens, lens16, c16, dtype16=dtype16, key_layout=lay, k_bits=kb,
                       v_bits=vb, meta_dtype=meta)
    q = torch.randn(B, hkv * g, d, device=DEVICE).to(q_dtype)
    return q, args


@pytest.mark.interpret
@pytest.mark.skipif(GPU, reason="the interpreter stage")
@pytest.mark.parametrize("fmt", FORMATS, ids=fmt_id)
def test_triton_decode_every_format_interpreter(fmt):
    from oscarkv.kernels.decode_triton import decode_attention_triton

    for case in CPU_CASES:
        q, args = _case(fmt, case, q_dtype=torch.float32)
        ref = decode_attention_ref(q, *args, dtype=torch.float64)
        out = torch.full(q.shape, float("nan"))
        decode_attention_triton(q, *args, out=out)
        assert rel_err(out, ref) < 2e-3, (fmt, case)


def test_empty_sequence_gives_zeros_and_plan_is_reused():
    if not GPU:
        pytest.importorskip("triton")
    from oscarkv.kernels.decode_triton import decode_attention_triton

    kp, vp, bt, ql, k16, v16, l16 = build_cache(2, 1, 1, 32, 16, [20, 0], [3, 0], 4, k_bits=4, v_bits=2)
    q = torch.randn(2, 1, 32, device=DEVICE)
    plan = DecodePlan(2, 1, 1, 32, 16, bt.shape[1], 4, device=DEVICE).update(2)
    out = decode_attention_triton(q, kp, vp, bt, ql, k16, v16, l16, plan=plan)
    assert torch.equal(out[1], torch.zeros_like(out[1]))  # no tokens at all: zeros, as the reference
    again = decode_attention_triton(q, kp, vp, bt, ql, k16, v16, l16, plan=plan)
    assert torch.equal(out, again)


def _gpu_cases():
    g = torch.Generator().manual_seed(1)
    cases = []
    for B, hkv, grp, d, ps in ((1, 8, 4, 128, 64), (5, 8, 1, 64, 64), (13, 8, 8, 128, 64), (3, 4, 8, 256, 64),
                               (97, 2, 4, 128, 64), (7, 8, 4, 128, 16), (6, 8, 4, 128, 48), (4, 8, 4, 64, 128),
                               (1, 2, 7, 64, 32)):
        lens = torch.randint(0, 3000, (B,), generator=g).tolist()
        lens[0] = 2113  # a partially filled last page
        lens16 = torch.randint(0, 320, (B,), generator=g).tolist()
        cases.append((B, hkv, grp, d, ps, lens, lens16, 320))
    return cases


GPU_CASES = _gpu_cases() if GPU else []
_IDS = ["b1h8g4d128", "b5g1d64", "b13g8", "b3g8d256", "b97h2", "ps16", "ps48", "ps128d64", "b1h2g7d64ps32"]


@pytest.mark.parametrize("fmt", FORMATS, ids=fmt_id)
@pytest.mark.parametrize("ci", range(len(_IDS)), ids=_IDS)
@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
def test_cuda_decode_every_format(fmt, ci):
    from oscarkv.kernels import decode_cuda

    case = GPU_CASES[ci]
    meta = (torch.float16, torch.bfloat16, torch.float32)[ci % 3]
    q, args = _case(fmt, case, dtype16=(torch.bfloat16, torch.float16)[ci % 2], meta=meta)
    B, hkv, g, d, ps = case[:5]
    why = decode_cuda.unsupported(args[0].fmt, args[1].fmt, hkv * g, args[4].dtype, q.dtype)
    assert why is None, why
    plan = DecodePlan(B, hkv * g, hkv, d, ps, args[2].shape[1], 320, device=DEVICE).update(B)
    ref = decode_attention_ref(q, *args, dtype=torch.float64)
    out32 = torch.full((B, hkv * g, d), float("nan"), device=DEVICE)
    decode_cuda.decode_attention_cuda(q, *args, plan=plan, out=out32)
    assert rel_err(out32, ref) < 2e-3
    out = decode_cuda.decode_attention_cuda(q, *args, plan=plan)
    assert out.dtype == torch.bfloat16 and rel_err(out, ref) < 6e-3
    again = torch.full_like(out32, float("nan"))
    decode_cuda.decode_attention_cuda(q, *args, plan=plan, out=again)
    assert torch.equal(again, out32)  # deterministic


@pytest.mark.parametrize("fmt", FORMATS, ids=fmt_id)
@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
def test_cuda_decode_in_cuda_graph_sees_new_lengths(fmt, pdl):
    """Captured once, replayed after the lengths change on the device (one sequence's few pairs: the
    register loop for 2-bit formats; four: the cp.async loop); the output is the reference's."""
    from oscarkv.kernels.decode_cuda import decode_attention_cuda

    for B, lens, lens16, new, new16 in ((1, [2900], [100], [1500], [300]),
                                        (4, [900, 1200, 64, 700], [10, 300, 0, 5], [512, 1199, 1, 64],
                                         [300, 0, 7, 1])):
        kb, lay, vb = fmt
        kp, vp, bt, ql, k16, v16, l16 = build_cache(B, 8, 4, 128, 64, lens, lens16, 320, key_layout=lay,
                                                    k_bits=kb, v_bits=vb, dtype16=torch.bfloat16)
        q = torch.randn(B, 32, 128, device=DEVICE, dtype=torch.bfloat16)
        plan = DecodePlan(B, 32, 8, 128, 64, bt.shape[1], 320, device=DEVICE).update(B)
        out = torch.empty(B, 32, 128, device=DEVICE, dtype=torch.float32)
        decode_attention_cuda(q, kp, vp, bt, ql, k16, v16, l16, plan=plan, out=out, pdl=pdl)  # build outside
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            decode_attention_cuda(q, kp, vp, bt, ql, k16, v16, l16, plan=plan, out=out, pdl=pdl)
        ql.copy_(torch.tensor(new, dtype=torch.int32))
        l16.copy_(torch.tensor(new16, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = decode_attention_ref(q, kp, vp, bt, ql, k16, v16, l16, dtype=torch.float64)
        assert rel_err(out, ref) < 2e-3, (B, pdl)


@pytest.mark.parametrize("fmt", FORMATS, ids=fmt_id)
@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
def test_triton_decode_every_format_gpu(fmt):
    from oscarkv.kernels.decode_triton import decode_attention_triton

    for case in (GPU_CASES[0], GPU_CASES[2], GPU_CASES[5]):
        q, args = _case(fmt, case)
        out = torch.full(q.shape, float("nan"), device=DEVICE)
        decode_attention_triton(q, *args, out=out)
        assert rel_err(out, decode_attention_ref(q, *args, dtype=torch.float64)) < 2e-3, case[:5]


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
def test_dispatch_picks_the_cuda_kernel_for_every_format(monkeypatch):
    """On CUDA "auto" runs the CUDA kernel for every format it serves, Triton for what it does not (GQA above
    8, float32 tiers), and raises for what no kernel serves; the reference only when asked."""
    from oscarkv.kernels import decode_cuda, decode_triton

    calls = []
    for mod, name in ((decode_cuda, "decode_attention_cuda"), (decode_triton, "decode_attention_triton")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _r=real, _n=name, **k: (calls.append(_n), _r(*a, **k))[1])
    for fmt in FORMATS:
        q, args = _case(fmt, (2, 2, 4, 64, 16, [40, 17], [3, 0], 8))
        calls.clear()
        dispatch.decode_attention(q, *args)
        assert calls == ["decode_attention_cuda"], fmt
        with dispatch.use_reference():
            calls.clear()
            dispatch.decode_attention(q, *args)
            assert calls == []
    q, args = _case(FORMATS[0], (2, 1, 12, 64, 16, [40, 17], [3, 0], 8))  # GQA 12 > 8
    calls.clear()
    dispatch.decode_attention(q, *args)
    assert calls == ["decode_attention_triton"]
    kp, vp, bt, ql, k16, v16, l16 = _case(FORMATS[0], (2, 2, 4, 64, 16, [40, 17], [3, 0], 8))[1]
    calls.clear()
    dispatch.decode_attention(q[:, :8], kp, vp, bt, ql, k16.float(), v16.float(), l16)  # float32 tiers
    assert calls == ["decode_attention_triton"]
    with pytest.raises(ValueError, match="CUDA decode kernel cannot serve"):
        dispatch.decode_attention(q[:, :8], kp, vp, bt, ql, k16.float(), v16.float(), l16, backend="cuda")


@pytest.mark.parametrize("ppsm", [1, 4, 16])
@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
def test_cuda_decode_split_counts(ppsm):
    """Few long splits and many short ones, 4-bit keys in channel pages and 2-bit values."""
    from oscarkv.kernels.decode_cuda import decode_attention_cuda

    q, args = _case((4, "channel", 2), (2, 8, 4, 128, 64, [20000, 7000], [320, 100], 320))
    plan = DecodePlan(2, 32, 8, 128, 64, args[2].shape[1], 320, device=DEVICE, programs_per_sm=ppsm,
                      min_pages_per_split=1).update(2)
    out = torch.full((2, 32, 128), float("nan"), device=DEVICE)
    decode_attention_cuda(q, *args, plan=plan, out=out)
    assert rel_err(out, decode_attention_ref(q, *args, dtype=torch.float64)) < 2e-3
