"""Dispatch layer: the reference on CPU (identical results), the switch that forces it, argument checks, and
the import layering (no Triton, transformers or engine needed to import the kernels package)."""

import subprocess
import sys

import pytest
import torch
from kernel_helpers import DEVICE, build_cache

from oscarkv import kernels
from oscarkv.kernels import reference as ref
from oscarkv.kernels.dispatch import _pick


def test_cpu_ops_are_the_reference():
    args = build_cache(2, 2, 4, 64, 16, [20, 35], [3, 0], 4, device="cpu")
    q = torch.randn(2, 8, 64)
    out = kernels.decode_attention(q, *args)
    assert torch.equal(out, ref.decode_attention_ref(q, *args).to(q.dtype))
    qe, kn, vn = torch.randn(2, 5, 8, 64), torch.randn(2, 5, 2, 64), torch.randn(2, 5, 2, 64)
    out = kernels.extend_attention(qe, kn, vn, *args)
    assert torch.equal(out, ref.extend_attention_ref(qe, kn, vn, *args).to(qe.dtype))
    kp, vp = args[0], args[1]
    kr = kernels.QuantPages(kp.codes.clone(), kp.scale.clone(), kp.offset.clone(), kp.fmt)
    x = torch.randn(6, 2, 64)
    slots = torch.tensor([0, 5, -1, 7, 9, 11])
    kernels.quantize_write(kp, vp, x, x, slots, k_clip=0.9)
    ref.quantize_write_ref(kr, x, slots, clip_ratio=0.9)
    assert torch.equal(kp.codes, kr.codes)
    assert torch.equal(kp.scale.view(torch.int16), kr.scale.view(torch.int16))  # poisoned slots may hold NaN


def test_backend_selection():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert _pick("auto", cpu, True) == "reference"
    assert _pick("reference", cuda, True) == "reference"
    with pytest.raises(ValueError, match="backend must be"):
        _pick("fast", cpu, True)
    with pytest.raises(ValueError, match="backend must be"):
        _pick("cuda", cuda, True)  # only decode has a CUDA C++ kernel
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        _pick("triton", cpu, True)
    assert _pick("auto", cuda, False) == "reference"  # a format the kernels do not handle
    with kernels.use_reference():
        assert _pick("auto", cuda, True) == "reference"
    if DEVICE.type == "cuda":
        assert _pick("auto", cuda, True) == "triton"


def test_cuda_backend_routing_by_dtype(monkeypatch, tmp_path):
    """"auto" picks the CUDA C++ decode kernel only for what it runs (float16/bfloat16 16-bit tiers,
    float32/16 queries, token pages); float32 tiers go to Triton, and an explicit backend="cuda" with them
    raises a ValueError that names the way out. Availability is monkeypatched (no GPU or nvcc needed)."""
    from oscarkv.kernels import decode_cuda, dispatch
    from oscarkv.kernels.layout import PageFormat

    monkeypatch.setattr(dispatch, "triton_available", lambda: True)
    monkeypatch.setattr(decode_cuda, "nvcc", lambda: "/usr/local/cuda/bin/nvcc")
    cuda = torch.device("cuda")
    fmt = PageFormat(num_kv_heads=2, head_dim=128, page_size=64)
    chan = PageFormat(num_kv_heads=2, head_dim=128, page_size=64, layout="channel")
    assert decode_cuda.supported(fmt) and decode_cuda.supported(fmt, torch.bfloat16, torch.float32)
    assert not decode_cuda.supported(fmt, torch.float32) and not decode_cuda.supported(fmt, None, torch.float64)
    assert not decode_cuda.supported(chan, torch.bfloat16, torch.bfloat16)

    def pick(backend, dt16, qdt, f=fmt):
        return _pick(backend, cuda, True, cuda_fmt=f, dtype16=dt16, q_dtype=qdt)

    for dt16 in (torch.float16, torch.bfloat16):
        for qdt in (torch.float32, torch.float16, torch.bfloat16):
            assert pick("auto", dt16, qdt) == "cuda"
            assert pick("cuda", dt16, qdt) == "cuda"
    assert pick("auto", torch.float32, torch.float32) == "triton"
    assert pick("auto", torch.float32, torch.bfloat16) == "triton"
    assert pick("auto", torch.bfloat16, torch.float64) == "triton"
    assert pick("auto", torch.bfloat16, torch.bfloat16, chan) == "triton"
    assert pick("triton", torch.float32, torch.float32) == "triton"
    with pytest.raises(ValueError, match=r"float16/bfloat16 16-bit tiers.*torch.float32 tiers.*backend='triton'"):
        pick("cuda", torch.float32, torch.float32)
    with pytest.raises(ValueError, match="channel pages"):
        pick("cuda", torch.bfloat16, torch.bfloat16, chan)
    with kernels.use_reference():
        assert pick("auto", torch.bfloat16, torch.bfloat16) == "reference"
    # without nvcc and without prebuilt cubins "auto" never picks the CUDA kernel
    monkeypatch.setattr(decode_cuda, "nvcc", lambda: None)
    monkeypatch.setattr(decode_cuda, "_cache_dir", lambda: tmp_path)
    assert pick("auto", torch.bfloat16, torch.bfloat16) == "triton"


def test_import_layering():
    """kernels imports without triton and never pulls in transformers or the engine."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, oscarkv.kernels as k\n"
        "from oscarkv.kernels import dispatch, plan, layout, reference\n"
        "bad = [m for m in sys.modules if m.startswith(('transformers', 'oscarkv.engine', 'oscarkv.hf'))]\n"
        "assert not bad, bad\n"
        "print('ok')\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr


def test_cuda_decode_variant_resolution(monkeypatch):
    """The measured variants are the default; the environment overrides it; "none" and "" select the plain loop;
    the cubin cache key tells them apart; an unknown name is an error that lists the choices."""
    from oscarkv.kernels import decode_cuda as dc

    monkeypatch.delenv(dc.VARIANT_ENV, raising=False)
    key = lambda v: dict(dc.config_key(128, 4, 64, torch.bfloat16, torch.bfloat16, torch.float16, 1, variant=v))  # noqa: E731
    assert dc.DEFAULT_VARIANT == "subn+lazy+cpa" and dc.DEFAULT_VARIANT_FEW == "subn+lazy+l2pf"
    assert {k: key(None)[k] for k in ("SUBN_", "LAZY_", "L2PF_", "CPA_")} == {"SUBN_": 1, "LAZY_": 1, "L2PF_": 0,
                                                                               "CPA_": 2}
    assert dc._resolve_variant(None, 8) == "subn+lazy+l2pf" and dc._resolve_variant(None, 16) == "subn+lazy+cpa"
    assert key("none") == key("") and key("none")["SUBN_"] == 0 and key("lazy")["LAZY_"] == 1
    monkeypatch.setenv(dc.VARIANT_ENV, "subn")
    assert key(None) == key("subn") != key("subn+lazy+l2pf")
    with pytest.raises(ValueError, match="unknown CUDA decode variant"):
        key("fast")
    assert key("subn+lazy+l2pf+early")["EARLY_"] == 1 and key("subn+lazy+l2pf")["EARLY_"] == 0
    with pytest.raises(ValueError, match="'early' needs 'l2pf'"):
        key("subn+early")
