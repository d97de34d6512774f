"""Per-layer formats (oscar-auto calibrations) in the engine's OSCAR pool: storage per layer format, byte
accounting, and greedy tokens equal to the transformers integration on the same calibration."""

import pytest
import torch
from test_engine_oscar import make_calib  # noqa: E402  (pytest puts this folder on sys.path)

from oscarkv.config import QuantSpec
from oscarkv.engine import LLM, SamplingParams
from oscarkv.kernels.layout import PageFormat

# layer 0: 2-bit channel-page keys (no rotation) + 4-bit values; layer 1: 2-bit token rows, Hadamard keys
FORMATS = [
    {"k": {"layout": "channel", "bits": 2, "rotation": "none"}, "v": {"layout": "token", "bits": 4,
                                                                       "rotation": "calibrated", "clip": 0.9}},
    {"k": {"layout": "token", "bits": 2, "rotation": "hadamard", "clip": 0.94},
     "v": {"layout": "token", "bits": 2, "rotation": "none", "clip": 0.85}},
]
SMALL = QuantSpec(sink=4, window=8, page_size=4, k_clip=0.9, v_clip=0.85)


def test_store_page_bytes_follow_formats(make_hf):
    from oscarkv.cache import PagedStore

    hf = make_hf("qwen2")
    calib = make_calib(hf, SMALL)
    calib.layer_formats = FORMATS
    st = LLM(hf, calib, kv="oscar", kv_budget_gb=0.01, max_num_seqs=2).store
    (k0, v0), (k1, v1) = ((st.k_pages[i].fmt, st.v_pages[i].fmt) for i in range(2))
    assert (k0.layout, k0.bits, v0.bits, k1.layout) == ("channel", 2, 4, "token")
    assert PagedStore.page_bytes(st.formats, st.geo) == 4 * sum(f.bytes_per_token for f in (k0, v0, k1, v1))


def test_mixed_pool_stores_each_layer_in_its_format(make_hf):
    hf = make_hf("qwen2")
    calib = make_calib(hf, SMALL)
    calib.layer_formats = FORMATS
    llm = LLM(hf, calib, kv="oscar", kv_budget_gb=0.01, max_num_seqs=2, window_dtype=torch.float32)
    st = llm.store
    k0, v0 = st.k_pages[0], st.v_pages[0]
    assert k0.fmt == PageFormat(2, 16, 4, 2, None, "float16", "channel") and v0.fmt.bits == 4
    assert k0.scale.shape[2:] == (1, 16) and v0.codes.shape[-1] == 16 * 4 // 8
    seq = llm.submit(torch.randint(0, 256, (23,)).tolist(), SamplingParams(max_tokens=30, ignore_eos=True))
    while len(seq.out) < 14:
        llm.step()
    assert st.qlens[seq.slot] == 24
    page = torch.tensor(st.table.pages[seq.slot][:1])
    assert bool(k0.scale[page].abs().sum() > 0) and bool(st.v_pages[1].scale[page].abs().sum() > 0)
    assert st.allocated_bytes() == sum(t.numel() * t.element_size() for t in (*st.tensors(), st.block_table))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_equals_transformers_integration_with_layer_formats(make_hf, arch):
    hf_mod = pytest.importorskip("oscarkv.hf")
    hf = make_hf(arch)
    calib = make_calib(hf, SMALL)
    calib.layer_formats = FORMATS
    prompt = torch.randint(0, 256, (30,)).tolist()
    llm = LLM(hf, calib, kv="oscar", kv_budget_gb=0.01, max_num_seqs=2)  # method defaults to oscar-auto
    ours = llm.generate([prompt], SamplingParams(max_tokens=20, ignore_eos=True))[0].token_ids
    assert len(set(llm.store.formats)) == 2
    assert "quantized layers all 2 (2 formats" in llm.describe()  # what the engine logs at start
    with hf_mod.apply(hf, calib, "oscar-auto") as handle:
        out = hf.generate(torch.tensor([prompt]), cache=handle.cache(), max_new_tokens=20,
                          min_new_tokens=20, do_sample=False)
    assert ours == out[0, 30:].tolist()


def test_engine_refuses_methods_it_does_not_serve(make_hf):
    hf = make_hf("llama")
    with pytest.raises(ValueError, match="serves the methods"):
        LLM(hf, make_calib(hf, SMALL), kv="oscar", kv_budget_gb=0.01, method="kivi-2")
