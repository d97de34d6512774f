"""The per-head row rotation kernel (``rotate_rows``) against its float32 reference: grouped query heads, centering
before or the mean after, the transposed matrix, a second output scattered into ring rows, odd row counts."""

import pytest
import torch
from kernel_helpers import DEVICE

from oscarkv.kernels.reference import rotate_rows_ref
from oscarkv.kernels.rotate_triton import rotate_rows_triton
from oscarkv.rotation import random_orthogonal

pytestmark = pytest.mark.interpret if not torch.cuda.is_available() else []  # CPU interpreter: CI's slow tier


@pytest.mark.parametrize("n", [1, 5, 37])
@pytest.mark.parametrize("case", ["query", "key_ring", "output"])
def test_rotate_rows_matches_reference(n, case):
    g = torch.Generator().manual_seed(n)
    H, d = 2, 64
    group = {"query": 3, "key_ring": 1, "output": 3}[case]
    dt = torch.bfloat16 if case != "output" else torch.float32
    x = torch.randn(n, H * group, d, generator=g).to(dt).to(DEVICE)
    r = torch.stack([random_orthogonal(d, g) for _ in range(H)]).to(DEVICE)
    mu = None if case == "query" else (torch.randn(H, d, generator=g) * 0.5).to(DEVICE)
    kw = {"transpose": case == "output", "mean_after": case == "output"}
    out_dtype = torch.float16 if case == "output" else torch.bfloat16
    rows = torch.randperm(2 * n + 3, generator=g)[:n].to(DEVICE) if case == "key_ring" else None
    outs = []
    for fn in (rotate_rows_ref, rotate_rows_triton):
        out = torch.zeros(n, H * group, d, dtype=out_dtype, device=DEVICE)
        ring = None
        if rows is not None:  # distinct rows of a larger ring, untouched rows stay zero
            ring = torch.zeros(2 * n + 3, H, d, dtype=torch.bfloat16, device=DEVICE)
        fn(x, r, mu, out=out, rows_out=ring, rows=rows, **kw)
        outs.append((out, ring))
    (want, want_ring), (got, got_ring) = outs
    exact = rotate_rows_ref(x.double(), r.double(), None if mu is None else mu.double(),
                            out=torch.empty(n, H * group, d, dtype=torch.float64, device=DEVICE), **kw)
    # a float32 product rounded once to the output dtype: within one output ulp of the exact value
    mbits = {torch.bfloat16: 7, torch.float16: 10}[out_dtype]
    ulp = 2.0 ** (torch.floor(torch.log2(exact.abs().clamp_min(1e-30))) - mbits)
    for t in (want, got):
        assert ((t.double() - exact).abs() <= ulp + 1e-6).all()
    if want_ring is not None:
        torch.testing.assert_close(got_ring, want_ring, rtol=1e-2, atol=1e-2)
        assert got_ring.abs().sum(dim=(1, 2)).gt(0).sum() == n  # only the named rows were written


def test_rotate_rows_errors():
    x = torch.zeros(3, 4, 64, device=DEVICE)
    r = torch.zeros(3, 64, 64, device=DEVICE)
    with pytest.raises(ValueError, match="do not fit"):
        rotate_rows_triton(x, r, out=torch.zeros_like(x))
    with pytest.raises(ValueError, match="needs out"):
        rotate_rows_triton(x, r[:2])
