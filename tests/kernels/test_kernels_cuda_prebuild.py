"""``decode_cuda.prebuild``: the cubins a server builds at start are exactly those the CUDA decode launcher asks
for at batch 1..N (the launcher runs here on CPU tensors with the driver calls stubbed out, recording the
configurations it would load), so no request stalls on a first-use nvcc build."""

from types import SimpleNamespace

import pytest
import torch
from kernel_helpers import build_cache

from oscarkv.kernels import decode_cuda as dc
from oscarkv.kernels.layout import PageFormat
from oscarkv.kernels.plan import DecodePlan


@pytest.fixture
def no_gpu(monkeypatch):
    """The launcher and prebuild without nvcc or a GPU: builds and loads are recorded, launches dropped."""
    built, loaded = [], []
    monkeypatch.setattr(dc, "supported", lambda *a, **k: True)
    monkeypatch.setattr(dc, "build", lambda key: built.append(key) or dc._cache_dir() / "stub.cubin")
    monkeypatch.setattr(dc, "_functions", lambda key, dev: loaded.append(key) or (0, 0))
    monkeypatch.setattr(dc, "_launch", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: SimpleNamespace(cuda_stream=0))
    monkeypatch.delenv(dc.VARIANT_ENV, raising=False)
    return built, loaded


@pytest.mark.parametrize("pdl", [False, True])
def test_prebuild_builds_what_the_launcher_loads(no_gpu, pdl):
    built, loaded = no_gpu
    hkv, g, d, ps, max_batch = 8, 2, 128, 64, 12
    for b in range(1, max_batch + 1):  # every batch: one sequence (few pairs), up to 64 pairs fused, beyond
        kp, vp, bt, qlen, k16, v16, len16 = build_cache(b, hkv, g, d, ps, [70] * b, [5] * b, 8,
                                                        dtype16=torch.bfloat16, device=torch.device("cpu"))
        q = torch.randn(b, hkv * g, d, dtype=torch.bfloat16)
        plan = DecodePlan(b, hkv * g, hkv, d, ps, bt.shape[1], 8, device="cpu").update(b)
        dc.decode_attention_cuda(q, kp, vp, bt, qlen, k16, v16, len16, plan=plan, pdl=pdl)
    paths = dc.prebuild(PageFormat(hkv, d, page_size=ps), hkv * g, torch.bfloat16, torch.bfloat16, max_batch,
                        pdl=pdl)
    assert set(built) == set(loaded), (set(loaded) - set(built), set(built) - set(loaded))
    assert len(built) == len(set(built)) == len(paths) == 4  # few-pair variant, default fused, default per tier x2
    parts = sorted(dict(k)["PART_"] for k in built)
    assert parts == [0, 0, 1, 2]


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
