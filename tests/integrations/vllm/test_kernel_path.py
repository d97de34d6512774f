"""The backend's calls into the Triton kernels (the path it takes on CUDA): shapes, strides, dtypes and contiguity
the launchers accept, and the same outputs as the reference path. On a CPU the kernels run in Triton's
interpreter (the root conftest sets it before any kernel import); tiny shapes keep it to a few seconds."""

import pytest
import torch

import oscarkv.integrations.vllm.core as core

from vllm_sim import NO_WINDOWS, WINDOWS, Sim  # noqa: E402  (pytest puts this folder on sys.path)


@pytest.mark.interpret
def test_backend_kernel_calls_match_reference_path(monkeypatch):
    pytest.importorskip("triton")
    from oscarkv.kernels.decode_triton import decode_attention_triton
    from oscarkv.kernels.extend_triton import extend_attention_triton
    from oscarkv.kernels.quantize_triton import quantize_write_triton
    from oscarkv.kernels.rotate_triton import rotate_rows_triton

    calls = {"decode": 0, "extend": 0, "rotate": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    triton_ops = (quantize_write_triton, counted("decode", decode_attention_triton),
                  counted("extend", extend_attention_triton), counted("rotate", rotate_rows_triton))
    ref_ops = core.ops()
    for tiers in (WINDOWS, NO_WINDOWS):
        sims = []
        for i in range(2):  # the kernel side re-plans one DecodePlan per step, as the metadata builder does
            s = Sim(tiers, H=2, g=2, d=64, block=16, nb=16, plan=i == 1)
            s.p.dtype16 = torch.float32  # the interpreter's dots are only reliable in float32
            if s.pools is not None:
                s.pools = tuple(torch.zeros_like(p, dtype=torch.float32) for p in s.pools)
            sims.append(s)
        steps = [[("a", 37)], [("a", 1), ("b", 20)], [("a", 1), ("b", 1)], [("a", 1), ("b", 1)], [("b", 1), ("a", 9)]]
        for batch in steps:
            monkeypatch.setattr(core, "ops", lambda: ref_ops)
            want, _ = sims[0].step(batch)
            monkeypatch.setattr(core, "ops", lambda: triton_ops)
            got, _ = sims[1].step(batch)
            # the kernels' error budget (docs/kernels.md): relative Frobenius error, 2e-3 for 16-bit-operand extend
            err = ((got - want).norm() / want.norm()).item()
            assert err < 2e-3, (tiers, batch, err)
    assert calls["decode"] >= 3 and calls["extend"] >= 6 and calls["rotate"] >= 8, calls
