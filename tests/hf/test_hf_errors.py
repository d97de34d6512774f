"""Bad input gives a clear error: nothing runs silently wrong."""

import pytest
import torch

import oscarkv.hf as ohf
from oscarkv.artifact import ArtifactError, UnsupportedModelError
from oscarkv.config import ConfigError
from oscarkv.hf import OscarCache

from hf_helpers import VOCAB, random_calibration, tiny_model


@pytest.fixture
def llama():
    model = tiny_model("llama")
    return model, random_calibration(model)


def test_calibration_of_another_model(llama):
    model, _ = llama
    other = random_calibration(tiny_model("llama", layers=3))
    with pytest.raises(ArtifactError, match="num_layers"):
        ohf.apply(model, other, "oscar")
    assert model.config._attn_implementation != "oscar"


def test_unsupported_architecture():
    import transformers as tr

    gpt2 = tr.GPT2LMHeadModel(tr.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    with pytest.raises(UnsupportedModelError, match="not supported"):
        ohf.apply(gpt2, random_calibration(tiny_model("llama")), "oscar")


def test_unknown_method_and_wrong_target(llama):
    model, calib = llama
    with pytest.raises(ConfigError, match="unknown method"):
        ohf.apply(model, calib, "oscar-int3")
    with pytest.raises(ConfigError, match="gram"):
        ohf.apply(model, calib, "oscar-gram")
    assert not hasattr(model, "_oscarkv_applied")


def test_other_attention_implementation_is_refused(llama):
    model, calib = llama
    ids = torch.randint(0, VOCAB, (1, 5))
    with ohf.apply(model, calib, "oscar") as h:
        cache = h.cache()
        model(ids, cache=cache)
        model.set_attn_implementation("sdpa")
        with pytest.raises(ValueError, match="attn_implementation"):
            model(ids[:, :1], cache=cache)


def test_sealed_keys_refuse_other_attention(llama):
    model, calib = llama
    with ohf.apply(model, calib, "oscar") as h:
        cache = h.cache()
        k = torch.randn(1, 2, 3, 16)
        sk, sv = cache.update(k, k.clone(), 0, kwargs={})
        with pytest.raises(RuntimeError, match="attention function other than oscarkv"):
            torch.matmul(sk, sv.transpose(2, 3))


def test_update_without_forward_kwargs_names_the_transformers_version(llama):
    """transformers <= 5.23 calls cache.update(k, v, layer_idx) without the forward's kwargs: refused, naming the
    first release that passes them (the hf extra's lower bound)."""
    model, calib = llama
    with ohf.apply(model, calib, "oscar") as h:
        cache = h.cache()
        k = torch.randn(1, 2, 3, 16)
        with pytest.raises(TypeError, match=r"transformers >= 5\.24"):
            cache.update(k, k.clone(), 0)


def test_cache_reused_across_models(llama):
    model, calib = llama
    other = tiny_model("llama", seed=5)
    ids = torch.randint(0, VOCAB, (1, 6))
    with ohf.apply(model, calib, "oscar") as h, ohf.apply(other, calib, "oscar"):
        cache = h.cache()
        with pytest.raises(RuntimeError, match="another model"):
            other(ids, cache=cache)
    with ohf.apply(model, calib, "oscar") as h:  # the other model without OSCAR: sealed K/V refuse sdpa
        with pytest.raises(RuntimeError, match="attention function other than oscarkv"):
            other(ids, cache=h.cache())


def test_cache_after_restore_and_batch_mismatch(llama):
    model, calib = llama
    ids = torch.randint(0, VOCAB, (2, 6))
    h = ohf.apply(model, calib, "oscar")
    cache = h.cache()
    model(ids, cache=cache)
    with pytest.raises(ValueError, match="holds 2 sequences"):
        model(ids[:1, :1], cache=cache)
    h.restore()
    with pytest.raises(RuntimeError, match="restored"):
        h.cache()
    with pytest.raises(RuntimeError, match="restored"):
        model(ids[:, :1], cache=cache)


def test_apply_twice_and_from_calibration(llama):
    model, calib = llama
    with pytest.raises(RuntimeError, match="apply"):
        OscarCache.from_calibration(model, calib, "oscar")
    with ohf.apply(model, calib, "oscar"):
        with pytest.raises(RuntimeError, match="already applied"):
            ohf.apply(model, calib, "naive-int2")
        assert isinstance(OscarCache.from_calibration(model, calib, "oscar"), OscarCache)
        with pytest.raises(ValueError, match="another calibration or method"):
            OscarCache.from_calibration(model, calib, "naive-int2")
        with pytest.raises(ValueError, match="another calibration or method"):
            OscarCache.from_calibration(model, random_calibration(model, seed=9), "oscar")


def test_simulate_handle_builds_no_cache(llama):
    model, calib = llama
    with ohf.simulate(model, calib, "oscar") as h:
        with pytest.raises(RuntimeError, match="simulate"):
            h.cache()


def test_beam_search_is_refused(llama):
    model, calib = llama
    model.generation_config.pad_token_id = 0
    ids = torch.randint(1, VOCAB, (1, 5))
    with ohf.apply(model, calib, "oscar") as h:
        with pytest.raises(NotImplementedError, match="beam"):
            model.generate(input_ids=ids, cache=h.cache(), num_beams=2, max_new_tokens=3, do_sample=False)
