"""Calibration statistics equal their definitions, recomputed independently from the layers' weights."""

from __future__ import annotations

import pytest
import torch
from calib_helpers import ARCHS, VOCAB, capture_qkv, eager_attention_probs, tiny_model

from oscarkv.calib import calibrate
from oscarkv.calib.stats import Recorder, capture
from oscarkv.config import QuantSpec

T, N_CHUNKS = 24, 3


def _chunks(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (T,), generator=g) for _ in range(N_CHUNKS)]


def _expected(model, chunks, weighting: str, centering: bool) -> dict[str, torch.Tensor]:
    """The definitions of docs/method.md section 2, computed in float64 from independently captured q/k/v."""
    per_layer = None
    for ids in chunks:
        qkv = capture_qkv(model, ids)
        probs = eager_attention_probs(model, ids) if weighting == "softmax" else [None] * len(qkv)
        if per_layer is None:
            per_layer = [{"q": [], "k": [], "v": [], "w": []} for _ in qkv]
        for store, (q, k, v), p in zip(per_layer, qkv, probs):
            store["q"].append(q.double())
            store["k"].append(k.double())
            store["v"].append(v.double())
            if p is not None:
                H = k.shape[0]
                store["w"].append((p * p).sum(1).reshape(H, -1, p.shape[-1]).sum(1))  # [H, T]
    out = {n: [] for n in ("c_q", "c_s", "gram_k", "gram_v", "mu_k", "mu_v")}
    for s in per_layer:
        q, k, v = (torch.cat(s[n], dim=1) for n in ("q", "k", "v"))  # [Hq|H, N, d]
        H, N, d = k.shape
        g = q.shape[0] // H
        qg = q.reshape(H, g, N, d)
        c_q = torch.einsum("hgnd,hgne->hde", qg, qg) / (g * N)
        mu_k, mu_v = k.mean(1), v.mean(1)
        kc = k - mu_k[:, None] if centering else k
        vc = v - mu_v[:, None] if centering else v
        if weighting == "softmax":
            w = torch.cat(s["w"], dim=1)
        else:
            w = torch.einsum("hnd,hde,hne->hn", k, c_q, k)  # raw keys, final C_Q
        w = w / w.mean(1, keepdim=True)
        out["c_q"].append(c_q)
        out["c_s"].append(torch.einsum("hn,hnd,hne->hde", w, vc, vc) / N)
        out["gram_k"].append(torch.einsum("hnd,hne->hde", kc, kc) / N)
        out["gram_v"].append(torch.einsum("hnd,hne->hde", vc, vc) / N)
        out["mu_k"].append(mu_k)
        out["mu_v"].append(mu_v)
    return {n: torch.stack(v) for n, v in out.items()}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("weighting", ["quadratic", "softmax"])
def test_stats_equal_definitions(arch, weighting):
    model = tiny_model(arch)
    chunks = _chunks()
    centering = arch != "llama"  # both settings get covered
    spec = QuantSpec(k_clip=0.96, v_clip=0.0, value_weighting=weighting, centering=centering)
    calib, stats = calibrate(model, None, chunks, spec=spec, tokens=T * N_CHUNKS, progress=False, return_stats=True)
    want = _expected(model, chunks, weighting, centering)
    assert stats.tokens == T * N_CHUNKS
    for name, ref in want.items():
        got = getattr(stats, name)
        assert got.dtype == torch.float64 and got.shape == ref.shape, name
        scale = ref.abs().max()
        assert (got - ref).abs().max() <= 1e-5 * scale + 1e-12, f"{arch}/{weighting}: {name} differs"
    if centering:
        torch.testing.assert_close(calib.mu_k, want["mu_k"].float())
    else:
        assert calib.mu_k.abs().max() == 0 and calib.mu_v.abs().max() == 0  # stored means are zero when off


def test_capture_leaves_outputs_and_setting_unchanged():
    model = tiny_model("gemma3")
    ids = _chunks()[0].view(1, -1)
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    rec = Recorder(2, 2, 16, need_kv=False, need_softmax=False)
    before = model.config._attn_implementation
    with torch.no_grad(), capture(model, rec):
        assert model.config._attn_implementation == "oscarkv_calib"
        got = model(input_ids=ids).logits
    assert model.config._attn_implementation == before
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert [acc.n for acc in rec.layers] == [T, T]


def test_capture_restores_setting_after_error():
    model = tiny_model("llama")
    before = model.config._attn_implementation
    with pytest.raises(RuntimeError, match="boom"):
        with capture(model, Recorder(2, 2, 16, need_kv=False, need_softmax=False)):
            raise RuntimeError("boom")
    assert model.config._attn_implementation == before
    from transformers import AttentionInterface

    assert "oscarkv_calib" not in AttentionInterface._global_mapping


def test_gemma3_hook_sees_sliding_window_and_post_norm_tensors():
    model = tiny_model("gemma3")
    seen = {}
    rec = Recorder(2, 2, 16, need_kv=False, need_softmax=False)
    original = rec.record

    def spy(module, q, k, v, kwargs):
        seen[module.layer_idx] = (kwargs.get("sliding_window"), k[0].clone())
        original(module, q, k, v, kwargs)

    rec.record = spy
    ids = _chunks()[0]
    with torch.no_grad(), capture(model, rec):
        model(input_ids=ids.view(1, -1))
    assert seen[0][0] == 8 and seen[1][0] is None
    independent = capture_qkv(model, ids)
    for layer in (0, 1):
        torch.testing.assert_close(seen[layer][1], independent[layer][1])


def test_nan_activation_names_the_layer():
    model = tiny_model("llama")
    with torch.no_grad():
        model.model.layers[1].self_attn.k_proj.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="layer 1: .*key.*NaN"):
        calibrate(model, None, _chunks(), spec=QuantSpec(k_clip=0.9, v_clip=0.9), tokens=T, progress=False)
    assert model.config._attn_implementation != "oscarkv_calib"
