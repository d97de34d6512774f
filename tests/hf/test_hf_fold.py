"""Folding R_V and the value mean into v_proj / o_proj: exact algebra, exact restoration."""

import pytest
import torch

import oscarkv.hf as ohf

from hf_helpers import VOCAB, random_calibration, spec, tiny_model


@pytest.mark.parametrize("arch,q_heads,kv_heads", [("llama", 4, 4), ("qwen2", 4, 2), ("qwen3", 8, 2)])
@pytest.mark.parametrize("granularity", ["layer", "head"])
def test_folded_model_is_unchanged_without_cache(arch, q_heads, kv_heads, granularity):
    model = tiny_model(arch, q_heads=q_heads, kv_heads=kv_heads)
    calib = random_calibration(model, spec(granularity=granularity), mu_scale=2.0)
    ids = torch.randint(0, VOCAB, (2, 12))
    ref = model(ids).logits
    with ohf.apply(model, calib, "oscar"):
        out = model(ids, use_cache=False).logits
    torch.testing.assert_close(out, ref, atol=5e-5, rtol=0)


def test_folded_v_proj_emits_centered_rotated_values():
    model = tiny_model("qwen2")
    calib = random_calibration(model, spec(granularity="head"), mu_scale=1.0)
    attn = model.model.layers[1].self_attn
    x = torch.randn(3, 64)
    v = attn.v_proj(x).view(3, 2, 16)
    with ohf.apply(model, calib, "oscar"):
        folded = attn.v_proj(x).view(3, 2, 16)
    lay = calib.layer(1)
    want = torch.einsum("nhd,hde->nhe", v - lay["mu_v"], lay["r_v"])
    torch.testing.assert_close(folded, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_restore_is_exact(arch):
    model = tiny_model(arch)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = {n: p for n, p in model.named_parameters()}
    impl = model.config._attn_implementation
    calib = random_calibration(model, mu_scale=1.0)
    with ohf.apply(model, calib, "oscar") as h:
        assert model.config._attn_implementation == "oscar"
        assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
        assert len(h.plans) == (1 if arch == "gemma3" else 2)  # Gemma3: full-attention layers only
    after = model.state_dict()
    assert after.keys() == before.keys()  # no bias left behind where there was none
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p is params[n] for n, p in model.named_parameters())
    assert model.config._attn_implementation == impl
    assert not any(hasattr(m, "_oscarkv_plan") for m in model.modules())


def test_data_free_methods_fold_hadamard_and_skip_identity():
    model = tiny_model("llama")
    calib = random_calibration(model)
    w = model.model.layers[0].self_attn.v_proj.weight
    with ohf.apply(model, calib, "naive-int2-nocenter"):
        assert model.model.layers[0].self_attn.v_proj.weight is w  # nothing to fold
    with ohf.apply(model, calib, "quarot-int2-nocenter"):
        assert model.model.layers[0].self_attn.v_proj.weight is not w
