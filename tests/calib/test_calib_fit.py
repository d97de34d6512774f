"""Rotations, clip fitting, chunk planning, artifact round trips and the errors calibration must raise."""

from __future__ import annotations

import pytest
import torch
from calib_helpers import VOCAB, tiny_model, word_text, word_tokenizer

from oscarkv.artifact import ArtifactError, Calibration, UnsupportedModelError
from oscarkv.calib import calibrate, plan_chunks
from oscarkv.calib.fit import choose_ratio, clip_errors, rotations, tier_mask
from oscarkv.calib.stats import HeldOut
from oscarkv.config import QuantSpec
from oscarkv.rotation import RotationError, compose, orthogonality_error, sorted_eigh


def _chunks(n=4, t=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (t,), generator=g) for _ in range(n)]


FIXED = QuantSpec(k_clip=0.96, v_clip=0.0)


@pytest.mark.parametrize("granularity", ["layer", "head"])
def test_rotations_follow_the_averaged_or_per_head_targets(granularity):
    model = tiny_model("qwen3")
    spec = FIXED.replace(granularity=granularity)
    calib, stats = calibrate(model, None, _chunks(), spec=spec, tokens=128, progress=False, return_stats=True)
    target_k = stats.c_q.mean(1) if granularity == "layer" else stats.c_q
    target_v = stats.c_s.mean(1) if granularity == "layer" else stats.c_s
    for r, e, target in ((calib.r_k, calib.eig_k, target_k), (calib.r_v, calib.eig_v, target_v)):
        evals, evecs = sorted_eigh(target)
        torch.testing.assert_close(r, compose(evecs, 16, "uhp"))
        torch.testing.assert_close(e, evals.float())
        assert (e[..., :-1] >= e[..., 1:]).all()  # descending
        assert orthogonality_error(r) < 1e-5
    assert calib.r_k.shape == ((2, 16, 16) if granularity == "layer" else (2, 2, 16, 16))
    assert calib.k_clip.tolist() == pytest.approx([0.96, 0.96]) and calib.v_clip.tolist() == [0.0, 0.0]


def test_gram_target_and_data_free_compositions():
    model = tiny_model("llama")
    calib, stats = calibrate(model, None, _chunks(), spec=FIXED.replace(target="gram"), tokens=128, progress=False,
                             return_stats=True)
    torch.testing.assert_close(calib.eig_k, sorted_eigh(stats.gram_k.mean(1))[0].float())
    torch.testing.assert_close(calib.eig_v, sorted_eigh(stats.gram_v.mean(1))[0].float())
    for comp in ("h", "none"):
        c = calibrate(model, None, _chunks(), spec=FIXED.replace(composition=comp, granularity="head"), tokens=64,
                      progress=False)
        assert c.r_k.shape == (2, 2, 16, 16)
        torch.testing.assert_close(c.r_v[1, 1], compose(None, 16, comp))


def test_fitted_clip_uses_heldout_tokens_and_records_the_fit():
    model = tiny_model("qwen2")
    grid = (1.0, 0.9, 0.75, 0.5)
    spec = QuantSpec(clip_grid=grid, sink=2, window=4)
    calib = calibrate(model, None, _chunks(n=4), spec=spec, tokens=128, holdout=0.25, progress=False)
    p = calib.provenance
    assert p["stats_tokens"] == 96 and p["holdout_tokens"] == 32
    fit = p["clip_fit"]
    assert fit["grid"] == list(grid) and len(fit["k_error"]) == 2 and len(fit["v_error"][0]) == len(grid)
    for i in range(2):
        for which, clip in (("k", calib.k_clip), ("v", calib.v_clip)):
            errs = fit[f"{which}_error"][i]
            assert float(clip[i]) == pytest.approx(choose_ratio(grid, errs))
            assert min(errs) > 0  # quantization error is never zero on random data


def test_fitted_clip_needs_two_chunks():
    with pytest.raises(ValueError, match="held-out"):
        calibrate(tiny_model("llama"), None, _chunks(n=1), spec=QuantSpec(), tokens=32, progress=False)


def test_choose_ratio_prefers_least_clipping_on_ties():
    assert choose_ratio([1.0, 0.9, 0.8], [0.2, 0.1, 0.1]) == 0.9
    assert choose_ratio([0.8, 0.9, 1.0], [0.3, 0.3, 0.3]) == 1.0


def test_tier_mask_matches_cache_rule():
    m = tier_mask(10, sink=2, window=3)
    assert not m[:, :2].any()  # sink stays 16-bit
    assert m[9].nonzero().flatten().tolist() == [2, 3, 4, 5, 6]  # 9 - 3 = 6 is the newest 2-bit key
    assert not m[4].any()


def test_clip_errors_shrink_with_more_bits():
    g = torch.Generator().manual_seed(0)
    H, d, T = 2, 16, 40
    held = [HeldOut(torch.randn(4, T, d, generator=g), torch.randn(H, T, d, generator=g),
                    torch.randn(H, T, d, generator=g), d ** -0.5)]
    layer = {"r_k": torch.eye(d).expand(H, d, d), "r_v": torch.eye(d).expand(H, d, d), "mu_k": torch.zeros(H, d),
             "mu_v": torch.zeros(H, d)}
    for which in ("k", "v"):
        e2 = clip_errors(held, layer, QuantSpec(bits=2, sink=2, window=4), [1.0], which)[0]
        e4 = clip_errors(held, layer, QuantSpec(bits=4, sink=2, window=4), [1.0], which)[0]
        assert 0 < e4 < e2 < 1


def test_text_data_is_sampled_deterministically_and_heldout_is_disjoint():
    tok = word_tokenizer()
    texts = [word_text(300, seed=i) for i in range(4)]
    a_stats, a_hold, prov = plan_chunks(texts, tok, tokens=200, seq_len=50, seed=3, holdout=0.25)
    b_stats, b_hold, _ = plan_chunks(texts, tok, tokens=200, seq_len=50, seed=3, holdout=0.25)
    c_stats, _, _ = plan_chunks(texts, tok, tokens=200, seq_len=50, seed=4, holdout=0.25)
    assert [c.tolist() for c in a_stats + a_hold] == [c.tolist() for c in b_stats + b_hold]
    assert [c.tolist() for c in a_stats] != [c.tolist() for c in c_stats]
    assert sum(c.numel() for c in a_stats) == 150 and sum(c.numel() for c in a_hold) == 50
    assert all(c[0].item() == tok.bos_token_id for c in a_stats + a_hold)
    spans = [tuple(s.split("@")) for s in prov["chunks"]]
    assert len(set(spans)) == len(spans)  # no chunk sampled twice


def test_calibrate_on_text_records_provenance(tmp_path):
    model = tiny_model("llama")
    calib = calibrate(model, word_tokenizer(), [word_text(400, seed=i) for i in range(3)], spec=FIXED, tokens=120,
                      seq_len=40, seed=1, progress=False, name="tiny-llama")
    p = calib.provenance
    for key in ("data", "tokens", "seed", "oscarkv_version", "torch_version", "transformers_version", "wall_time_s"):
        assert key in p, key
    assert p["tokens"] == 120 and p["seed"] == 1 and len(p["data"]["chunks"]) == 3
    assert calib.model.name == "tiny-llama"


def test_artifact_round_trip_and_mismatch_errors(tmp_path):
    model = tiny_model("qwen2")
    calib = calibrate(model, None, _chunks(), spec=QuantSpec(sink=2, window=4, page_size=4), tokens=128, progress=False)
    calib.save(tmp_path / "c")
    back = Calibration.load(tmp_path / "c", model=model)
    for name in ("r_k", "r_v", "eig_k", "eig_v", "mu_k", "mu_v", "k_clip", "v_clip"):
        torch.testing.assert_close(getattr(back, name), getattr(calib, name))
    assert back.spec == calib.spec and back.provenance["tokens"] == 128
    with pytest.raises(ArtifactError, match="num_layers: calibration has 2, model has 3"):
        Calibration.load(tmp_path / "c", model=tiny_model("qwen2", layers=3))
    with pytest.raises(ArtifactError, match="architecture: calibration has 'qwen2', model has 'llama'"):
        Calibration.load(tmp_path / "c", model=tiny_model("llama"))
    with pytest.raises(ArtifactError, match="head_dim.*num_q_heads|num_q_heads.*head_dim"):
        Calibration.load(tmp_path / "c", model=tiny_model("qwen2", head_dim=32, q_heads=2).config)
    with pytest.raises(ArtifactError, match="num_kv_heads: calibration has 2, model has 1"):
        Calibration.load(tmp_path / "c", model=tiny_model("qwen2", kv_heads=1))


def test_non_power_of_two_head_dim_is_refused_for_hadamard_compositions():
    model = tiny_model("llama", head_dim=12)
    for comp in ("uhp", "uh", "h"):
        with pytest.raises(RotationError, match="head_dim = 12 is not a power of two"):
            calibrate(model, None, _chunks(), spec=FIXED.replace(composition=comp), tokens=64, progress=False)
    calib = calibrate(model, None, _chunks(), spec=FIXED.replace(composition="u"), tokens=64, progress=False)
    assert calib.r_k.shape == (2, 12, 12)


def test_unsupported_architecture_is_refused():
    import transformers as tr

    cfg = tr.MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1)
    with pytest.raises(UnsupportedModelError, match="'mistral' is not supported"):
        calibrate(tr.MistralForCausalLM(cfg), None, _chunks(), spec=FIXED, tokens=64, progress=False)


def test_rotations_helper_shapes():
    model = tiny_model("gemma3")
    _, stats = calibrate(model, None, _chunks(), spec=FIXED, tokens=64, progress=False, return_stats=True)
    rot = rotations(stats, FIXED.replace(granularity="head", composition="u"))
    torch.testing.assert_close(rot["r_k"] @ torch.diag_embed(rot["eig_k"]) @ rot["r_k"].transpose(-1, -2),
                               stats.c_q.float(), rtol=1e-4, atol=1e-4 * float(stats.c_q.abs().max()))


def test_roundtrips_equal_the_reference_quantizer_with_clipping():
    from oscarkv.calib.fit import _roundtrips
    from oscarkv.quant import fake_quantize
    from oscarkv.rotation import random_orthogonal

    g = torch.Generator().manual_seed(0)
    x, mu, r = torch.randn(2, 40, 16, generator=g) * 3, torch.randn(2, 16, generator=g), random_orthogonal(16, g)
    grid = [1.0, 0.9, 0.5]
    for ratio, got in zip(grid, _roundtrips(x, r.expand(2, 16, 16), mu, grid, QuantSpec())):
        want = fake_quantize((x - mu[:, None]) @ r, bits=2, clip_ratio=ratio) @ r.T + mu[:, None]
        torch.testing.assert_close(got, want, rtol=0, atol=0)
