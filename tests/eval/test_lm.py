import torch

from oscarkv.eval.backend import final_hidden, greedy_generate
from oscarkv.eval.fidelity import run_fidelity
from oscarkv.eval.greedy import run_greedy
from oscarkv.eval.lm import run_lm


def test_identical_cache_gives_zero_kld_and_quantized_does_not(tiny_context):
    s = tiny_context()
    recs = run_lm(s, ["bf16", "q2", "q4"], 64, 2)
    by = {(r["method"], r["window"]): r for r in recs}
    assert len(recs) == 6
    for w in (0, 1):
        assert by["bf16", w]["kld"] == 0.0 and by["bf16", w]["top1"] == 1.0
        assert by["bf16", w]["nll"] == by["bf16", w]["nll_ref"]
        assert by["bf16", w]["n"] == 64 - 1 - 8
        assert by["q2", w]["kld"] > by["q4", w]["kld"] > 0.0
    assert (s.ref_dir / "tiny").is_dir() and len(list((s.ref_dir / "tiny").iterdir())) == 2


def test_identical_cache_through_a_second_pass_gives_exactly_zero(tiny_context):
    s = tiny_context()
    s.reference = "fp32"  # the unmodified model; the stand-in's "bf16" stores K/V unchanged
    recs = {r["method"]: r for r in run_lm(s, ["bf16", "q2"], 64, 1)}
    assert recs["bf16"]["kld"] == 0.0 and recs["bf16"]["top1"] == 1.0 and recs["bf16"]["logit_rel_err"] == 0.0
    assert recs["q2"]["kld"] > 0.0


def test_rerun_skips_finished_units(tiny_context):
    s = tiny_context()
    first = run_lm(s, ["bf16", "q2"], 48, 2)
    assert len(first) == 4
    assert run_lm(s, ["bf16", "q2"], 48, 2) == []
    more = run_lm(s, ["bf16", "q2"], 48, 3)  # a third window is new work
    assert sorted((r["method"], r["window"]) for r in more) == [("bf16", 2), ("q2", 2)]
    s2 = tiny_context(score_from=4)  # another protocol: nothing is reused
    assert len(run_lm(s2, ["q2"], 48, 1)) == 1


def test_teacher_forced_pass_matches_decode_through_cache(tiny_context):
    """The stand-in's simulate path gives the logits its cache path gives token by token (the property the
    harness relies on; the real simulate path is tested by its owners)."""
    s = tiny_context()
    ids = s.windows(24, 1)[0]
    head = s.model.get_output_embeddings()
    with torch.inference_mode(), s.backend.simulate(s.model, "q2"):
        tf = head(final_hidden(s.model, ids)).argmax(-1)
    with torch.inference_mode(), s.backend.cache(s.model, "q2") as new_cache:
        cache = new_cache()
        steps = [int(s.model(input_ids=ids[None, : t + 1] if t == 0 else ids[None, t : t + 1], past_key_values=cache,
                             use_cache=True).logits[0, -1].argmax()) for t in range(ids.numel())]
    assert tf.tolist() == steps


def test_greedy_teacher_mode_equals_decode_mode(tiny_context):
    s = tiny_context()
    teacher = run_greedy(s, ["bf16", "q2"], 40, 3, new_tokens=12, mode="teacher")
    decode = run_greedy(s, ["bf16", "q2"], 40, 3, new_tokens=12, mode="decode")
    key = lambda r: (r["method"], r["prompt"])  # noqa: E731
    t = {key(r): r["first_div"] for r in teacher}
    d = {key(r): r["first_div"] for r in decode}
    assert t == d
    assert all(t["bf16", i] == 12 for i in range(3))


def test_greedy_generate_chunked_prefill_matches_single_pass(tiny_context):
    from transformers import DynamicCache

    s = tiny_context()
    ids = s.windows(33, 1)[0]
    a = greedy_generate(s.model, ids, DynamicCache(config=s.model.config), 6, chunk=5)
    b = greedy_generate(s.model, ids, DynamicCache(config=s.model.config), 6, chunk=1000)
    assert a == b and len(a) == 6


def test_fidelity_zero_for_reference_and_per_layer(tiny_context):
    s = tiny_context()
    recs = {r["method"]: r for r in run_fidelity(s, ["bf16", "q2"], 40, 1, max_positions=10)}
    assert recs["bf16"]["attn_rel_err"] == [0.0, 0.0] and recs["bf16"]["logit_rel_err"] == 0.0
    assert len(recs["q2"]["attn_rel_err"]) == 2 and min(recs["q2"]["attn_rel_err"]) > 0
    assert recs["q2"]["positions"] == 10


def test_evaluate_runs_plan_and_writes_report_and_methods_info(tiny_context):
    import json

    from oscarkv.eval.runner import Plan, evaluate

    s = tiny_context()
    out = evaluate(s, Plan(methods=["fp32", "bf16", "q2"], tasks=["kld", "greedy"], contexts=[40], windows=1,
                           greedy_prompts=1, greedy_tokens=4))
    assert out["new_units"] == {"lm@40": 3, "greedy@40": 3}
    info = json.loads((s.store.root / "tiny" / "methods.json").read_text())
    assert info["methods"]["fp32"]["bits"] == 32.0 and info["methods"]["q2"]["bits"] == 4.0
    assert "KLD@40" in open(out["report"]).read()
