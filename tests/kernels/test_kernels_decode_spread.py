"""A decode plan made for a longer bound than the batch holds (a CUDA graph plans for the block table's capacity):
each sequence's 2-bit tier is cut into the plan's ``num_qsplits`` ranges of its own length
(``DecodePlan.split_tokens``), so a short sequence still uses every split. Host arithmetic, the Triton kernel
(CPU interpreter / GPU) and the CUDA kernel (GPU)."""

import math

import pytest
import torch
from kernel_helpers import DEVICE, build_cache, rel_err

from oscarkv.kernels.decode_triton import decode_attention_triton
from oscarkv.kernels.plan import DecodePlan
from oscarkv.kernels.reference import decode_attention_ref

GPU = DEVICE.type == "cuda"
pytestmark = pytest.mark.interpret if not GPU else []  # the CPU interpreter runs these: CI's slow tier


@pytest.mark.parametrize("geo", [
    # (max_batch, Hkv, page, block_n, capacity pages, num_sms, min_pages_per_split)
    (1, 8, 64, None, 2049, 132, 4), (8, 8, 64, None, 2049, 132, 4), (3, 2, 16, 32, 300, 4, 4),
    (64, 8, 64, None, 512, 132, 4), (2, 1, 16, 16, 7, 4, 1), (1, 8, 64, 128, 1601, 132, 4),
])
def test_split_tokens_cover_every_length(geo):
    mb, hkv, ps, bn, cap, sms, minp = geo
    for batch in sorted({1, mb}):
        plan = DecodePlan(mb, hkv * 4, hkv, 128, ps, cap, 320, block_n=bn, num_sms=sms,
                          min_pages_per_split=minp).update(batch)
        gran, least = plan.split_granule
        bound = plan.pages_per_split * ps
        assert plan.split_tokens(cap * ps) <= bound
        prev = 0
        for n in sorted({0, 1, ps - 1, ps, ps + 1, 1000, 4096, 32768, 102400, cap * ps - 5, cap * ps}):
            if n > cap * ps:
                continue
            t = plan.split_tokens(n)
            assert t % (gran * ps) == 0 or t == bound, (n, t)  # whole granules (or the plan's own split)
            assert t >= min(least * ps, bound) and t <= bound
            assert plan.num_qsplits * t >= n  # every token in some split
            assert t >= prev  # longer sequences never get shorter splits
            prev = t
            # as short as the granule and the least split allow: one granule less would not cover the sequence
            if t > least * ps and t < bound:
                assert (t - gran * ps) * plan.num_qsplits < math.ceil(n / ps) * ps, (n, t)


def test_capacity_plan_spreads_a_short_sequence():
    """The 128K-capacity plan of one sequence (one wave: 57 splits of 36 pages per KV head): a 32K tier used 15 of
    them, each warp walking 9 pages; now 43 splits of 12 pages, 3 per warp (the fewest: 507 pages over 57
    splits is 9 pages, 3 for the slowest of 4 warps either way)."""
    plan = DecodePlan(1, 32, 8, 128, 64, 2049, 321, num_sms=132).update(1)
    n = 32768 - 320
    assert (plan.num_qsplits, plan.pages_per_split) == (57, 36)
    assert math.ceil(n / (plan.pages_per_split * 64)) == 15  # the plan's own split length
    t = plan.split_tokens(n)
    assert t == 12 * 64 and math.ceil(n / t) == 43


def _wide_cache(B, hkv, g, d, ps, lens, lens16, c16, extra_cols, **kw):
    """``build_cache`` with ``extra_cols`` more block-table columns (pointing at a poisoned spare page)."""
    kp, vp, bt, ql, k16, v16, l16 = build_cache(B, hkv, g, d, ps, lens, lens16, c16, **kw)
    pad = torch.full((B, extra_cols), kp.codes.shape[0] - 1, dtype=bt.dtype, device=bt.device)
    return kp, vp, torch.cat([bt, pad], 1).contiguous(), ql, k16, v16, l16


def _check_spread(plan, lse, lens, hkv, g):
    """Split s of sequence b is non-empty (finite log-sum-exp) iff it starts before the sequence's end."""
    for b, n in enumerate(lens):
        t = plan.split_tokens(n)
        for s in range(plan.num_qsplits):
            finite = bool(torch.isfinite(lse[b, :hkv * g, s]).all())
            assert finite == (s * t < n), (b, n, s, t)


CPU_CASE = (2, 2, 2, 64, 16, [150, 37], [3, 0], 8, 40)  # capacity 40 pages more than the longest sequence
GPU_CASES = [(1, 8, 4, 128, 64, [32768 - 320], [320], 320, 1536),  # a 32K tier under a 128K plan
             (3, 8, 4, 128, 64, [9000, 700, 0], [320, 5, 0], 320, 400)]


@pytest.mark.parametrize("case", GPU_CASES if GPU else [CPU_CASE])
def test_triton_decode_spreads_short_sequences(case):
    B, hkv, g, d, ps, lens, lens16, c16, extra = case
    args = _wide_cache(B, hkv, g, d, ps, lens, lens16, c16, extra)
    q = torch.randn(B, hkv * g, d, device=DEVICE, dtype=torch.bfloat16)
    kw = {} if GPU else {"num_sms": 4, "min_pages_per_split": 1}
    plan = DecodePlan(B, hkv * g, hkv, d, ps, args[2].shape[1], c16, device=DEVICE, **kw).update(B)
    assert plan.split_tokens(max(lens)) < plan.pages_per_split * ps  # the case exercises the spread
    out = torch.full((B, hkv * g, d), float("nan"), device=DEVICE)
    decode_attention_triton(q, *args, plan=plan, out=out)
    assert rel_err(out, decode_attention_ref(q, *args, dtype=torch.float64)) < 1e-3
    _check_spread(plan, plan.lse_part, lens, hkv, g)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("fmt", [(2, "token", 2), (4, "channel", 2)], ids=["token2", "channel4-token2"])
@pytest.mark.parametrize("case", GPU_CASES)
def test_cuda_decode_spreads_short_sequences(case, fmt):
    from oscarkv.kernels.decode_cuda import decode_attention_cuda

    B, hkv, g, d, ps, lens, lens16, c16, extra = case
    kb, lay, vb = fmt
    args = _wide_cache(B, hkv, g, d, ps, lens, lens16, c16, extra, k_bits=kb, key_layout=lay, v_bits=vb)
    q = torch.randn(B, hkv * g, d, device=DEVICE, dtype=torch.bfloat16)
    plan = DecodePlan(B, hkv * g, hkv, d, ps, args[2].shape[1], c16, device=DEVICE).update(B)
    out = torch.full((B, hkv * g, d), float("nan"), device=DEVICE)
    budget = 2e-3 if lay == "channel" else 1e-3  # channel keys: the scale folded into the float16 query
    for pdl in (False, True):
        decode_attention_cuda(q, *args, plan=plan, out=out, pdl=pdl)
        assert rel_err(out, decode_attention_ref(q, *args, dtype=torch.float64)) < budget
        _check_spread(plan, plan.lse_part, lens, hkv, g)
