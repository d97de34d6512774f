"""oscar-auto through the transformers integration: a mixed-format cache decodes exactly as the teacher-forced
simulation says, and uniform per-layer formats equal to oscar's give oscar's logits."""

import pytest
import torch

pytest.importorskip("transformers")

import oscarkv.hf as ohf  # noqa: E402
from oscarkv.artifact import Calibration, ModelIdentity  # noqa: E402
from oscarkv.config import QuantSpec  # noqa: E402

VOCAB, D = 96, 16
MIXED = [
    {"k": {"layout": "channel", "bits": 2, "rotation": "none"}, "v": {"layout": "token", "bits": 4,
                                                                       "rotation": "hadamard"}},
    {"k": {"layout": "token", "bits": 2, "rotation": "hadamard", "clip": 0.94},
     "v": {"layout": "token", "bits": 2, "rotation": "calibrated", "clip": 0.9}},
    {"k": {"layout": "channel", "bits": 4, "rotation": "calibrated"}, "v": {"layout": "token", "bits": 2,
                                                                             "rotation": "none"}},
]


def _model():
    import transformers as tr

    torch.manual_seed(0)
    cfg = tr.Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    model = tr.Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.k_proj.bias.normal_(0, 0.5)
            layer.self_attn.v_proj.bias.normal_(0, 0.5)
    return model.eval()


def _calib(model, formats) -> Calibration:
    spec = QuantSpec(k_clip=0.92, v_clip=0.9, sink=4, window=8, page_size=4)
    c = Calibration.identity(ModelIdentity.from_config(model.config), spec, clip=0.92)
    torch.manual_seed(1)
    c.r_k.copy_(torch.linalg.qr(torch.randn(3, D, D))[0])
    c.r_v.copy_(torch.linalg.qr(torch.randn(3, D, D))[0])
    c.mu_k.normal_(0, 0.3)
    c.mu_v.normal_(0, 0.3)
    c.v_clip.fill_(0.9)
    c.layer_formats = formats
    c.validate_shapes()
    return c


def _decode(model, ids, cache):
    import inspect

    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = []
    for t in range(ids.shape[1]):
        out.append(model(ids[:, t: t + 1], **{kw: cache}, use_cache=True).logits)
    return torch.cat(out, 1)


def test_mixed_formats_simulate_equals_decode():
    model = _model()
    calib = _calib(model, MIXED)
    ids = torch.randint(0, VOCAB, (1, 33), generator=torch.Generator().manual_seed(0))
    with ohf.apply(model, calib, "oscar-auto", window_dtype=torch.float32) as h:
        cache = h.cache()
        dec = _decode(model, ids, cache)
        assert cache.nbytes().quantized_tokens > 0
    with ohf.simulate(model, calib, "oscar-auto", window_dtype=torch.float32):
        sim = model(ids, use_cache=False).logits
    torch.testing.assert_close(sim, dec, atol=2e-4, rtol=0)
    with ohf.simulate(model, calib, "oscar", window_dtype=torch.float32):
        plain = model(ids, use_cache=False).logits
    assert (plain - sim).abs().max() > 1e-3  # the formats really differ from oscar's


def test_auto_with_oscar_formats_equals_oscar():
    model = _model()
    same = [{"k": {"layout": "token", "bits": 2, "rotation": "calibrated", "clip": 0.92},
             "v": {"layout": "token", "bits": 2, "rotation": "calibrated", "clip": 0.9}}] * 3
    calib = _calib(model, same)
    ids = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(1))
    outs = []
    for method in ("oscar", "oscar-auto"):
        with ohf.simulate(model, calib, method, window_dtype=torch.float32):
            outs.append(model(ids, use_cache=False).logits)
    torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0)


def test_channel_pages_through_the_kernel_dispatcher_equal_the_cpu_path():
    model = _model()
    same_bits = [{"k": {"layout": "channel", "bits": 2, "rotation": "none"},
                  "v": {"layout": "token", "bits": 2, "rotation": "calibrated", "clip": 0.9}}] + MIXED[1:]
    calib = _calib(model, same_bits)
    ids = torch.randint(0, VOCAB, (1, 29), generator=torch.Generator().manual_seed(2))
    outs = []
    for backend in (None, "reference"):
        with ohf.apply(model, calib, "oscar-auto", window_dtype=torch.float32) as h:
            cache = h.cache(kernel_backend=backend)
            outs.append(_decode(model, ids, cache))
            layer0 = cache.layers[0]
            assert layer0.store.k_pages[0].fmt.channel
            assert layer0._kernels_apply(ids, None, None) == (backend is not None)
    torch.testing.assert_close(outs[0], outs[1], atol=2e-4, rtol=0)
