"""The teacher-forced simulation equals decoding through the real cache (token by token, or chunked)."""

import pytest
import torch

import oscarkv.hf as ohf
from oscarkv.hf.simulation import chunk_starts

from hf_helpers import VOCAB, decode_logits, random_calibration, spec, tiny_model


def _both(model, calib, method, ids, prompt_len=0, chunk=1, window_dtype=torch.float32):
    with ohf.apply(model, calib, method, window_dtype=window_dtype) as h:
        cache = h.cache()
        dec = decode_logits(model, ids, cache, chunk=chunk, prompt_len=prompt_len)
        quantized = cache.nbytes().quantized_tokens
    with ohf.simulate(model, calib, method, window_dtype=window_dtype, prompt_len=prompt_len, chunk=chunk):
        sim = model(ids, use_cache=False).logits
    return sim, dec, quantized


@pytest.mark.parametrize("method", ["oscar", "oscar-nowindow", "kivi-2-nocenter", "int4-hadamard"])
def test_simulate_equals_token_by_token_decode(method):
    model = tiny_model("qwen2")
    calib = random_calibration(model, spec(sink=4, window=8, page_size=4), clip=(0.9, 0.9))
    n = 170 if method.startswith("kivi") else 41
    ids = torch.randint(0, VOCAB, (2, n), generator=torch.Generator().manual_seed(0))
    sim, dec, quantized = _both(model, calib, method, ids)
    assert quantized > 0
    torch.testing.assert_close(sim, dec, atol=2e-4, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("prompt_len,chunk", [(13, 1), (0, 5), (10, 7)])
def test_simulate_equals_prefill_and_chunks(arch, prompt_len, chunk):
    model = tiny_model(arch, layers=2)
    calib = random_calibration(model, spec(sink=3, window=6, page_size=4, granularity="head"), clip=(0.95, 0.9))
    ids = torch.randint(0, VOCAB, (1, 37), generator=torch.Generator().manual_seed(1))
    sim, dec, quantized = _both(model, calib, "oscar", ids, prompt_len, chunk)
    assert quantized > 0
    torch.testing.assert_close(sim, dec, atol=2e-4, rtol=0)


def test_simulate_with_bfloat16_windows_close_to_decode():
    model = tiny_model("llama")
    calib = random_calibration(model, spec(sink=4, window=8, page_size=4))
    ids = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(2))
    sim, dec, _ = _both(model, calib, "oscar", ids, window_dtype=torch.bfloat16)
    # Rare bf16 rounding flips from float32 last-bit differences between one-token and full-sequence projections.
    assert (sim - dec).abs().max() < 5e-2
    assert (sim.argmax(-1) == dec.argmax(-1)).float().mean() > 0.95


def test_simulate_quantization_changes_logits_and_restores_model():
    model = tiny_model("llama")
    calib = random_calibration(model, spec(sink=2, window=4, page_size=2), clip=(0.9, 0.9))
    ids = torch.randint(0, VOCAB, (1, 30), generator=torch.Generator().manual_seed(3))
    ref = model(ids).logits
    with ohf.simulate(model, calib, "naive-int2"):
        sim = model(ids).logits
    assert (sim - ref).abs().max() > 1e-3  # quantization is really simulated
    torch.testing.assert_close(model(ids).logits, ref, atol=0, rtol=0)


def test_simulate_rejects_padding_and_past():
    model = tiny_model("llama")
    calib = random_calibration(model)
    ids = torch.randint(0, VOCAB, (2, 10))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[0, :3] = 0
    with ohf.simulate(model, calib, "oscar"):
        with pytest.raises(ValueError, match="unpadded"):
            model(ids, attention_mask=mask)


def test_chunk_starts():
    assert chunk_starts(8, 3, 2).tolist() == [0, 0, 0, 3, 3, 5, 5, 7]
    assert chunk_starts(4, 0, 1).tolist() == [0, 1, 2, 3]
