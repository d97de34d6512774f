"""Batched NIAH and long generation through the real oscarkv.hf path (tiny random Llama, identity calibration)."""

import warnings

import pytest
import torch

pytest.importorskip("transformers")

from eval_standins import WordTokenizer, random_text, tiny_llama  # noqa: E402
from oscarkv.artifact import Calibration, ModelIdentity  # noqa: E402
from oscarkv.config import QuantSpec  # noqa: E402
from oscarkv.eval.backend import HFBackend, greedy_generate, greedy_generate_batch  # noqa: E402
from oscarkv.eval.context import EvalContext  # noqa: E402
from oscarkv.eval.store import ResultStore  # noqa: E402
from oscarkv.eval.texts import EvalText  # noqa: E402


NIAH_WORDS = ("Some special magic numbers words are hidden within the following text . Make sure to memorize them "
              "I will quiz you about afterwards The for is : Question What ? Answer grass sky sun green blue yellow "
              "Here we go There and back again")


def _context(tmp_path, name: str = "out") -> EvalContext:
    model = tiny_llama(vocab=256, layers=2)
    spec = QuantSpec(k_clip=0.0, v_clip=0.0, sink=4, window=8, page_size=4, centering=False, composition="none")
    calib = Calibration.identity(ModelIdentity.from_config(model.config), spec)
    tok = WordTokenizer()
    tok(NIAH_WORDS)
    return EvalContext(model=model, tokenizer=tok, model_name="tiny", backend=HFBackend(calib),
                       store=ResultStore(tmp_path / name), text=EvalText("rand", random_text(), {"kind": "test"}),
                       calibration=calib, score_from=12, ref_dir=tmp_path / "ref", progress=False)


@pytest.mark.parametrize("method", ["bf16", "oscar", "naive-int2"])
def test_batched_greedy_equals_one_prompt_at_a_time(tmp_path, method):
    ctx = _context(tmp_path)
    prompts = [w[: n] for w, n in zip(ctx.windows(60, 3), (60, 47, 53))]  # different lengths: left padding
    with warnings.catch_warnings(), ctx.cache(method) as new_cache:
        warnings.simplefilter("ignore")
        alone = [greedy_generate(ctx.model, p, new_cache(), 9, chunk=16) for p in prompts]
        together = greedy_generate_batch(ctx.model, prompts, new_cache(), 9, chunk=16)
    assert together == alone


def test_batched_niah_records_equal_single_ones(tmp_path):
    from oscarkv.eval.niah import Variant, run_niah

    variants = [Variant.parse("single-number-noise"), Variant.parse("multikey-word-noise")]
    runs = {}
    for batch in (1, 3):
        ctx = _context(tmp_path, f"out{batch}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            recs = run_niah(ctx, ["bf16", "oscar"], [200], [0.25, 0.75], variants, 2, chunk=32, batch=batch)
        runs[batch] = {(r["method"], r["key"]): r for r in recs}
    assert len(runs[1]) == len(runs[3]) == 16
    for key, r in runs[1].items():
        assert runs[3][key]["output"] == r["output"] and runs[3][key]["correct"] == r["correct"]
    assert sorted(r["batch"] for r in runs[3].values()) == [2] * 4 + [3] * 12  # 8 samples a method: 3 + 3 + 2
    assert {r["path"] for r in runs[3].values()} == {"torch"}


def test_long_generation_first_divergence_is_where_the_methods_own_decode_leaves_the_trajectory(tmp_path):
    from oscarkv.eval.longgen import run_longgen

    ctx = _context(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        recs = run_longgen(ctx, ["bf16", "naive-int2", "int4-hadamard"], 40, 2, new_tokens=24, bucket=8,
                           path="simulate", batch=2)
        assert run_longgen(ctx, ["bf16", "naive-int2", "int4-hadamard"], 40, 2, new_tokens=24, bucket=8,
                           path="simulate", batch=2) == []
    by = {(r["method"], r["prompt"]): r for r in recs}
    assert len(by) == 6
    trajs = {r["key"]: r["tokens"] for r in ctx.store.records_for("tiny", "rand", "model", "longgen-ref", 40)}
    prompts = ctx.windows(40, 2)
    for (m, i), r in by.items():
        assert r["new_tokens"] == 24 and sum(r["buckets"]["n"]) == 24
        if m == "bf16":
            assert r["kld"] == 0.0 and r["first_div"] == r["ref_first_div"]
            continue
        assert r["kld"] > 0.0
        with ctx.cache(m) as new_cache, torch.inference_mode():
            own = greedy_generate(ctx.model, prompts[i], new_cache(), 24, chunk=40)
        traj = trajs[f"p{i}"]
        d = r["first_div"]
        assert own[:d] == traj[:d]
        if d < 24:
            assert own[d] != traj[d]
    assert min(r["first_div"] for r in recs if r["method"] == "naive-int2") < 24  # not vacuous
