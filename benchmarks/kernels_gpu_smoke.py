"""Small GPU smoke run of every Triton/CUDA kernel op against the float64 reference (meant to run under
``compute-sanitizer``, so shapes stay small). Prints one line per op; exits non-zero on a mismatch."""

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "kernels"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from kernel_helpers import build_cache, rel_err  # noqa: E402

from oscarkv.kernels.plan import DecodePlan  # noqa: E402
from oscarkv.kernels.reference import decode_attention_ref, extend_attention_ref  # noqa: E402


def main() -> int:
    torch.manual_seed(0)
    dev = "cuda"
    ok = True
    B, hkv, g, d = 2, 2, 4, 128
    kp, vp, bt, ql, k16, v16, l16 = build_cache(B, hkv, g, d, 64, [200, 70], [9, 3], 64, dtype16=torch.bfloat16,
                                                device=dev)
    T = 70
    q = torch.randn(B, T, hkv * g, d, device=dev, dtype=torch.bfloat16)
    kn, vn = torch.randn(B, T, hkv, d, device=dev, dtype=torch.bfloat16), torch.randn(B, T, hkv, d, device=dev,
                                                                                     dtype=torch.bfloat16)
    from oscarkv.kernels.extend_triton import extend_attention_triton

    out = extend_attention_triton(q, kn, vn, kp, vp, bt, ql, k16, v16, l16)
    torch.cuda.synchronize()
    e = rel_err(out, extend_attention_ref(q, kn, vn, kp, vp, bt, ql, k16, v16, l16, dtype=torch.float64))
    print(f"extend triton rel err {e:.2e}", flush=True)
    ok &= e < 1e-2
    qd = torch.randn(B, hkv * g, d, device=dev, dtype=torch.bfloat16)
    ref = decode_attention_ref(qd, kp, vp, bt, ql, k16, v16, l16, dtype=torch.float64)
    plan = DecodePlan(B, hkv * g, hkv, d, 64, bt.shape[1], 64, device=dev).update(B)
    from oscarkv.kernels.decode_cuda import decode_attention_cuda
    from oscarkv.kernels.decode_triton import decode_attention_triton

    for name, fn in (("triton", decode_attention_triton), ("cuda", decode_attention_cuda)):
        o = torch.full((B, hkv * g, d), float("nan"), device=dev)
        fn(qd, kp, vp, bt, ql, k16, v16, l16, plan=plan, out=o)
        torch.cuda.synchronize()
        e = rel_err(o, ref)
        print(f"decode {name} rel err {e:.2e}", flush=True)
        ok &= e < 1e-3
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
