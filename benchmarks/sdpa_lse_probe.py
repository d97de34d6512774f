"""Premise probe of the cuDNN extend fold (session 16, H200): cuDNN SDPA with its log-sum-exp over GQA-folded
query rows, per prefix segment (32K/16K/8K), the causal chunk, the log-sum-exp base (natural, checked against
float32 math) and a torch merge, in bfloat16 and float16 (`float16` folded 32K: 1.654 vs bfloat16 1.592 ms).
Eager calls, cold L2, median (``bench_kernels.timeit(graph=False)``; `docs/results/sdpa_lse_probe_h200.json` was
measured at b61d1df with this script's own copy of that timer, three warm-up calls instead of one).

    python3 benchmarks/sdpa_lse_probe.py   # writes $OUT/probe_sdpa.json (or ./probe_sdpa.json)
"""
import json
import os
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kernels import timeit as _timeit  # noqa: E402

HQ, HKV, D, T, P = 32, 8, 128, 2048, 32768
G = HQ // HKV
dev = "cuda"
torch.manual_seed(0)


def timeit(fn, reps=20):
    return _timeit(fn, reps=reps, graph=False)


res = {"torch": torch.__version__, "cudnn": torch.backends.cudnn.version(), "gpu": torch.cuda.get_device_name()}
for dt in (torch.bfloat16, torch.float16):
    q = torch.randn(1, HQ, T, D, device=dev, dtype=dt)
    k = torch.randn(1, HKV, P + T, D, device=dev, dtype=dt)
    v = torch.randn_like(k)
    sd = torch.nn.functional.scaled_dot_product_attention
    def base():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return sd(q, k, v, enable_gqa=True)
    r = {"baseline_cudnn_gqa_ms": timeit(base)}
    qg = q.view(1, HKV, G, T, D).transpose(2, 3).reshape(1, HKV, T * G, D).contiguous()
    cud = torch.ops.aten._scaled_dot_product_cudnn_attention
    scale = D ** -0.5
    for seg in (32768, 16384, 8192):
        ks = [k[:, :, i:i + seg] for i in range(0, P, seg)]
        vs = [v[:, :, i:i + seg] for i in range(0, P, seg)]
        def run(ks=ks, vs=vs):
            return [cud(qg, a, b, None, True, 0.0, False, False, scale=scale)[:2] for a, b in zip(ks, vs)]
        try:
            r[f"folded_seg{seg}_ms"] = timeit(run)
        except Exception as e:
            r[f"folded_seg{seg}_err"] = repr(e)[:300]
    # contiguous segment copies (what a workspace would hand over)
    kc, vc = k[:, :, :16384].contiguous(), v[:, :, :16384].contiguous()
    try:
        r["folded_one16k_contig_ms"] = timeit(lambda: cud(qg, kc, vc, None, True, 0.0, False, False, scale=scale))
    except Exception as e:
        r["folded_one16k_contig_err"] = repr(e)[:300]
    # chunk causal, heads expanded
    kx = k[:, :, P:].repeat_interleave(G, 1)
    vx = v[:, :, P:].repeat_interleave(G, 1)
    try:
        r["chunk_causal_ms"] = timeit(lambda: cud(q, kx, vx, None, True, 0.0, True, False, scale=scale))
    except Exception as e:
        r["chunk_causal_err"] = repr(e)[:300]
    # lse base / shape check on the folded call against float32 math
    try:
        o, lse = cud(qg, kc, vc, None, True, 0.0, False, False, scale=scale)[:2]
        r["lse_shape"] = list(lse.shape); r["lse_dtype"] = str(lse.dtype); r["o_stride"] = list(o.stride())
        rows = qg[0, :, :64].float()
        s = torch.einsum("hmd,hnd->hmn", rows, kc[0].float()) * scale
        ref_lse = torch.logsumexp(s, -1)
        got = lse.reshape(1, HKV, T * G)[0, :, :64].float()
        r["lse_err_natural"] = (got - ref_lse).abs().max().item()
        r["lse_err_log2"] = (got - ref_lse / 0.6931471805599453).abs().max().item()
        ref_o = torch.einsum("hmn,hnd->hmd", torch.softmax(s, -1), vc[0].float())
        r["o_rel_err"] = ((o[0, :, :64].float() - ref_o).norm() / ref_o.norm()).item()
        # causal lse
        o2, l2 = cud(q, kx, vx, None, True, 0.0, True, False, scale=scale)[:2]
        s2 = torch.einsum("hmd,hnd->hmn", q[0, :, :64].float(), kx[0, :, :64].float()) * scale
        s2 = s2.masked_fill(~torch.ones(64, 64, dtype=torch.bool, device=dev).tril(), float("-inf"))
        r["causal_lse_err"] = (l2.reshape(1, HQ, T)[0, :, :64].float() - torch.logsumexp(s2, -1)).abs().max().item()
    except Exception as e:
        r["lse_check_err"] = repr(e)[:300]
    # merge cost: 3 partials of [Hq, T, d]
    os_ = torch.randn(3, HQ, T, D, device=dev, dtype=dt)
    ls = torch.randn(3, HQ, T, device=dev)
    out = torch.empty(T, HQ, D, device=dev, dtype=dt)
    def merge():
        m = torch.logsumexp(ls, 0)
        w = torch.exp(ls - m)
        out.copy_((os_.float() * w[..., None]).sum(0).transpose(0, 1))
    r["merge3_torch_ms"] = timeit(merge)
    # folding copies
    r["fold_q_ms"] = timeit(lambda: q.view(1, HKV, G, T, D).transpose(2, 3).reshape(1, HKV, T * G, D).contiguous())
    res[str(dt)] = r
    print(str(dt), json.dumps(r, indent=1), flush=True)
out = os.environ.get("OUT", ".")
json.dump(res, open(os.path.join(out, "probe_sdpa.json"), "w"), indent=1)
