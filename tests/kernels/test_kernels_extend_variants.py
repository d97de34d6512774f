"""Extend-kernel variants of the prefill work (``pages_per_step``, ``fold="workspace"``, ``tma``) and the plain
Triton flash attention over a 16-bit prefix (:func:`extend_attention_dense`, the ceiling the probe compares
against), each against float64 attention.

Budgets as in ``test_kernels_attention.py`` (relative Frobenius norm): 2e-3 with float16 inputs, 1e-2 with
bfloat16 inputs. The workspace holds float16 ``o + c s`` rounded once, the values of ``fold="dequant"``: checked
bit for bit against the float32 reference dequantization rounded to float16, zeros past each sequence's end.
On a GPU the same tests run compiled, at larger shapes (the conftest sets ``TRITON_INTERPRET`` only without one).
"""

import pytest
import torch
from kernel_helpers import DEVICE, build_cache, rel_err, sharp_extend_case

from oscarkv.kernels.extend_dense import dequant_workspace, extend_attention_dense
from oscarkv.kernels.extend_triton import extend_attention_triton
from oscarkv.kernels.reference import extend_attention_ref, gather_dequant_ref

GPU = DEVICE.type == "cuda"
BUDGET = {torch.float16: 2e-3, torch.bfloat16: 1e-2}

# (B, Hkv, group, d, page, 2-bit lengths, 16-bit lengths, C16, chunk T, dtype): odd lengths, partial last pages,
# empty 2-bit and 16-bit tiers, GQA 1/4/6/8, d 64/128, a chunk longer than the tiles (unmasked causal tiles)
CASES = [(2, 2, 4, 64, 16, [37, 0], [5, 9], 20, 7, torch.float16),
         (2, 1, 6, 64, 16, [33, 16], [0, 3], 8, 5, torch.float16),
         (2, 2, 1, 128, 16, [17, 1], [4, 0], 8, 37, torch.bfloat16),
         (1, 1, 8, 128, 16, [50], [0], 4, 3, torch.bfloat16),
         (1, 2, 4, 64, 16, [70], [2], 4, 41, torch.float16)]
if GPU:  # few shapes (each variant compiles once per shape); the probe checks every variant at the real one
    CASES = [(2, 8, 4, 128, 64, [1500, 333], [100, 7], 320, 300, torch.bfloat16),
             (3, 4, 6, 64, 64, [64, 0, 999], [0, 1, 64], 64, 129, torch.float16)]

# the launcher default is pages_per_step=2 (token pages, fold="dequant"); block_m/num_warps in a variant apply on
# the GPU only (the CPU shapes use small blocks); num_stages is a no-op in the interpreter
VARIANTS = [{"pages_per_step": 1}, {"pages_per_step": 2}, {"pages_per_step": 4},
            {"pages_per_step": 4, "block_m": 128, "num_warps": 8}, {"pages_per_step": 2, "rescale": "lazy"},
            {"pages_per_step": 4, "rescale": "lazy"}, {"num_stages": 2}, {"num_stages": 3},
            {"fold": "workspace"}, {"fold": "workspace", "tma": True}]
if GPU:  # 2 and 1 pages a step at 128 rows / 8 warps (session 15 probe rows); on the CPU they would repeat the above
    VARIANTS += [{"pages_per_step": 2, "block_m": 128, "num_warps": 8},
                 {"pages_per_step": 2, "block_m": 128, "num_warps": 8, "num_stages": 3},
                 {"pages_per_step": 2, "block_m": 128, "num_warps": 8, "maxnreg": 240},
                 {"pages_per_step": 2, "block_m": 128, "num_warps": 8, "rescale": "lazy"},
                 {"pages_per_step": 1, "block_m": 128, "num_warps": 8, "num_stages": 2}]
_GEOMETRY = ("block_m", "num_warps")


def _blocks(g, variant):
    if GPU:
        base = {"block_m": 128, "num_warps": 8} if variant.get("fold") == "workspace" else {"block_m": 64,
                                                                                            "num_warps": 4}
        return {**base, **{k: variant[k] for k in _GEOMETRY if k in variant}}
    return {"block_m": 16 if g == 8 else 32, "block_n": 16}


def _kw(g, variant):
    """The launcher keywords of a variant at this device's block sizes."""
    return {**_blocks(g, variant), **{k: v for k, v in variant.items() if k not in _GEOMETRY}}


def _vid(v):
    return ",".join(f"{k}={val}" for k, val in v.items()) or "default"


def _inputs(case, key_layout="token"):
    B, hkv, g, d, ps, lens, lens16, c16, T, dt = case
    cache = build_cache(B, hkv, g, d, ps, lens, lens16, c16, dtype16=dt, key_layout=key_layout)
    q = torch.randn(B, T, hkv * g, d, device=DEVICE, dtype=dt)
    kn = torch.randn(B, T, hkv, d, device=DEVICE, dtype=dt)
    vn = torch.randn(B, T, hkv, d, device=DEVICE, dtype=dt)
    return q, kn, vn, cache


@pytest.mark.parametrize("variant", VARIANTS, ids=_vid)
@pytest.mark.parametrize("case", CASES)
def test_extend_new_variants_match_float64_reference(case, variant):
    q, kn, vn, (kp, vp, bt, ql, k16, v16, l16) = _inputs(case)
    out = torch.full_like(q, float("nan"))
    extend_attention_triton(q, kn, vn, kp, vp, bt, ql, k16, v16, l16, out=out, **_kw(case[2], variant))
    ref = extend_attention_ref(q, kn, vn, kp, vp, bt, ql, k16, v16, l16, dtype=torch.float64)
    assert rel_err(out, ref) < BUDGET[case[-1]]


@pytest.mark.parametrize("case", CASES[:3])
def test_extend_workspace_channel_keys(case):
    q, kn, vn, (kp, vp, bt, ql, k16, v16, l16) = _inputs(case, key_layout="channel")
    variant = {"fold": "workspace"}
    out = extend_attention_triton(q, kn, vn, kp, vp, bt, ql, k16, v16, l16, **_blocks(case[2], variant), **variant)
    ref = extend_attention_ref(q, kn, vn, kp, vp, bt, ql, k16, v16, l16, dtype=torch.float64)
    assert rel_err(out, ref) < BUDGET[case[-1]]


@pytest.mark.parametrize("key_layout", ["token", "channel"])
def test_dequant_workspace_is_the_rounded_dequantization(key_layout):
    B, hkv, d, ps, lens = 3, 2, 64, 16, [37, 0, 16]
    if GPU:
        B, hkv, d, ps, lens = 3, 8, 128, 64, [2113, 0, 64]
    kp, vp, bt, ql, *_ = build_cache(B, hkv, 1, d, ps, lens, [0] * B, 4, key_layout=key_layout)
    kw, vw = dequant_workspace(kp, vp, bt, ql, round_to=32)
    assert kw.dtype == vw.dtype == torch.float16 and kw.shape[2] % max(32, ps) == 0
    assert kw.shape[2] >= bt.shape[1] * ps
    for b, n in enumerate(lens):
        for pages, w in ((kp, kw), (vp, vw)):
            assert torch.equal(w[b, :, :n], gather_dequant_ref(pages, bt, b, n).half())
            assert not w[b, :, n:].any()


@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_dense_prefix_kernel_matches_float64_attention(case, tma):
    """The plain flash-attention kernel over a 16-bit prefix (the probe's ceiling; the workspace's second pass)."""
    B, hkv, g, d, ps, lens, lens16, c16, T, dt = case
    q, kn, vn, (_, _, _, _, k16, v16, l16) = _inputs(case)
    npad = max(64, -(-max(lens) // 64) * 64)
    kpre = torch.randn(B, hkv, npad, d, device=DEVICE, dtype=dt)
    vpre = torch.randn(B, hkv, npad, d, device=DEVICE, dtype=dt)
    lpre = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    blocks = {"block_m": 128, "num_warps": 8} if GPU else {"block_m": 16 if g == 8 else 32, "block_n": 16}
    out = extend_attention_dense(q, kn, vn, kpre, vpre, lpre, k16, v16, l16, tma=tma, **blocks)
    ref = torch.empty(q.shape, dtype=torch.float64, device=DEVICE)
    for b in range(B):
        n16, npre = int(l16[b]), lens[b]
        k = torch.cat([k16[b, :, :n16], kpre[b, :, :npre], kn[b].transpose(0, 1)], 1).double()
        v = torch.cat([v16[b, :, :n16], vpre[b, :, :npre], vn[b].transpose(0, 1)], 1).double()
        qb = q[b].double().view(T, hkv, g, d).permute(1, 2, 0, 3)
        s = torch.einsum("hgtd,hnd->hgtn", qb, k) * d**-0.5
        kpos = torch.arange(k.shape[1], device=DEVICE) - (n16 + npre)
        s.masked_fill_(kpos[None, :] > torch.arange(T, device=DEVICE)[:, None], float("-inf"))
        ref[b] = torch.einsum("hgtn,hnd->hgtd", torch.softmax(s, -1), v).permute(2, 0, 1, 3).reshape(T, hkv * g, d)
    assert rel_err(out, ref) < BUDGET[dt]


@pytest.mark.parametrize("variant", VARIANTS, ids=_vid)
def test_new_variants_sharp_attention_growing_scales(variant):
    """As test_kernels_attention's: the running max moves page after page, V scales 100x after the first page."""
    q, kn, vn, args, ref = sharp_extend_case()
    blocks = {"block_m": 64} if GPU else {"block_m": 16, "block_n": 16}
    kw = {**blocks, **{k: x for k, x in variant.items() if GPU or k not in _GEOMETRY}}
    assert rel_err(extend_attention_triton(q, kn, vn, *args, **kw), ref) < BUDGET[torch.float16]


@pytest.mark.parametrize("bad", [{"pages_per_step": 3}, {"pages_per_step": 2, "fold": "factor"},
                                 {"pages_per_step": 2, "fold": "workspace"}, {"fold": "dequantize"},
                                 {"tma": True, "fold": "factor"}, {"tma": True}, {"fold": "workspace", "block_n": 24}])
def test_new_variants_reject_bad_arguments(bad):
    kp, vp, bt, ql, k16, v16, l16 = build_cache(1, 1, 4, 64, 16, [20], [3], 4)
    q = torch.randn(1, 3, 4, 64, device=DEVICE).half()
    kn = torch.randn(1, 3, 1, 64, device=DEVICE).half()
    with pytest.raises(ValueError):
        extend_attention_triton(q, kn, kn, kp, vp, bt, ql, k16.half(), v16.half(), l16, **bad)


@pytest.mark.parametrize("bad", [{"pages_per_step": 2}, {"tma": True}])
def test_pages_per_step_rejects_channel_keys(bad):
    """pages_per_step > 1 is token-page only (and TMA is workspace-only); channel keys default to one page a step."""
    kp, vp, bt, ql, k16, v16, l16 = build_cache(1, 1, 4, 64, 16, [20], [3], 4, key_layout="channel")
    q = torch.randn(1, 3, 4, 64, device=DEVICE).half()
    kn = torch.randn(1, 3, 1, 64, device=DEVICE).half()
    with pytest.raises(ValueError):
        extend_attention_triton(q, kn, kn, kp, vp, bt, ql, k16.half(), v16.half(), l16, **bad)
