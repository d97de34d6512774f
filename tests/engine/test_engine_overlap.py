"""Decoding one step ahead of the host: step N+1 is launched before step N's tokens are read, the tokens are
those of a loop that reads every token before the next step, and the bookkeeping (stops, lengths, preemption,
slot moves, callbacks) sees every token once, in order."""

import pytest
import torch
from test_engine_oscar import SMALL, make_calib  # noqa: E402  (pytest puts this folder on sys.path)

from oscarkv.cache import Paged16Store, PagedStore
from oscarkv.engine import LLM, SamplingParams
from oscarkv.engine.sampling import sample


def _llm(hf, kv, **kw):
    calib = make_calib(hf, SMALL) if kv == "oscar" else None
    return LLM(hf, calib, kv=kv, window_dtype=torch.float32 if kv == "oscar" else None,
               **{"kv_budget_gb": 0.01, "max_num_seqs": 4, **kw})


def _prompts(lens=(5, 9, 30), seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 256, (n,), generator=g).tolist() for n in lens]


def _read_every_token(llm, prompts, params):
    """The same requests through a loop that decodes one token per model call and reads it before the next call
    (no engine step: the model, the store and the runner driven directly): the tokens an engine must give."""
    eng = llm.engine
    seqs = [llm.submit(p, params) for p in prompts]
    eng.scheduler.admit()
    for seq, n0, n1 in eng.scheduler.prefills():  # one chunk each: the prompts fit prefill_chunk
        logits = eng.runner.prefill(seq, n0, n1)
        eng.store.commit(seq.slot, n1 - n0)
        seq.n_cached, seq.in_prefill = n1, False
        tok = int(logits.argmax())
        seq.out.append(tok)
        eng.runner.set_next_token(seq.slot, tok)
    while any(len(s.out) < params.max_tokens for s in seqs):
        ready = [s for s in seqs if len(s.out) < params.max_tokens]
        for s in ready:
            eng.scheduler.grow(s, s.n_cached + 1)
        logits = eng.runner.decode(ready, eng.runner.batch_size(len(eng.running)))
        eng.store.commit_decode([s.slot for s in ready])
        for s in ready:
            tok = int(logits[s.slot].argmax())
            s.n_cached += 1
            s.out.append(tok)
            eng.runner.set_next_token(s.slot, tok)
    return [list(s.out) for s in seqs]


@pytest.mark.parametrize("kv", ["oscar", "bf16"])
def test_tokens_equal_a_loop_that_reads_every_token(make_hf, kv):
    hf = make_hf("qwen2")
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    want = _read_every_token(_llm(hf, kv), _prompts(), params)
    got = [o.token_ids for o in _llm(hf, kv).generate(_prompts(), params)]
    assert got == want and all(len(t) == 12 for t in got)


def test_next_step_is_launched_before_the_previous_tokens_are_read(make_hf, monkeypatch):
    llm = _llm(make_hf("llama"), "oscar")
    eng, order = llm.engine, []
    decode, receive = eng.runner.decode, eng._receive
    monkeypatch.setattr(eng.runner, "decode", lambda *a: order.append("launch") or decode(*a))
    monkeypatch.setattr(eng, "_receive", lambda *a: order.append("read") or receive(*a))
    seq = llm.submit([1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True))
    llm.step()  # prefill (its token is read at once) and the first decode, launched
    assert order == ["launch"] and len(seq.out) == 1 and seq.in_flight == 1
    llm.step()
    assert order == ["launch", "launch", "read"] and len(seq.out) == 2 and seq.in_flight == 1
    while llm.has_work():
        llm.step()
    # 4 decodes for tokens 2..5: none past max_tokens; the last step only reads
    assert order.count("launch") == 4 and order[-1] == "read" and seq.finish_reason == "length"
    assert len(seq.out) == 5 and seq.in_flight == 0 and eng.in_flight is None


def test_a_token_stop_costs_one_discarded_decode_and_frees_everything(make_hf, monkeypatch):
    hf = make_hf("llama")
    prompt = _prompts((7,))[0]
    free = _llm(hf, "oscar").generate([prompt], SamplingParams(max_tokens=10, ignore_eos=True))[0].token_ids
    stop = free[3]
    cut = free.index(stop) + 1  # the stop token is the output's last
    llm = _llm(hf, "oscar")
    calls = []
    decode = llm.engine.runner.decode
    monkeypatch.setattr(llm.engine.runner, "decode", lambda *a: calls.append(1) or decode(*a))
    seen = []
    seq = llm.submit(prompt, SamplingParams(max_tokens=10, stop_token_ids=(stop,)),
                     on_token=lambda s, t: seen.append(t))
    while llm.has_work():
        llm.step()
    assert seq.finish_reason == "stop" and seq.out == free[:cut] and seen == free[:cut]
    assert len(calls) == cut  # cut - 1 decodes made tokens 2..cut; one more ran before the stop was read
    assert llm.store.allocator.num_free == llm.store.allocator.capacity


def _pool(hf, kv, pages):
    """An engine of 3 slots whose pool holds ``pages`` pages (OSCAR: 4 tokens each besides the 16-bit tiers;
    BF16: 64 tokens each)."""
    if kv == "bf16":
        probe = _llm(hf, kv, max_num_seqs=3).store
        page = Paged16Store.page_bytes(2, probe.H, probe.d, probe.page_size, probe.dtype)
        return _llm(hf, kv, max_num_seqs=3, kv_budget_gb=(pages + 1.5) * page / 2**30)
    probe = _llm(hf, kv, max_num_seqs=3).store
    page = PagedStore.page_bytes(probe.formats, probe.geo)
    fixed = 4 * PagedStore.slot_bytes(len(probe.formats), probe.policy, probe.geo, probe.dtype16)  # 3 + scratch
    return _llm(hf, kv, max_num_seqs=3, kv_budget_gb=(fixed + (pages + 1.5) * page) / 2**30)


@pytest.mark.parametrize("kv,lens,gen,pages", [
    ("oscar", (6, 20, 11, 3, 25), (3, 30, 6, 9, 30), 12),
    ("bf16", (40, 70, 20, 60, 5), (30, 40, 8, 50, 30), 3),
])
def test_slot_moves_and_preemption_with_tokens_in_flight(make_hf, kv, lens, gen, pages):
    """Short requests end while longer ones decode (their slots move down with a token in flight), in a pool
    small enough to preempt. A request never preempted gets the tokens it gets alone; a preempted one too on the
    BF16 cache (its re-prefill recomputes the same K/V), and its full length on OSCAR (re-prefilled tokens are
    quantized as a prefill quantizes them)."""
    hf = make_hf("qwen2")
    prompts = _prompts(lens, seed=8)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in gen]
    alone = [_llm(hf, kv).generate([p], sp)[0].token_ids for p, sp in zip(prompts, params)]
    llm = _pool(hf, kv, pages)
    st = llm.store
    assert pages <= st.allocator.capacity <= pages + 1 and all(st.pages_for(a + b) <= pages for a, b in zip(lens, gen))
    seqs = [llm.submit(p, sp) for p, sp in zip(prompts, params)]
    while llm.has_work():
        llm.step()
    assert llm.engine.preemptions > 0 and st.allocator.num_free == st.allocator.capacity
    assert all(s.finish_reason == "length" and len(s.out) == n for s, n in zip(seqs, gen))
    for s, want in zip(seqs, alone):
        if kv == "bf16" or not s.preemptions:
            assert s.out == want, (s.preemptions, s.out, want)


def test_sample_stays_on_the_device_and_is_exact_for_greedy():
    logits = torch.randn(3, 50)
    params = [SamplingParams(), SamplingParams(temperature=0.7, top_k=5, seed=1), SamplingParams(top_p=0.5)]
    gens = [None, torch.Generator().manual_seed(1), None]
    toks = sample(logits, params, gens)
    assert toks.dtype == torch.long and toks.shape == (3,)
    assert int(toks[0]) == int(logits[0].argmax()) and int(toks[2]) == int(logits[2].argmax())
    assert int(toks[1]) in logits[1].topk(5).indices.tolist()
