"""The engine builds the CUDA decode kernel's cubins at start, for each (key, value) page format its layers use and the
dtypes queries arrive in, so that no request's step waits on a first-use nvcc build; a failure only warns."""

import logging
from types import SimpleNamespace

import torch

from oscarkv.engine.llm import _prebuild_decode
from oscarkv.kernels import decode_cuda
from oscarkv.kernels.layout import PageFormat


def _pool():
    token, other = PageFormat(8, 128, 64), PageFormat(8, 128, 64, meta_dtype=torch.bfloat16)
    v = PageFormat(8, 128, 64)
    return SimpleNamespace(k_pages=[SimpleNamespace(fmt=f) for f in (token, token, other)],
                           v_pages=[SimpleNamespace(fmt=v)] * 3, dtype16=torch.bfloat16, num_slots=48)


def test_prebuild_per_key_format_and_query_dtype(monkeypatch):
    seen = []
    monkeypatch.setattr(decode_cuda, "prebuild", lambda *a, **k: seen.append((a, k)) or ["x", "y"])
    pool = _pool()
    assert _prebuild_decode(pool, 32, torch.float32, pdl=True) == 8
    fmts, v = [p.fmt for p in pool.k_pages], pool.v_pages[0].fmt
    want = [((f, 32, q, torch.bfloat16, 48), {"v_fmt": v, "pdl": True}) for f in (fmts[0], fmts[2])
            for q in (torch.float32, torch.bfloat16)]
    assert seen == want
    seen.clear()
    assert _prebuild_decode(pool, 32, torch.bfloat16, pdl=False) == 4  # 16-bit model: one query dtype
    assert [a[2] for a, _ in seen] == [torch.bfloat16, torch.bfloat16]


def test_prebuild_failure_only_warns(monkeypatch, caplog):
    def fail(*a, **k):
        raise RuntimeError("nvcc failed (sm_90)")

    monkeypatch.setattr(decode_cuda, "prebuild", fail)
    with caplog.at_level(logging.WARNING, logger="oscarkv.engine.llm"):
        assert _prebuild_decode(_pool(), 32, torch.bfloat16, pdl=True) == 0
    assert "nvcc failed" in caplog.text and "first use" in caplog.text
