"""Per-request isolation: a failure while running one request fails that request only (its pages freed, the
others' tokens unchanged), the engine keeps serving, and bad requests are refused at ``submit``."""

import dataclasses
import math

import pytest
import torch
from test_engine_oscar import SMALL, make_calib  # noqa: E402  (pytest puts this folder on sys.path)

from oscarkv.engine import LLM, EngineConfig, SamplingParams

PROMPT_LENS = (5, 9, 30)
PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)


def _prompts():
    g = torch.Generator().manual_seed(4)
    return [torch.randint(1, 256, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _llm(hf, kv):
    calib = make_calib(hf, SMALL) if kv == "oscar" else None
    return LLM(hf, calib, kv=kv, kv_budget_gb=0.01, max_num_seqs=4, window_dtype=torch.float32)


def _inject(llm, monkeypatch, when):
    """Make the model's forward raise whenever ``when(tokens, positions, decode)`` is true."""
    real = llm.model.forward

    def forward(tokens, positions, ctx, last=None):
        if when(tokens, positions, last is None):
            raise RuntimeError("injected fault")
        return real(tokens, positions, ctx, last)

    monkeypatch.setattr(llm.model, "forward", forward)


def _alone(hf, kv, prompts):
    llm = _llm(hf, kv)
    return [llm.generate([p], PARAMS)[0].token_ids for p in prompts]


@pytest.mark.parametrize("kv", ["oscar", "bf16"])
def test_decode_fault_fails_only_its_request(make_hf, monkeypatch, kv):
    hf = make_hf("qwen2")
    prompts = _prompts()
    want = _alone(hf, kv, prompts)
    llm = _llm(hf, kv)
    # position 33 is reached only by the 30-token prompt, in a decode batch with the two others
    _inject(llm, monkeypatch, lambda t, pos, decode: decode and bool((pos == 33).any()))
    outs = llm.generate(prompts, PARAMS)
    assert [o.finish_reason for o in outs] == ["length", "length", "error"]
    assert outs[0].token_ids == want[0] and outs[1].token_ids == want[1]
    # the tokens received before the failing step at position 33 (31 + 2): the one in flight at that step (of
    # position 32) is dropped with the request
    assert outs[2].token_ids == want[2][:3] and "injected fault" in outs[2].error
    assert llm.store.allocator.num_free == llm.store.allocator.capacity  # no leaked pages
    assert llm.metrics.counters["requests_failed_total"] == 1 and llm.engine.stats["errors"] == 1
    again = llm.generate([prompts[0]], PARAMS)[0]  # the engine keeps serving
    assert again.finish_reason == "length" and again.token_ids == want[0]


def test_prefill_fault_and_callback_fault_fail_only_their_request(make_hf, monkeypatch):
    hf = make_hf("llama")
    prompts = _prompts()
    want = _alone(hf, "oscar", prompts)
    llm = _llm(hf, "oscar")
    poison = next(t for t in range(1, 256) if t not in prompts[0] + prompts[2])
    prompts[1][4] = poison
    want[1] = None
    _inject(llm, monkeypatch, lambda t, pos, decode: not decode and bool((t == poison).any()))
    seqs = [llm.submit(p, PARAMS) for p in prompts]

    def bad_callback(seq, tok):
        if len(seq.out) == 5:
            raise ValueError("client went away")

    cb = llm.submit(prompts[0], PARAMS, on_token=bad_callback)
    while llm.has_work():
        llm.step()
    assert [s.finish_reason for s in seqs] == ["length", "error", "length"] and "injected fault" in seqs[1].error
    assert seqs[0].out == want[0] and seqs[2].out == want[2]
    assert cb.finish_reason == "error" and "client went away" in cb.error and cb.out == want[0][:5]
    assert llm.store.allocator.num_free == llm.store.allocator.capacity


def test_retried_decode_step_is_exact(make_hf, monkeypatch):
    """A decode batch that fails once and is retried (halves, then the failing row alone) gives every request the
    tokens it gets without the fault: the failed forward changed nothing the retry reads."""
    hf = make_hf("qwen2")
    prompts = _prompts()
    want = _llm(hf, "oscar").generate(prompts, PARAMS)
    llm = _llm(hf, "oscar")
    calls = {"n": 0}

    def once(tokens, pos, decode):  # fail one decode batch of all three, at a step where one demotes a page
        if decode and (pos == 31).any() and calls["n"] == 0:
            calls["n"] += 1
            return True
        return False

    _inject(llm, monkeypatch, once)
    outs = llm.generate(prompts, PARAMS)
    assert calls["n"] == 1 and [o.finish_reason for o in outs] == ["length"] * 3
    assert [o.token_ids for o in outs] == [w.token_ids for w in want]


@pytest.mark.parametrize("prompt,match", [
    ([1, 2, 10_000_000], "outside the vocabulary"), ([-5, 1, 2], "outside the vocabulary"),
    ([1, True], "must be ints"), ([1.5, 2], "must be ints"), ([[1, 2]], "must be ints"), (5, "a prompt is"),
    (None, "a prompt is"), ([], "empty"), ("text", "need a tokenizer"),
])
def test_bad_prompts_are_refused_at_submit(make_hf, prompt, match):
    llm = _llm(make_hf("llama"), "bf16")
    with pytest.raises(ValueError, match=match):
        llm.submit(prompt, PARAMS)
    assert not llm.has_work() and llm.metrics.counters["requests_rejected_total"] == 1


@pytest.mark.parametrize("kw,match", [
    ({"temperature": math.nan}, "temperature"), ({"temperature": math.inf}, "temperature"),
    ({"top_k": 1e30}, "top_k"), ({"top_p": math.nan}, "top_p"), ({"seed": "abc"}, "seed"),
    ({"stop": [1, 2]}, "stop"), ({"stop": [""]}, "stop"), ({"max_tokens": True}, "max_tokens"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"), ({"ignore_eos": "yes"}, "ignore_eos"),
])
def test_bad_sampling_params_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)


def test_out_of_vocabulary_stop_ids_and_stop_strings_without_tokenizer(make_hf):
    llm = _llm(make_hf("llama"), "bf16")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.submit([1, 2], SamplingParams(stop_token_ids=(999,)))
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        llm.submit([1, 2], SamplingParams(stop=("x",)))
    assert not llm.has_work()


def test_engine_config_is_frozen_and_refuses_unknown_keys(make_hf):
    cfg = EngineConfig(kv="bf16", kv_budget_gb=0.01)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.kv = "oscar"
    with pytest.raises(ValueError, match=r"unknown engine option\(s\) \['kvv'\]; valid options: \['kv'"):
        EngineConfig.from_dict({"kvv": "oscar"})
    with pytest.raises(ValueError, match="unknown engine option"):
        LLM(make_hf("llama"), kv="bf16", kv_budget=1)
    for bad, match in (({"kv": "int2"}, "kv must be"), ({"kv_budget_gb": -1}, "kv_budget_gb"),
                       ({"max_num_seqs": 0}, "max_num_seqs"), ({"gemv": "fast"}, "gemv"),
                       ({"dtype": "int8"}, "dtype"), ({"eos_token_ids": [1.5]}, "eos_token_ids")):
        with pytest.raises(ValueError, match=match):
            EngineConfig(**bad)
    llm = LLM(make_hf("llama"), config=cfg, max_num_seqs=2)  # a config plus overrides
    assert llm.config == cfg.replace(max_num_seqs=2) and llm.store.num_slots == 2
