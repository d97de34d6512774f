"""Decode and extend attention kernels against float64 attention over the dequantized cache.

Error budget (relative Frobenius norm vs the float64 reference), decode: 1e-3 for a float32 output (queries
and p * s_v are rounded to float16, 16-bit tiles use tf32 on tensor cores; measured ~5e-4), 6e-3 for a
bfloat16 output (its own rounding, 2^-9, dominates). Extend: 2e-3 with float16 inputs, 1e-2 with bfloat16
inputs (P is rounded to bfloat16 for the 16-bit products, and the output to bfloat16; measured ~4e-3). Every
extend variant (launcher keywords: dequantized or factored tiles, unpack layout, lazy rescale, ...) is held to
the same budget (CPU shapes, 2 seeds: fp16 2.4e-4..4.9e-4, bf16 3.4e-3..4.2e-3).
"""

import struct

import numpy as np
import pytest
import torch
from kernel_helpers import DEVICE, build_cache, rel_err, sharp_extend_case

from oscarkv.kernels.decode_triton import decode_attention_triton
from oscarkv.kernels import extend_tiles
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


def test_extend_accepts_float32_queries():
    """float32 queries (the transformers cache's) are prescaled to float16 by the launcher; float32 output."""
    B, hkv, g, d, ps, lens, lens16, c16, T = 2, 2, 4, 64, 16, [37, 5], [5, 9], 20, 7
    kp, vp, bt, ql, k16, v16, l16 = build_cache(B, hkv, g, d, ps, lens, lens16, c16, dtype16=torch.float16)
    q = torch.randn(B, T, hkv * g, d, device=DEVICE) * 4
    kn, vn = (torch.randn(B, T, hkv, d, device=DEVICE, dtype=torch.float16) for _ in range(2))
    out = extend_attention_triton(q, kn, vn, kp, vp, bt, ql, k16, v16, l16, block_m=32 if not GPU else 64,
                                  block_n=16 if not GPU else 64)
    ref = extend_attention_ref(q, kn, vn, kp, vp, bt, ql, k16, v16, l16, dtype=torch.float64)
    assert out.dtype == torch.float32 and rel_err(out, ref) < BUDGET[torch.float16]


# the variants the benchmark probe (benchmarks/extend_probe.py) compares; the default is {} (2 pages a step)
EXT_VARIANTS = [
    {}, {"pages_per_step": 1}, {"unpack": "fields"}, {"unpack": "vcat"}, {"rescale": "lazy"}, {"fold": "factor"},
    {"fold": "factor", "unpack": "fields", "rescale": "lazy", "pmul": "f32", "qnative": False},
]
# odd lengths, partial pages, GQA 1/4/6/8, d 64/128/256, empty 2-bit and 16-bit tiers, float16 and bfloat16
EXT_VARIANT_CASES = [(2, 2, 4, 64, 16, [37, 0], [5, 9], 20, 7, torch.float16),
                     (2, 1, 6, 64, 16, [33, 16], [0, 3], 8, 5, torch.float16),
                     (2, 2, 1, 128, 16, [17, 1], [4, 0], 8, 9, torch.bfloat16),
                     (1, 1, 8, 256, 16, [50], [0], 4, 3, torch.float16)]
if GPU:  # one float16 case here (G 6, d 64, empty sequences); the probe checks every variant at the real shape
    EXT_VARIANT_CASES = EXT_CASES[1:2]


def _vid(v):
    return ",".join(f"{k}={val}" for k, val in v.items()) or "default"


@pytest.mark.parametrize("variant", EXT_VARIANTS, ids=_vid)
@pytest.mark.parametrize("case", EXT_VARIANT_CASES)
def test_extend_variants_match_float64_reference(case, variant):
    B, hkv, g, d, ps, lens, lens16, c16, T, dt = case
    kp, vp, bt, ql, k16, v16, l16 = build_cache(B, hkv, g, d, ps, lens, lens16, c16, dtype16=dt)
    q = torch.randn(B, T, hkv * g, d, device=DEVICE, dtype=dt)
    kn = torch.randn(B, T, hkv, d, device=DEVICE, dtype=dt)
    vn = torch.randn(B, T, hkv, d, device=DEVICE, dtype=dt)
    blocks = {"block_m": 64, "num_warps": 4} if GPU else {"block_m": 16 if g == 8 else 32, "block_n": 16}
    out = torch.full_like(q, float("nan"))
    extend_attention_triton(q, kn, vn, kp, vp, bt, ql, k16, v16, l16, out=out, **blocks, **variant)
    ref = extend_attention_ref(q, kn, vn, kp, vp, bt, ql, k16, v16, l16, dtype=torch.float64)
    assert rel_err(out, ref) < BUDGET[dt]


def test_extend_sharp_attention_growing_scales():
    """Keys growing along the prefix (the running max moves by far more than the lazy threshold, page after
    page), V scales 100x larger after the first page (P s_v / v_ref far from 1), sharp softmax: every variant
    stays within the float16 budget."""
    q, kn, vn, args, ref = sharp_extend_case()
    blocks = {"block_m": 64} if GPU else {"block_m": 16, "block_n": 16}
    errs = {_vid(v): rel_err(extend_attention_triton(q, kn, vn, *args, **blocks, **v), ref) for v in EXT_VARIANTS}
    assert max(errs.values()) < BUDGET[torch.float16], errs


@pytest.mark.parametrize("bad", [{"unpack": "interleave"}, {"fold": "none"}, {"rescale": "never"},
                                 {"pmul": "f8"}, {"block_m": 48}, {"block_n": 8}, {"num_stages": 0},
                                 {"dense_stages": 0}, {"maxnreg": -1}, {"block_m": 16, "num_warps": 4}])
def test_extend_rejects_bad_arguments(bad):
    g = 32 if "num_warps" in bad else 4  # a GQA group larger than block_m
    kp, vp, bt, ql, k16, v16, l16 = build_cache(1, 1, g, 64, 16, [20], [3], 4)
    q = torch.randn(1, 3, g, 64, device=DEVICE).half()
    kn = torch.randn(1, 3, 1, 64, device=DEVICE).half()
    with pytest.raises(ValueError):
        extend_attention_triton(q, kn, kn, kp, vp, bt, ql, k16.half(), v16.half(), l16, **bad)


def _f16(bits):
    return float(np.array([bits], dtype=np.uint16).view(np.float16)[0])


def _bf16(bits):
    return struct.unpack("<f", struct.pack("<I", bits << 16))[0]


def _to_f16_bits(x):
    return int(np.array([x], dtype=np.float16).view(np.uint16)[0])  # round to nearest even


def _to_bf16_bits(x):
    bits = struct.unpack("<I", struct.pack("<f", x))[0]
    assert bits & 0xFFFF == 0, x  # only exact values occur (bfloat16 codes are small integers)
    return bits >> 16


def _run_ptx(asm, inputs, bf16):
    """Emulate the unpacking PTX (prmt/mov/shr/lop3 0xea/fma.rn on 16-bit pairs) on the 32-bit inputs $8...;
    returns the 8 output registers as pairs of floats."""
    regs = {f"${8 + i}": v for i, v in enumerate(inputs)}
    dec, enc = (_bf16, _to_bf16_bits) if bf16 else (_f16, _to_f16_bits)
    val = lambda o: int(o, 16) if o.startswith("0x") else regs[o]  # noqa: E731
    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        o = [t.strip() for t in rest.split(",")]
        if op == "prmt.b32":
            src = [(val(o[1]) >> (8 * i)) & 0xFF for i in range(4)] + [0] * 4
            regs[o[0]] = sum(src[(int(o[3], 16) >> (4 * i)) & 0xF] << (8 * i) for i in range(4))
        elif op == "mov.b32":
            regs[o[0]] = val(o[1])
        elif op == "shr.b32":
            regs[o[0]] = val(o[1]) >> int(o[2])
        elif op == "lop3.b32":
            assert o[4] == "0xea"  # (a & b) | c
            regs[o[0]] = (val(o[1]) & val(o[2])) | val(o[3])
        elif op in ("fma.rn.f16x2", "fma.rn.bf16x2"):
            a, b, c = val(o[1]), val(o[2]), val(o[3])
            # float64 holds the exact a*b+c of 16-bit inputs; one rounding to the 16-bit format, like the fma
            halves = [enc(dec((a >> sh) & 0xFFFF) * dec((b >> sh) & 0xFFFF) + dec((c >> sh) & 0xFFFF))
                      for sh in (0, 16)]
            regs[o[0]] = halves[0] | halves[1] << 16
        else:
            raise AssertionError(f"unexpected PTX {op}")
    return [(dec(regs[f"${i}"] & 0xFFFF), dec(regs[f"${i}"] >> 16)) for i in range(8)]


def test_extend_unpack_asm_is_exact():
    """The inline PTX that unpacks (and dequantizes) code tiles on CUDA never runs in the interpreter: emulate
    it on every byte value at every byte position. Fields come back exact (float16 and bfloat16), and the
    dequantizing variant equals one float16 rounding of ``code * s + o``."""
    rng = np.random.default_rng(0)
    for bf16 in (False, True):
        asm = (extend_tiles._UNPACK_BF16 if bf16 else extend_tiles._UNPACK_F16).value
        for v in range(256):
            for pos in range(4):
                r = _run_ptx(asm, [v << (8 * pos)], bf16)
                got = [(r[2 * j] + r[2 * j + 1])[pos] for j in range(4)]
                assert got == [(v >> (2 * j)) & 3 for j in range(4)], (bf16, v, pos, got)
    asm = extend_tiles._DEQUANT_F16.value
    for v in range(256):
        s = rng.standard_normal(4).astype(np.float16) * np.float16(rng.choice([1e-3, 0.1, 10.0]))
        o = rng.standard_normal(4).astype(np.float16)
        bits = lambda x: [int(b) for b in x.view(np.uint16)]  # noqa: E731
        sb, ob = bits(s), bits(o)
        pos = v % 4
        r = _run_ptx(asm, [v << (8 * pos), sb[0] | sb[1] << 16, sb[2] | sb[3] << 16, ob[0] | ob[1] << 16,
                           ob[2] | ob[3] << 16], False)
        for j in range(4):
            got = (r[2 * j] + r[2 * j + 1])[pos]
            want = float(np.float16(((v >> (2 * j)) & 3) * float(s[pos]) + float(o[pos])))
            assert got == want, (v, pos, j, got, want)


def test_decode_rejects_unsupported_format():
    from oscarkv.kernels.layout import PageFormat, QuantPages

    fmt = PageFormat(num_kv_heads=1, head_dim=64, page_size=16, group_size=32)
    pages = QuantPages.allocate(fmt, 1, DEVICE)
    z = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="reference"):
        decode_attention_triton(torch.zeros(1, 4, 64, device=DEVICE), pages, pages, z[:, None], z,
                                torch.zeros(1, 1, 1, 64, device=DEVICE), torch.zeros(1, 1, 1, 64, device=DEVICE), z)
