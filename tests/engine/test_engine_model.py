"""The engine's decoder and BF16 cache against transformers (tiny random models, CPU, float32)."""

import pytest
import torch

from oscarkv.engine import LLM, SamplingParams
from oscarkv.engine.model import from_hf


def hf_greedy(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_matches_transformers_batched(arch, make_hf):
    hf = make_hf(arch)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (1, 7, 33, 70)]
    llm = LLM(hf, kv="bf16", kv_budget_gb=0.01, max_num_seqs=3, prefill_chunk=16)  # chunked + queued
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(hf, p, 10)
        assert o.finish_reason == "length"
    assert llm.store.allocator.num_free == llm.store.allocator.capacity


def test_prefill_logits_match_transformers(make_hf):
    hf = make_hf("qwen3")
    llm = LLM(hf, kv="bf16", kv_budget_gb=0.01, max_num_seqs=2)
    tokens = torch.randint(0, 256, (40,))
    from oscarkv.engine.attention import PrefillCtx

    llm.store.table.add_pages(0, llm.store.allocator.allocate(1))
    ctx = PrefillCtx(llm.store, 0, 0, 40, 16 ** -0.5)
    with torch.no_grad():
        ours = llm.model(tokens, torch.arange(40), ctx)
        theirs = hf(tokens[None]).logits[0]
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_weight_bytes_and_tied_embeddings(make_hf):
    hf = make_hf("llama", tie_word_embeddings=True)
    m = from_hf(hf)
    assert m.lm_head.weight is m.embed.weight
    assert m.weight_bytes() == sum(p.numel() * 4 for p in m.parameters())


def test_gemv_choice_per_batch_rows(make_hf, monkeypatch):
    """"auto" runs the fused Triton GEMV for single-row decode steps only; "triton" up to GEMV_MAX_M rows; "cublas"
    never; and off CUDA (no Triton path) never."""
    from oscarkv.engine import model as model_mod
    from oscarkv.kernels.dispatch import GEMV_MAX_M

    net = from_hf(make_hf("llama"))
    x = lambda m: torch.zeros(m, net.cfg.hidden_size)  # noqa: E731
    assert not net._use_gemv(x(1))  # CPU tensors: no Triton path
    monkeypatch.setattr(model_mod.ops, "uses_kernels", lambda t: True)
    assert net.gemv == "auto" and net._use_gemv(x(1)) and not net._use_gemv(x(2))
    net.set_gemv("triton")
    assert net._use_gemv(x(GEMV_MAX_M)) and not net._use_gemv(x(GEMV_MAX_M + 1))
    net.set_gemv("cublas")
    assert not net._use_gemv(x(1))
    with pytest.raises(ValueError, match="gemv must be one of"):
        net.set_gemv("fast")
