"""Demotion at every boundary: the tiers hold exactly the tokens (and the values) the method says."""

import pytest
import torch

import oscarkv.hf as ohf
from oscarkv.cache import TierPolicy
from oscarkv.quant import dequantize, quantize

from hf_helpers import VOCAB, random_calibration, spec, tiny_model

S, W, P = 4, 8, 4


def _record(cache, layer_idx):
    """Record the raw K/V every update() of one layer receives."""
    layer, rec = cache.layers[layer_idx], []
    orig = layer.update

    def update(k, v, *args, **kwargs):
        rec.append((k.clone(), v.clone()))
        return orig(k, v, *args, **kwargs)

    layer.update = update
    return rec


def _expected(plan, rec, n, dtype16, clips, bits=2):
    """Sink / quantized / recent rows for the first n recorded tokens, computed from scratch."""
    k = plan.rotate_keys(torch.cat([r[0] for r in rec], 2))[:, :, :n].to(dtype16).float()
    v = torch.cat([r[1] for r in rec], 2)[:, :, :n].float().to(dtype16).float()
    s, q, r = TierPolicy(S, W, P).split(n)

    def fq(x, clip):
        return dequantize(quantize(x, bits=bits, clip_ratio=clip))

    return {
        "k_sink": k[:, :, :s], "k_quantized": fq(k[:, :, S: S + q], clips[0]), "k_recent": k[:, :, S + q:],
        "v_sink": v[:, :, :s], "v_quantized": fq(v[:, :, S: S + q], clips[1]), "v_recent": v[:, :, S + q:],
    }


def _check(cache, layer_idx, rec, n, dtype16, clips):
    layer = cache.layers[layer_idx]
    exp = _expected(layer.plan, rec, n, dtype16, clips)
    s, q, r = TierPolicy(S, W, P).split(n)
    for b in range(2):
        got = layer.store.tiers(0, b)
        assert layer.store.lens[b] == n and layer.store.len16(b) == s + r
        assert layer.store.qlens[b] == q
        for name, want in exp.items():
            torch.testing.assert_close(got[name], want[b], atol=0, rtol=0, msg=f"{name} at n={n}")


@pytest.mark.parametrize("n", [3, S, S + 1, S + W, S + W + 1, S + W + P - 1, S + W + P, S + W + P + 1, 41])
@pytest.mark.parametrize("dtype16", [torch.float32, torch.bfloat16])
def test_prefill_tiers_at_boundaries(n, dtype16):
    model = tiny_model("llama")
    calib = random_calibration(model, spec(sink=S, window=W, page_size=P), clip=(0.9, 0.85))
    ids = torch.randint(0, VOCAB, (2, n), generator=torch.Generator().manual_seed(n))
    with ohf.apply(model, calib, "oscar", window_dtype=dtype16) as h:
        cache = h.cache()
        rec = [_record(cache, i) for i in range(2)]
        model(ids, cache=cache)
        for i in range(2):
            _check(cache, i, rec[i], n, dtype16, (0.9, 0.85))


def test_generation_demotes_page_by_page():
    model = tiny_model("qwen2")
    calib = random_calibration(model, spec(sink=S, window=W, page_size=P), clip=(0.9, 0.85))
    ids = torch.randint(0, VOCAB, (2, 50), generator=torch.Generator().manual_seed(7))
    with ohf.apply(model, calib, "oscar", window_dtype=torch.float32) as h:
        cache = h.cache()
        rec = _record(cache, 1)
        model(ids[:, :6], cache=cache)
        seen_q = set()
        for t in range(6, 50):
            model(ids[:, t: t + 1], cache=cache)
            _check(cache, 1, rec, t + 1, torch.float32, (0.9, 0.85))
            seen_q.add(TierPolicy(S, W, P).quantized(t + 1))
    assert seen_q == {0, 4, 8, 12, 16, 20, 24, 28, 32, 36}  # many pages crossed, one page at a time


def test_tier_policy_is_path_independent():
    pol = TierPolicy(sink=64, window=256, unit=64)
    assert [pol.split(n) for n in (10, 64, 320, 321, 383, 384, 385)] == [
        (10, 0, 0), (64, 0, 0), (64, 0, 256), (64, 0, 257), (64, 0, 319), (64, 64, 256), (64, 64, 257)]
    # incremental rule: the recent window reaches W + U, then its oldest U tokens are demoted
    recent = quant = 0
    for n in range(1, 2000):
        if n > pol.sink:
            recent += 1
        if recent >= pol.window + pol.unit:
            recent -= pol.unit
            quant += pol.unit
        assert pol.split(n) == (min(n, 64), quant, recent)
    assert torch.equal(pol.quantized_t(torch.arange(2000)), torch.tensor([pol.quantized(n) for n in range(2000)]))
