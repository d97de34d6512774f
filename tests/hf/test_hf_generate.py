"""generate() through the quantized cache: greedy, sampling, left-padded batches."""

import pytest
import torch

import oscarkv.hf as ohf

from hf_helpers import VOCAB, random_calibration, spec, tiny_model


def _setup(arch="llama"):
    model = tiny_model(arch)
    model.generation_config.pad_token_id = 0
    calib = random_calibration(model, spec(sink=4, window=8, page_size=4), clip=(0.9, 0.9))
    return model, calib


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_greedy_generate_matches_simulation(arch):
    """Prefill then decode through generate() = the teacher-forced simulation of the same text."""
    model, calib = _setup(arch)
    ids = torch.randint(1, VOCAB, (1, 14), generator=torch.Generator().manual_seed(0))
    with ohf.apply(model, calib, "oscar", window_dtype=torch.float32) as h:
        cache = h.cache()
        out = model.generate(input_ids=ids, cache=cache, max_new_tokens=24, do_sample=False)
        assert cache.nbytes().quantized_tokens > 0
    with ohf.simulate(model, calib, "oscar", window_dtype=torch.float32, prompt_len=14):
        logits = model(out, use_cache=False).logits
    assert torch.equal(logits[:, 13:-1].argmax(-1), out[:, 14:])


def test_left_padded_batch_equals_single_prompts():
    model, calib = _setup()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, VOCAB, (n,), generator=g) for n in (17, 9, 3)]
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, width - len(p):], mask[b, width - len(p):] = p, 1
    with ohf.apply(model, calib, "oscar", window_dtype=torch.float32) as h:
        cache = h.cache()
        batch = model.generate(input_ids=ids, attention_mask=mask, cache=cache, max_new_tokens=20, do_sample=False)
        layer = cache.layers[0]
        # padding never stored; the last token not fed
        assert layer.store.lens[:len(prompts)] == [len(p) + 20 - 1 for p in prompts]
        singles = [model.generate(input_ids=p[None], cache=h.cache(), max_new_tokens=20, do_sample=False)
                   for p in prompts]
    for b, s in enumerate(singles):
        assert torch.equal(batch[b, width:], s[0, len(prompts[b]):])


def test_sampling_is_reproducible_and_valid():
    model, calib = _setup("qwen2")
    ids = torch.randint(1, VOCAB, (2, 10), generator=torch.Generator().manual_seed(2))
    outs = []
    with ohf.apply(model, calib, "kivi-2") as h:
        for _ in range(2):
            torch.manual_seed(123)
            outs.append(model.generate(input_ids=ids, cache=h.cache(), max_new_tokens=16, do_sample=True,
                                       top_k=20, temperature=0.9))
    assert torch.equal(outs[0], outs[1])
    assert outs[0].shape == (2, 26) and int(outs[0].max()) < VOCAB


def test_num_return_sequences_with_sampling():
    model, calib = _setup()
    ids = torch.randint(1, VOCAB, (1, 6), generator=torch.Generator().manual_seed(3))
    with ohf.apply(model, calib, "oscar") as h:
        out = model.generate(input_ids=ids, cache=h.cache(), max_new_tokens=5, do_sample=True,
                             num_return_sequences=3)
    assert out.shape == (3, 11)


def test_right_padding_is_rejected():
    model, calib = _setup()
    ids = torch.randint(1, VOCAB, (2, 8))
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0
    with ohf.apply(model, calib, "oscar") as h:
        with pytest.raises(ValueError, match="left padding"):
            model(ids, attention_mask=mask, cache=h.cache())


def test_generate_with_chunked_prefill():
    """transformers' prefill_chunk_size: each chunk attends to the earlier ones as stored (same as feeding the
    chunks by hand), also with a left-padded batch."""
    model, calib = _setup("qwen3")
    ids = torch.randint(1, VOCAB, (1, 23), generator=torch.Generator().manual_seed(4))
    with ohf.apply(model, calib, "oscar", window_dtype=torch.float32) as h:
        out = model.generate(input_ids=ids, cache=h.cache(), max_new_tokens=10, do_sample=False,
                             prefill_chunk_size=5)
        cache, seq = h.cache(), ids
        for t in range(0, 23, 5):
            logits = model(ids[:, t: t + 5], cache=cache).logits
        for _ in range(10):
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], 1)
            logits = model(nxt, cache=cache).logits
        assert torch.equal(out, seq)
        mask = torch.ones(2, 23, dtype=torch.long)
        mask[1, :9] = 0
        cache = h.cache()
        model.generate(input_ids=ids.repeat(2, 1), attention_mask=mask, cache=cache, max_new_tokens=4,
                       do_sample=False, prefill_chunk_size=5)
        assert cache.layers[0].store.lens[:2] == [26, 17]
