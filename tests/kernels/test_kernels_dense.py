"""The decoder's dense ops (RMSNorm, SiLU gate, fused QK preparation, paged 16-bit decode, decode GEMV, embedding
and RoPE tables) against their PyTorch references: the Triton kernels in the CPU interpreter (float32, tiny
shapes), and on a GPU with and without programmatic dependent launch. The interpreter stores bfloat16 as raw bits
and truncates float32 -> bfloat16, so bfloat16 numerics are checked on the GPU."""

import pytest
import torch

from oscarkv.kernels import reference as R

GPU = torch.cuda.is_available()
DEV = "cuda"
BF = torch.bfloat16


@pytest.mark.interpret
@pytest.mark.skipif(GPU, reason="the interpreter stage")
def test_dense_ops_match_reference_in_interpreter():
    from oscarkv.kernels import dense_triton

    N, hq, hkv, d = 3, 4, 2, 16
    x, r, w = torch.randn(N, 32), torch.randn(N, 32), torch.randn(32)
    y, h = dense_triton.rmsnorm(x, w, 1e-6, r)
    torch.testing.assert_close(h, x + r)
    torch.testing.assert_close(y, R.rmsnorm_ref(x + r, w, 1e-6))
    gu = torch.randn(N, 40)
    torch.testing.assert_close(dense_triton.silu_mul(gu), torch.nn.functional.silu(gu[:, :20]) * gu[:, 20:])
    qkv = torch.randn(N, (hq + 2 * hkv) * d)
    ang = torch.rand(N, d // 2)
    ang = torch.cat([ang, ang], -1)
    cos, sin = ang.cos(), ang.sin()
    qn, kn = torch.rand(d) + 0.5, torch.rand(d) + 0.5
    rk = torch.linalg.qr(torch.randn(hkv, d, d))[0]
    mu = torch.randn(hkv, d)
    for args in ((None, None, None, None), (qn, kn, rk, mu)):
        a = dense_triton.qk_prep(qkv, hq, hkv, d, cos, sin, args[0], args[1], 1e-6, args[2], args[3])
        b = R.qk_prep_ref(qkv, hq, hkv, d, cos, sin, args[0], args[1], 1e-6, args[2], args[3])
        torch.testing.assert_close(a[0], b[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a[1], b[1], atol=1e-5, rtol=1e-5)
    B, P, pages = 3, 16, 9
    kv = torch.randn(2, pages, hkv, P, d)
    bt = torch.tensor([[1, 2, 3, 0], [4, 5, 0, 0], [0, 0, 0, 0]], dtype=torch.int32)
    lens = torch.tensor([40, 17, 0], dtype=torch.int32)
    q = torch.randn(B, hq, d)
    got = dense_triton.paged_decode(q, kv, bt, lens, 0.25, max_len=64)
    torch.testing.assert_close(got, R.paged_decode_ref(q, kv, bt, lens, 0.25), atol=1e-4, rtol=1e-4)
    # a block table (and grid) made for 256 tokens: each sequence spreads its own pages over the splits
    wide = torch.cat([bt, torch.zeros(B, 12, dtype=torch.int32)], 1)
    got = dense_triton.paged_decode(q, kv, wide, lens, 0.25, max_len=256)
    torch.testing.assert_close(got, R.paged_decode_ref(q, kv, wide, lens, 0.25), atol=1e-4, rtol=1e-4)
    _, lse = next(w for k, w in dense_triton._WORK.items() if k[3] == 3)  # 3 splits of up to 6 pages
    assert bool((lse.view(B, hq, 3)[0] > -1e29).all())  # 3 pages of sequence 0: one per split, none idle


@pytest.mark.interpret
@pytest.mark.skipif(GPU, reason="the interpreter stage")
def test_gemv_matches_reference_in_interpreter():
    from oscarkv.kernels import gemv_triton
    from oscarkv.kernels.gemv_triton import GemvConfig

    cfgs = [GemvConfig("fma", 8, 32, 4, 1), GemvConfig("fma", 4, 64, 4, 2), GemvConfig("dot", 16, 32, 4, 2),
            GemvConfig("fma", 8, 16, 4, 1, split_k=3), GemvConfig("fma", 16, 32, 4, 1, split_k=2),
            GemvConfig("dot", 16, 16, 4, 2, split_k=4)]  # split-K: ragged slices (K=72: 5 tiles of 16 in 3)
    for dt, M, N, K in ((torch.float32, 1, 48, 64), (torch.float32, 3, 40, 72), (torch.float32, 8, 48, 64),
                        (torch.float16, 2, 40, 72)):  # even and ragged tiles
        w = (torch.randn(N, K) / K ** 0.5).to(dt)
        b, nw = torch.randn(N).to(dt), (torch.rand(K) + 0.5).to(dt)
        x, gu, res = torch.randn(M, K).to(dt), torch.randn(M, 2 * K).to(dt), torch.randn(M, N).to(dt)
        cases = ((x, {}), (x, {"b": b, "residual": res}), (x, {"norm": nw, "eps": 1e-6}),
                 (gu, {"act": "silu", "residual": res}))
        for cfg in cfgs + [None]:
            for xin, kw in cases:
                got = gemv_triton.gemv(xin, w, config=cfg, **kw)
                fkw = {k: v.float() if torch.is_tensor(v) else v for k, v in kw.items()}
                ref = R.gemv_ref(xin.float(), w.float(), **fkw)
                tol = 1e-5 if dt == torch.float32 else 2e-2
                torch.testing.assert_close(got.float(), ref, atol=tol, rtol=tol,
                                           msg=f"{dt} {M}x{N}x{K} {cfg} {list(kw)}")
                # again (split-K: the tickets were reset), and as float32 output (the same rounded values)
                again = gemv_triton.gemv(xin, w, config=cfg, out_dtype=torch.float32, **kw)
                assert again.dtype == torch.float32 and torch.equal(again, got.float()), (dt, M, N, K, cfg, list(kw))
    assert all(not c.any() for k, c in gemv_triton._SPLIT_WORK.items() if c.dtype == torch.int32)  # tickets back to 0
    for bad in ({"act": "gelu"}, {"norm": torch.ones(64), "act": "silu"}):
        with pytest.raises(ValueError):
            gemv_triton.gemv(torch.randn(1, 64), torch.randn(8, 64), **bad)


def test_launch_turns_pdl_into_constexpr_and_launch_option():
    pytest.importorskip("triton")
    from oscarkv.kernels import dense_triton

    calls = []

    class Kernel:  # stands for a JITFunction: kernel[grid](*args, **kwargs)
        def __getitem__(self, grid):
            return lambda *a, **kw: calls.append((grid, a, kw))

    dense_triton._launch(Kernel(), (3, 1), 1, 2, pdl=True, num_warps=4, BLOCK=8)
    dense_triton._launch(Kernel(), (3,), 1, pdl=False, num_warps=4)
    (g1, a1, kw1), (g2, _, kw2) = calls
    assert g1 == (3, 1) and a1 == (1, 2) and kw1 == {"PDL": True, "launch_pdl": True, "num_warps": 4, "BLOCK": 8}
    assert g2 == (3,) and kw2 == {"PDL": False, "num_warps": 4}  # no launch_pdl key: old Tritons lack the option
    assert not dense_triton.pdl_available(torch.zeros(1))


def test_dispatch_runs_the_reference_on_cpu():
    """On CPU tensors every dense op is the reference (bit for bit)."""
    from oscarkv.kernels import dispatch

    x, r, w = torch.randn(3, 32), torch.randn(3, 32), torch.randn(32)
    y, h = dispatch.rmsnorm(x, w, 1e-6, r)
    assert torch.equal(h, x + r) and torch.equal(y, R.rmsnorm_ref(x + r, w, 1e-6))
    wt = torch.randn(8, 32)
    assert torch.equal(dispatch.gemv(x, wt, norm=w), R.gemv_ref(x, wt, norm=w))
    assert not dispatch.uses_kernels(x) and not dispatch.pdl_available(x)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
def test_pdl_kernels_equal_plain_launches_gpu():
    """Each op with pdl=True (programmatic launches on the stream, eager) is bit-equal to pdl=False."""
    from oscarkv.kernels import dense_triton as T
    from oscarkv.kernels import gemv_triton
    from oscarkv.kernels.gemv_triton import GemvConfig

    assert T.pdl_available(torch.zeros(1, device=DEV)), "PDL should be available on an sm_90 GPU"
    torch.manual_seed(0)
    bf = BF
    x, r = torch.randn(1, 4096, device=DEV, dtype=bf), torch.randn(1, 4096, device=DEV, dtype=bf)
    nw = (torch.rand(4096, device=DEV) + 0.5).to(bf)
    a = [T.rmsnorm(x, nw, 1e-6, r, pdl=p) for p in (False, True)]
    assert all(torch.equal(u, v) for u, v in zip(*a))
    gu = torch.randn(1, 2 * 12288, device=DEV, dtype=bf)
    assert torch.equal(T.silu_mul(gu, pdl=False), T.silu_mul(gu, pdl=True))
    # the decode projections of Qwen3-8B (and a ragged lm_head slice) at one row, as the model fuses them, with
    # the default config; other configs (split-K, narrow tiles, tensor cores) on one shape
    extra = (GemvConfig("fma", 8, 1024, 4, 1), GemvConfig("dot", 16, 256, 4, 4))  # split-K: test_split_k_gemv_gpu
    for N, K, fusion in ((6144, 4096, "norm"), (4096, 4096, "residual"), (24576, 4096, "norm"),
                         (4096, 12288, "silu"), (151936 // 8 + 8, 4096, "norm")):
        w = torch.randn(N, K, device=DEV).mul_(0.02).to(bf)
        b = torch.randn(N, device=DEV).to(bf)
        res = torch.randn(1, N, device=DEV).to(bf)
        xin = torch.randn(1, K, device=DEV).to(bf)
        nwk = (torch.rand(K, device=DEV) + 0.5).to(bf)
        xi, kw = {"norm": (xin, {"norm": nwk}), "residual": (xin, {"b": b, "residual": res}),
                  "silu": (torch.randn(1, 2 * K, device=DEV).to(bf), {"act": "silu", "residual": res})}[fusion]
        for cfg in (None,) + (extra if (N, K) == (4096, 4096) else ()):
            plain = gemv_triton.gemv(xi, w, config=cfg, **kw)
            fast = gemv_triton.gemv(xi, w, config=cfg, pdl=True, **kw)
            assert torch.equal(plain, fast), (N, K, fusion, cfg)
        if fusion == "norm":
            logits = gemv_triton.gemv(xin, w, norm=nwk, out_dtype=torch.float32, pdl=True)
            assert logits.dtype == torch.float32 and torch.equal(logits, gemv_triton.gemv(xin, w, norm=nwk).float())
    # QK-prep into a pool, the paged BF16 decode (split + merge)
    hq, hkv, d = 32, 8, 128
    qkv = torch.randn(1, (hq + 2 * hkv) * d, device=DEV, dtype=bf)
    ang = torch.rand(1, d // 2, device=DEV) * 100
    cos, sin = (f(torch.cat([ang, ang], -1)).to(bf) for f in (torch.cos, torch.sin))
    qn = (torch.rand(d, device=DEV) + 0.5).to(bf)
    outs = [T.qk_prep(qkv, hq, hkv, d, cos, sin, qn, qn, 1e-6, pdl=p) for p in (False, True)]
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    kvp = torch.randn(2, 40, hkv, 64, d, device=DEV, dtype=bf)
    bt = torch.randperm(39, device=DEV)[:32].add(1).int()[None]
    lens = torch.tensor([1900], dtype=torch.int32, device=DEV)
    q = outs[0][0]
    o = [T.paged_decode(q, kvp, bt, lens, d ** -0.5, max_len=2048, pdl=p) for p in (False, True)]
    assert torch.equal(o[0], o[1])
    # the fused prologue: embedding rows exact, cos/sin as torch computes them (libdevice cosf / sinf)
    emb = torch.randn(1000, 4096, device=DEV, dtype=bf)
    toks = torch.tensor([5, 999, 0, 17], device=DEV)
    pos = torch.tensor([0, 1, 40000, 131071], device=DEV)
    f = 1.0 / (1e6 ** (torch.arange(0, d, 2, dtype=torch.float32, device=DEV) / d))
    f2 = torch.cat([f, f])
    for scale in (1.0, 0.7):
        got = T.embed_rope(toks, pos, emb, f2, scale, pdl=True)
        ref = R.embed_rope_ref(toks, pos, emb, f2, scale)
        assert torch.equal(got[0], ref[0])
        for u, v in zip(got[1:], ref[1:]):
            ulp = (u.float() - v.float()).abs().max().item()
            assert ulp <= 2 ** -7, ulp  # one bf16 ulp at |x| <= 1 at most (equal when cosf matches torch's)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
def test_split_k_gemv_gpu():
    """Split-K at 8B shapes against float64-exact, deterministic, and tickets reset across CUDA-graph replays."""
    from oscarkv.kernels import gemv_triton
    from oscarkv.kernels.gemv_triton import GemvConfig

    g = torch.Generator(device=DEV).manual_seed(0)
    for N, K in ((6144, 4096), (4096, 4096), (4096, 12288)):
        w = torch.randn(N, K, device=DEV, generator=g).mul_(0.02).bfloat16()
        x = torch.randn(1, K, device=DEV, generator=g).bfloat16()
        res = torch.randn(1, N, device=DEV, generator=g).bfloat16()
        exact = R.gemv_ref(x.double(), w.double(), residual=res.double())
        base = (gemv_triton.gemv(x, w, residual=res).double() - exact).abs().max().item()
        for split in (3, 4):  # 3 on K = 4096: slices of 2, 2 and 0 tiles -> 2 slices
            for pdl in (False, True):
                cfg = GemvConfig("fma", 16, 1024, 4, 1, split_k=split)
                y = gemv_triton.gemv(x, w, residual=res, config=cfg, pdl=pdl)
                err = (y.double() - exact).abs().max().item()
                assert err <= 2 * base + 1e-2, (N, K, split, err, base)
                out = torch.empty_like(y)
                graph = torch.cuda.CUDAGraph()
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    gemv_triton.gemv(x, w, residual=res, config=cfg, pdl=pdl)
                torch.cuda.current_stream().wait_stream(s)
                with torch.cuda.graph(graph):
                    out.copy_(gemv_triton.gemv(x, w, residual=res, config=cfg, pdl=pdl))
                for _ in range(3):
                    out.zero_()
                    graph.replay()
                    torch.cuda.synchronize()
                    assert torch.equal(out, y), (N, K, split, pdl)
