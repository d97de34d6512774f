"""``decode_cuda.prebuild``: the cubins a server builds at start are exactly those the CUDA decode launcher asks
for at batch 1..N, for every storage format (the launcher runs here on CPU tensors with the driver calls stubbed
out, recording the configurations it would load; a launch's configuration depends on the batch only through 8
and 64 (sequence, KV head) pairs), so no request stalls on a first-use nvcc build."""

from types import SimpleNamespace

import pytest
import torch
from kernel_helpers import FORMATS, fmt_id

from oscarkv.kernels import _triton_util
from oscarkv.kernels import decode_cuda as dc
from oscarkv.kernels.layout import PageFormat, QuantPages
from oscarkv.kernels.plan import DecodePlan


@pytest.fixture
def no_gpu(monkeypatch):
    """The launcher and prebuild without nvcc or a GPU: builds and loads are recorded, launches dropped."""
    built, loaded = [], []
    monkeypatch.setattr(dc, "nvcc", lambda: "nvcc")  # the format rules apply; no toolkit needed
    monkeypatch.setattr(_triton_util, "interpreting", lambda: True)  # CPU tensors pass the device checks
    monkeypatch.setattr(dc, "build", lambda key: built.append(key) or dc._cache_dir() / "stub.cubin")
    monkeypatch.setattr(dc, "_functions", lambda key, dev: loaded.append(key) or (0, 0))
    monkeypatch.setattr(dc, "_launch", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: SimpleNamespace(cuda_stream=0))
    return built, loaded


CASES = [(f, False) for f in FORMATS] + [(FORMATS[0], True), (FORMATS[-1], True)]


@pytest.mark.parametrize("fmt,pdl", CASES, ids=[fmt_id(f) + ("-pdl" if p else "") for f, p in CASES])
def test_prebuild_builds_what_the_launcher_loads(no_gpu, pdl, fmt):
    built, loaded = no_gpu
    kb, lay, vb = fmt
    hkv, g, d, ps, max_batch = 8, 2, 128, 64, 12
    for b in (1, 2, 8, 9, max_batch):  # one sequence (8 pairs: few), up to 64 pairs fused, beyond
        # the launcher reads no page content here: zero pools of the right formats and shapes
        kp = QuantPages.allocate(PageFormat(hkv, d, ps, kb, layout=lay), 2 * b)
        vp = QuantPages.allocate(PageFormat(hkv, d, ps, vb), 2 * b)
        bt = torch.arange(2 * b, dtype=torch.int32).view(b, 2)
        qlen, len16 = torch.full((b,), 65, dtype=torch.int32), torch.full((b,), 5, dtype=torch.int32)
        k16 = v16 = torch.zeros(b, hkv, 8, d, dtype=torch.bfloat16)
        q = torch.randn(b, hkv * g, d, dtype=torch.bfloat16)
        plan = DecodePlan(b, hkv * g, hkv, d, ps, bt.shape[1], 8, device="cpu").update(b)
        dc.decode_attention_cuda(q, kp, vp, bt, qlen, k16, v16, len16, plan=plan, pdl=pdl)
    paths = dc.prebuild(kp.fmt, hkv * g, torch.bfloat16, torch.bfloat16, max_batch, v_fmt=vp.fmt, pdl=pdl)
    assert set(built) == set(loaded), (set(loaded) - set(built), set(built) - set(loaded))
    # one sequence's few pairs (2-bit formats, token or channel keys: the register loop, others the stage loop,
    # both with the L2 prefetch), more pairs fused (the stage loop), and per tier x2
    assert len(built) == len(set(built)) == len(paths) == 4
    parts = sorted(dict(k)["PART_"] for k in built)
    assert parts == [0, 0, 1, 2]
    few = [dict(k) for k in built if dict(k)["L2PF_"]]
    assert len(few) == 1 and few[0]["CPA_"] == int((kb, vb) != (2, 2))
    assert all(dict(k)["KB_"] == kb and dict(k)["VB_"] == vb and dict(k)["KCH_"] == (lay == "channel")
               for k in built)


def test_prebuild_stops_at_the_batches_that_change_nothing(no_gpu):
    built, _ = no_gpu
    dc.prebuild(PageFormat(8, 128, page_size=64), 32, torch.bfloat16, torch.bfloat16, 1024)
    assert len(built) == 4
    built.clear()
    dc.prebuild(PageFormat(8, 128, page_size=64), 32, torch.bfloat16, torch.bfloat16, 1)
    assert [dict(k)["PART_"] for k in built] == [0]  # one sequence: its one configuration only


def test_prebuild_builds_nothing_for_shapes_the_triton_kernel_serves(no_gpu):
    built, _ = no_gpu
    assert dc.prebuild(PageFormat(2, 128, page_size=64), 32, torch.bfloat16, torch.bfloat16, 8) == []  # g = 16
    assert dc.prebuild(PageFormat(8, 128, page_size=64), 32, torch.bfloat16, torch.bfloat16, 0) == []  # no batch
    assert built == []
