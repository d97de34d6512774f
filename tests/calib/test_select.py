"""Per-layer format selection: scoring on held-out tokens, the budgeted allocation, calibrate/inspect wiring."""

import itertools

import pytest
import torch

from oscarkv.artifact import Calibration, TensorFormat
from oscarkv.calib.select import Scored, allocate, default_budget, score_layer, select_formats
from oscarkv.calib.stats import HeldOut
from oscarkv.config import QuantSpec

H, G, T, D = 2, 2, 160, 16
SPEC = QuantSpec(sink=4, window=16, page_size=16, clip_grid=(1.0, 0.9))


def _held(seed: int, outlier_channels: bool) -> HeldOut:
    """Keys ``a_t * u`` (u a fixed +-1 vector: two levels per token row, exact token-wise, spread per channel),
    or keys with a few huge channels (hard for one scale per token row, easy per channel)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(H * G, T, D, generator=g)
    if outlier_channels:
        k = 3 * torch.randn(H, T, D, generator=g)
        k[:, :, :2] = 40 + 10 * torch.randn(H, T, 2, generator=g)
        q[:, :, :2] *= 0.01
    else:
        u = torch.randint(0, 2, (H, 1, D), generator=g) * 2.0 - 1
        k = 3 * torch.randn(H, T, 1, generator=g) * u + 0.01 * torch.randn(H, T, D, generator=g)
    v = torch.randn(H, T, D, generator=g)
    return HeldOut(q, k, v, D ** -0.5)


def _layer():
    eye = torch.eye(D).expand(H, D, D).clone()
    return {"r_k": eye, "r_v": eye.clone(), "mu_k": torch.zeros(H, D), "mu_v": torch.zeros(H, D)}


def test_channel_pages_win_on_planted_outlier_channels():
    cands = [TensorFormat("token", 2, "none"), TensorFormat("channel", 2, "none")]
    easy = score_layer([_held(0, False)], _layer(), SPEC, "k", cands)
    hard = score_layer([_held(0, True)], _layer(), SPEC, "k", cands)
    assert hard[1].error < 0.5 * hard[0].error  # per-channel pages beat token rows on outlier channels
    assert all(len(s.head_error) == H for s in easy + hard)
    assert hard[0].bits == hard[1].bits == pytest.approx(2 + 32 / 16)
    four = score_layer([_held(0, True)], _layer(), SPEC, "k", [TensorFormat("token", 4, "none")])
    assert four[0].error < hard[0].error


def test_allocate_respects_budget_and_is_optimal():
    g = torch.Generator().manual_seed(0)
    scores = []
    for _ in range(5):
        e = torch.rand(3, generator=g).sort(descending=True).values.tolist()
        scores.append([Scored(TensorFormat(), b, err, []) for b, err in zip((2.5, 2.5 + 0.5, 4.5), e)])
    for budget in (2.5, 2.75, 3.2, 4.5):
        picks = allocate(scores, budget)
        mean_bits = sum(scores[t][p].bits for t, p in enumerate(picks)) / 5
        assert mean_bits <= budget + 1e-9
        best = min((sum(scores[t][p].error ** 2 for t, p in enumerate(c)), c)
                   for c in itertools.product(range(3), repeat=5)
                   if sum(scores[t][p].bits for t, p in enumerate(c)) / 5 <= budget + 1e-9)
        assert sum(scores[t][p].error ** 2 for t, p in enumerate(picks)) == pytest.approx(best[0])
    with pytest.raises(ValueError, match="below the cheapest"):
        allocate(scores, 2.0)


def test_allocate_upgrades_the_worst_tensor():
    s = [[Scored(TensorFormat(), 2.5, 0.1, []), Scored(TensorFormat(bits=4), 4.5, 0.01, [])] for _ in range(7)]
    s.append([Scored(TensorFormat(), 2.5, 1.3, []), Scored(TensorFormat(bits=4), 4.5, 0.2, [])])
    picks = allocate(s, 2.75)  # room for one upgrade: it goes to the 130 % tensor
    assert picks == [0] * 7 + [1]


def test_default_budget_is_kivi():
    assert default_budget(64) == pytest.approx(2.75) and default_budget(128) == pytest.approx(2.625)


def test_select_formats_planted_layer_and_roundtrip(tmp_path):
    from oscarkv.artifact import ModelIdentity
    from oscarkv.cli.inspect import format_summary

    ident = ModelIdentity("llama", num_layers=3, num_q_heads=H * G, num_kv_heads=H, head_dim=D, hidden_size=64)
    calib = Calibration.identity(ident, SPEC)
    held = [[_held(1, False)], [_held(2, True)], [_held(3, False)]]
    kc = [TensorFormat("token", 2, "none"), TensorFormat("channel", 2, "none"), TensorFormat("token", 4, "none")]
    vc = [TensorFormat("token", 2, "none"), TensorFormat("token", 4, "none")]
    formats, record = select_formats(held, calib, 2 + 32 / 16, key_candidates=kc, value_candidates=vc)
    calib.layer_formats = formats
    ks = [calib.formats(i)[0] for i in range(3)]
    assert [k.layout for k in ks] == ["token", "channel", "token"]  # the planted outlier layer, no room for 4-bit
    assert record["bits_per_element"] <= 4.0 + 1e-9 and len(record["candidates"]) == 6
    calib.save(tmp_path / "a")
    again = Calibration.load(tmp_path / "a")
    assert again.layer_formats == formats and again.formats(1)[0] == ks[1]
    assert again.spec == calib.spec
    text = format_summary(again)
    assert "per-layer formats" in text and "channel2/none" in text


def test_budget_is_spent_over_the_quantized_layers_only():
    from oscarkv.artifact import ModelIdentity

    ident = ModelIdentity("llama", num_layers=4, num_q_heads=H * G, num_kv_heads=H, head_dim=D, hidden_size=64)
    calib = Calibration.identity(ident, SPEC)
    held = [[_held(i, i == 1)] for i in range(4)]
    kc = [TensorFormat("token", 2, "none"), TensorFormat("token", 4, "none")]
    vc = [TensorFormat("token", 2, "none"), TensorFormat("token", 4, "none")]
    budget = 2 + 32 / 16 + 1.0  # room to upgrade half of the tensors of the layers it covers
    formats, record = select_formats(held, calib, budget, key_candidates=kc, value_candidates=vc,
                                     quantized_layers=[False, True, False, True])
    assert [f.get("quantized", True) for f in formats] == [False, True, False, True]
    assert record["quantized_layers"] == 2 and len(record["candidates"]) == 4
    assert record["candidate_layers"] == [1, 1, 3, 3]
    spent = [f[f"{w}_bits_per_element"] for f in formats if f.get("quantized", True) for w in "kv"]
    assert sum(spent) / 4 == pytest.approx(record["bits_per_element"]) and record["bits_per_element"] <= budget
    assert record["bits_per_element"] > 2 + 32 / 16  # the budget was used on the two quantized layers
    with pytest.raises(ValueError, match="at least one True"):
        select_formats(held, calib, budget, key_candidates=kc, value_candidates=vc, quantized_layers=[False] * 4)


def test_calibrate_with_bit_budget_selects_and_oscar_auto_resolves(tmp_path):
    from calib_helpers import VOCAB, tiny_model

    from oscarkv import methods
    from oscarkv.calib import calibrate

    model = tiny_model("qwen2", layers=2)
    chunks = [torch.randint(0, VOCAB, (96,), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    spec = QuantSpec(sink=4, window=16, page_size=16, clip_grid=(1.0, 0.9), bit_budget=5.0)
    calib = calibrate(model, None, chunks, spec=spec, tokens=288, holdout=0.34, progress=False)
    assert calib.layer_formats is not None and len(calib.layer_formats) == 2
    assert methods.nominal_bits("oscar-auto", 16, calib) <= 5.0 + 1e-9
    assert calib.provenance["format_selection"]["budget"] == 5.0
    recipe = methods.resolve("oscar-auto", calib)
    assert [recipe.formats[i].k.layout for i in range(2)] == [calib.formats(i)[0].layout for i in range(2)]
    calib.save(tmp_path / "c")
    assert Calibration.load(tmp_path / "c").spec.bit_budget == 5.0


def test_select_from_existing_artifact_keeps_tensors():
    from calib_helpers import VOCAB, tiny_model

    from oscarkv.calib import calibrate, select_from

    model = tiny_model("llama", layers=2)
    chunks = [torch.randint(0, VOCAB, (96,), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    spec = QuantSpec(sink=4, window=16, page_size=16, clip_grid=(1.0, 0.9))
    base = calibrate(model, None, chunks, spec=spec, tokens=288, holdout=0.34, progress=False)
    assert base.layer_formats is None
    auto = select_from(model, None, base, chunks, budget=4.5, progress=False)
    assert auto.spec.bit_budget == 4.5 and auto.spec.replace(bit_budget=None) == base.spec
    assert len(auto.layer_formats) == 2
    assert auto.provenance["format_selection"]["held_out"]["tokens"] == base.provenance["holdout_tokens"]
    for name in ("r_k", "r_v", "mu_k", "mu_v", "k_clip", "v_clip"):
        assert torch.equal(getattr(auto, name), getattr(base, name))


def test_bit_budget_spec_key_and_cli_flag():
    import argparse

    from oscarkv.cli.calibrate import _budget, add_arguments
    from oscarkv.config import ConfigError

    assert "bit_budget" not in QuantSpec().to_dict()  # unset: artifacts and their hashes as before the key
    assert QuantSpec.from_dict({"bit_budget": 2.75}).bit_budget == 2.75
    assert QuantSpec.from_dict({"bit_budget": "kivi"}).to_dict()["bit_budget"] == "kivi"
    with pytest.raises(ConfigError, match="bit_budget"):
        QuantSpec(bit_budget="lots")
    p = argparse.ArgumentParser()
    add_arguments(p)
    assert p.parse_args(["--bit-budget", "2.6"]).bit_budget == 2.6
    assert p.parse_args(["--bit-budget", "kivi"]).bit_budget == "kivi"
    with pytest.raises(argparse.ArgumentTypeError):
        _budget("-1")


@pytest.mark.parametrize("sliding", [None, 48])
def test_band_errors_equal_a_full_attention_with_the_replaced_tensors(sliding):
    """The chunk's band-only errors (online-softmax combination of fixed columns and the candidate's band) equal
    recomputing the whole causal attention with the row's quantized keys (or values) replaced."""
    from oscarkv.calib.select import _Chunk, chunk_policy
    from oscarkv.calib.stats import causal_mask

    held = _held(5, True)
    held = HeldOut(held.q, held.k, held.v, held.scaling, sliding_window=sliding)
    policy = chunk_policy(T, SPEC)
    c = _Chunk(held, policy, max_queries=40)
    g = torch.Generator().manual_seed(1)
    k_hat = c.band(held.k) + 0.3 * torch.randn(3, H, c.n_q, D, generator=g)
    v_hat = c.band(held.v) + 0.3 * torch.randn(3, H, c.n_q, D, generator=g)
    got_k, got_v = c.key_error(k_hat), c.value_error(v_hat)
    qn = policy.quantized_t(torch.arange(T))
    valid = causal_mask(T, sliding)
    for j in range(3):
        err_k = torch.zeros(H, dtype=torch.float64)
        err_v = torch.zeros(H, dtype=torch.float64)
        for r in c.rows.tolist():
            cols = torch.arange(T)
            quant = (cols >= c.S) & (cols < c.S + qn[r]) & valid[r]
            for h in range(H):
                k = held.k[h].clone()
                v = held.v[h].clone()
                k[c.S: c.S + c.n_q] = torch.where(quant[c.S: c.S + c.n_q, None], k_hat[j, h], k[c.S: c.S + c.n_q])
                v[c.S: c.S + c.n_q] = torch.where(quant[c.S: c.S + c.n_q, None], v_hat[j, h], v[c.S: c.S + c.n_q])
                for qh in range(h * G, (h + 1) * G):
                    q = held.q[qh, r]
                    def att(kk, vv):  # noqa: E306
                        s = (kk @ q * held.scaling).masked_fill(~valid[r], float("-inf"))
                        return torch.softmax(s, -1) @ vv
                    ref = att(held.k[h], held.v[h])
                    err_k[h] += float(((att(k, held.v[h]) - ref) ** 2).sum())
                    err_v[h] += float(((att(held.k[h], v) - ref) ** 2).sum())
        torch.testing.assert_close(got_k[j], err_k, rtol=2e-4, atol=1e-6)
        torch.testing.assert_close(got_v[j], err_v, rtol=2e-4, atol=1e-6)


def test_impossible_budget_is_refused_before_any_forward_pass():
    """At head_dim 64 every candidate costs at least 2 + 32/64 bits: 2.25 can never be met. The refusal names the
    lowest budget that can, and comes before the statistics pass (a model that raises on forward never runs)."""
    from calib_helpers import VOCAB, tiny_model

    from oscarkv.calib import calibrate
    from oscarkv.calib.select import check_budget

    spec64 = QuantSpec(page_size=64)
    assert check_budget(2.5, 64, spec64) == 2.5 and check_budget("kivi", 64, spec64) == default_budget(64)
    with pytest.raises(ValueError, match=r"below 2\.500 bits/element.*head_dim 64.*--bit-budget 2\.5 or more"):
        check_budget(2.25, 64, spec64)
    assert check_budget(2.25, 128, QuantSpec(page_size=128)) == 2.25  # 2 + 32/128: reachable at d = 128

    model = tiny_model("qwen2", layers=2)

    def no_forward(*a, **k):
        raise AssertionError("the model ran before the budget was checked")

    model.forward = no_forward
    chunks = [torch.randint(0, VOCAB, (96,), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    spec = QuantSpec(sink=4, window=16, page_size=16, clip_grid=(1.0, 0.9), bit_budget=2.0)
    with pytest.raises(ValueError, match="below"):
        calibrate(model, None, chunks, spec=spec, tokens=288, holdout=0.34, progress=False)
