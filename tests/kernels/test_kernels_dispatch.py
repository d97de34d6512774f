"""Dispatch layer: the reference on CPU (identical results), the switch that forces it, the one rule that picks a
kernel (and raises where none serves a call on CUDA), and the import layering (no Triton, transformers or engine
needed to import the kernels package)."""

import importlib
import sys

import pytest
import torch
from kernel_helpers import build_cache

from oscarkv import kernels
from oscarkv.kernels import decode_cuda, dispatch
from oscarkv.kernels import reference as ref
from oscarkv.kernels.dispatch import _format_why_not, _pick
from oscarkv.kernels.layout import PageFormat

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_cpu_ops_are_the_reference():
    args = build_cache(2, 2, 4, 64, 16, [20, 35], [3, 0], 4, device="cpu", k_bits=4, key_layout="channel")
    q = torch.randn(2, 8, 64)
    out = kernels.decode_attention(q, *args)
    assert torch.equal(out, ref.decode_attention_ref(q, *args).to(q.dtype))
    qe, kn, vn = torch.randn(2, 5, 8, 64), torch.randn(2, 5, 2, 64), torch.randn(2, 5, 2, 64)
    out = kernels.extend_attention(qe, kn, vn, *args)
    assert torch.equal(out, ref.extend_attention_ref(qe, kn, vn, *args).to(qe.dtype))
    vp = args[1]
    vr = kernels.QuantPages(vp.codes.clone(), vp.scale.clone(), vp.offset.clone(), vp.fmt)
    kp = kernels.QuantPages.allocate(PageFormat(2, 64, 16, bits=4), vp.num_pages)
    x = torch.randn(6, 2, 64)
    slots = torch.tensor([0, 5, -1, 7, 9, 11])
    kernels.quantize_write(kp, vp, x, x, slots, k_clip=0.9)
    ref.quantize_write_ref(vr, x, slots)
    assert torch.equal(vp.codes, vr.codes)
    assert torch.equal(vp.scale.view(torch.int16), vr.scale.view(torch.int16))  # poisoned slots may hold NaN


def test_backend_selection(monkeypatch):
    monkeypatch.setattr(dispatch, "triton_available", lambda: True)
    assert _pick("auto", CPU, "op") == "reference"
    assert _pick("reference", CUDA, "op") == "reference"
    assert _pick("auto", CUDA, "op") == "triton"
    with pytest.raises(ValueError, match="backend must be"):
        _pick("fast", CPU, "op")
    with pytest.raises(ValueError, match="backend must be"):
        _pick("cuda", CUDA, "op")  # only decode has a CUDA C++ kernel
    with kernels.use_reference():
        assert _pick("auto", CUDA, "op") == "reference"
    # a call no kernel serves: an error on CUDA, never a silent fall back to the reference
    with pytest.raises(ValueError, match="no kernel serves.*page size 48.*backend='reference'"):
        _pick("auto", CUDA, "op", "page size 48")
    assert _pick("auto", CPU, "op", "page size 48") == "reference"
    monkeypatch.setattr(dispatch, "interpreting", lambda: False)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        _pick("triton", CPU, "op")
    monkeypatch.setattr(dispatch, "interpreting", lambda: True)
    assert _pick("triton", CPU, "op") == "triton"  # the interpreter runs Triton kernels on CPU tensors
    monkeypatch.setattr(dispatch, "triton_available", lambda: False)
    with pytest.raises(ValueError, match="triton package"):
        _pick("auto", CUDA, "op")


def test_decode_routing(monkeypatch):
    """"auto" picks the CUDA C++ decode kernel where it serves the call (any format), the Triton kernel where
    it does not (float32 tiers, a GQA group above 8, other head sizes), and an explicit backend="cuda" raises
    a ValueError that names the reason. Availability is monkeypatched (no GPU or nvcc needed)."""
    monkeypatch.setattr(dispatch, "triton_available", lambda: True)
    monkeypatch.setattr(decode_cuda, "nvcc", lambda: "nvcc")

    def pick(backend, kf, vf, hq=8, dt16=torch.bfloat16, qdt=torch.bfloat16):
        return _pick(backend, CUDA, "decode", _format_why_not(kf, vf), decode_cuda.unsupported(kf, vf, hq, dt16, qdt))

    for kb in (2, 4):
        for vb in (2, 4):
            for lay in ("token", "channel"):
                kf, vf = PageFormat(2, 128, 64, bits=kb, layout=lay), PageFormat(2, 128, 64, bits=vb)
                assert pick("auto", kf, vf) == "cuda"
                assert pick("cuda", kf, vf, qdt=torch.float32) == "cuda"
    kf, vf = PageFormat(2, 128, 64), PageFormat(2, 128, 64)
    assert pick("auto", kf, vf, dt16=torch.float32) == "triton"
    assert pick("auto", kf, vf, hq=32) == "triton"  # GQA 16
    assert pick("auto", PageFormat(2, 32, 64), PageFormat(2, 32, 64)) == "triton"  # head_dim 32
    assert pick("triton", kf, vf) == "triton"
    with pytest.raises(ValueError, match="16-bit tiers must be float16 or bfloat16"):
        pick("cuda", kf, vf, dt16=torch.float32)
    grouped = PageFormat(2, 128, 64, group_size=32)
    with pytest.raises(ValueError, match="one scale/offset group per row"):
        pick("auto", grouped, vf)
    with pytest.raises(ValueError, match="page_size"):
        pick("auto", PageFormat(2, 128, 48), PageFormat(2, 128, 48), hq=32)  # CUDA: GQA 16; Triton: page 48
    with kernels.use_reference():
        assert pick("auto", kf, vf) == "reference"
    # without nvcc and without prebuilt cubins "auto" takes the Triton kernel
    monkeypatch.setattr(decode_cuda, "nvcc", lambda: None)
    monkeypatch.setattr(decode_cuda, "_cache_dir", lambda: __import__("pathlib").Path("/nonexistent"))
    assert pick("auto", kf, vf) == "triton"


def test_write_routing(monkeypatch):
    monkeypatch.setattr(dispatch, "triton_available", lambda: True)
    for kb, lay, vb in ((2, "token", 4), (4, "channel", 2)):
        kf, vf = PageFormat(2, 64, 16, bits=kb, layout=lay), PageFormat(2, 64, 16, bits=vb)
        assert _pick("auto", CUDA, "write", _format_why_not(kf, vf, write=True)) == "triton"
    kf = PageFormat(2, 64, 48, layout="channel")
    with pytest.raises(ValueError, match="power-of-two page_size"):
        _pick("auto", CUDA, "write", _format_why_not(kf, PageFormat(2, 64, 48), write=True))
    with pytest.raises(ValueError, match="K and V pools must share"):
        _pick("auto", CUDA, "write", _format_why_not(PageFormat(2, 64, 16), PageFormat(2, 64, 32), write=True))


def test_import_layering(monkeypatch):
    """The kernels package imports without triton and never pulls in transformers or the engine."""
    monkeypatch.setitem(sys.modules, "triton", None)  # "import triton" now raises ImportError
    for name in [m for m in sys.modules if m.startswith("oscarkv.kernels")]:
        monkeypatch.delitem(sys.modules, name)
    before = set(sys.modules)
    importlib.import_module("oscarkv.kernels")
    for sub in ("dispatch", "plan", "layout", "reference", "decode_cuda"):
        importlib.import_module(f"oscarkv.kernels.{sub}")
    new = set(sys.modules) - before
    assert not [m for m in new if m.startswith(("transformers", "oscarkv.engine", "oscarkv.hf", "triton"))], new
    with pytest.raises(ImportError):
        importlib.import_module("oscarkv.kernels.decode_triton")
