"""Models that mix sliding-window and full-attention layers: only the full-attention layers are quantized, and
every command says so; reported bits are the physical bits of what is stored (a float32 sliding-window cache
counts 4 bytes an element)."""

import pytest
import torch

import oscarkv.hf as ohf
from oscarkv import methods
from oscarkv.artifact import Calibration, ModelIdentity
from oscarkv.cli.inspect import format_summary
from oscarkv.config import QuantSpec

TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
FMT = {"k": {"layout": "token", "bits": 4, "rotation": "none"}, "v": {"layout": "token", "bits": 2}}


def _model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=512, use_sliding_window=True, sliding_window=24,
                      layer_types=TYPES)
    return Qwen2ForCausalLM(cfg).eval()


def _calib(model):
    ident = ModelIdentity.from_config(model.config)
    calib = Calibration.identity(ident, QuantSpec(sink=4, window=8, page_size=4, k_clip=0.9, v_clip=0.9))
    calib.layer_formats = [FMT] * 4
    return calib


def test_identity_records_layer_types_and_recipes_quantize_full_attention_only(tmp_path):
    model = _model()
    calib = _calib(model)
    assert calib.model.layer_types == tuple(TYPES) and calib.model.full_attention == [False, True, False, True]
    again = Calibration.load(calib.save(tmp_path / "hybrid"), model)
    assert again.model == calib.model
    plain = ModelIdentity("llama", 2, 4, 2, 16, 64)
    assert "layer_types" not in plain.to_dict()  # full-attention artifacts are written as before
    for method in ("oscar", "oscar-auto"):
        r = methods.resolve(method, calib)
        assert r.quantized_layers == [1, 3] and r.formats[0] is None and r.formats[2] is None
    # the bits of the quantized layers only: K 4 + 32/16, V 2 + 32/16 at head_dim 16
    assert methods.resolve("oscar-auto", calib).bits_per_element(16) == pytest.approx(5.0)
    assert "layers 1, 3 of 4 (full attention); the 2 sliding_attention layers are not quantized" in \
        format_summary(calib)


def test_generate_reports_quantized_layers_and_physical_bytes():
    model = _model()
    calib = _calib(model)
    ids = torch.randint(0, 96, (1, 40), generator=torch.Generator().manual_seed(1))
    with ohf.apply(model, calib, "oscar-auto") as h:
        cache = h.cache()
        model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=6, do_sample=False)
        b = cache.nbytes()
        report = cache.memory_report()
    assert cache.quantized_layers == [1, 3] and "quantized layers 1, 3 of 4" in report
    sliding = [cache.layers[i] for i in (0, 2)]
    want = sum(x.keys.numel() * 4 + x.values.numel() * 4 for x in sliding)  # float32 sliding caches, 4 B each
    assert b.used_unquantized == want and "in unquantized layers (float32)" in report
    oscar = sum((cache.layers[i].nbytes() for i in (1, 3)), start=type(b)())
    assert b.used == oscar.used + want and b.bits_per_element == pytest.approx(8 * b.used / b.elements)


def test_engine_refuses_sliding_window_models_naming_the_layers():
    from oscarkv.engine import LLM

    model = _model()
    with pytest.raises(ValueError, match=r"layers \[0, 2\] of this model use sliding-window attention"):
        LLM(model, _calib(model), kv_budget_gb=0.01)
