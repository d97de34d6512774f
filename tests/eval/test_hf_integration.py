"""The harness on the real oscarkv.hf path (tiny random Llama, identity calibration, small windows)."""

import warnings

import pytest

pytest.importorskip("transformers")

from eval_standins import WordTokenizer, random_text, tiny_llama  # noqa: E402
from oscarkv.artifact import Calibration, ModelIdentity  # noqa: E402
from oscarkv.config import QuantSpec  # noqa: E402
from oscarkv.eval.backend import HFBackend  # noqa: E402
from oscarkv.eval.greedy import run_greedy  # noqa: E402
from oscarkv.eval.lm import run_lm  # noqa: E402
from oscarkv.eval.context import EvalContext  # noqa: E402
from oscarkv.eval.store import ResultStore  # noqa: E402
from oscarkv.eval.texts import EvalText  # noqa: E402



@pytest.fixture
def hf_context(tmp_path):
    model = tiny_llama(vocab=256, layers=2)
    spec = QuantSpec(k_clip=0.0, v_clip=0.0, sink=4, window=8, page_size=4, centering=False, composition="none")
    calib = Calibration.identity(ModelIdentity.from_config(model.config), spec)
    return EvalContext(model=model, tokenizer=WordTokenizer(), model_name="tiny", backend=HFBackend(calib),
                   store=ResultStore(tmp_path / "out"), text=EvalText("rand", random_text(), {"kind": "test"}),
                   calibration=calib, score_from=12, progress=False)


def test_lm_through_hf_simulate(hf_context):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        recs = {r["method"]: r for r in run_lm(hf_context, ["fp32", "bf16", "naive-int2", "int4-hadamard"], 48, 1)}
    assert recs["bf16"]["kld"] == 0.0
    assert 0.0 < recs["fp32"]["kld"] < recs["int4-hadamard"]["kld"] < recs["naive-int2"]["kld"]


def test_greedy_teacher_equals_decode_through_oscar_cache(hf_context):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        methods = ["oscar", "naive-int2"]
        t = {(r["method"], r["prompt"]): r["first_div"] for r in run_greedy(hf_context, methods, 24, 2, new_tokens=16)}
        d = {(r["method"], r["prompt"]): r["first_div"]
             for r in run_greedy(hf_context, methods, 24, 2, new_tokens=16, mode="decode")}
    assert t == d
    assert min(t.values()) < 16  # the quantized methods do diverge somewhere: the comparison is not vacuous


def test_niah_runs_through_chunked_prefill_and_cache(hf_context):
    from oscarkv.eval.niah import Variant, run_niah

    tok = hf_context.tokenizer
    tok("Some special magic numbers words are hidden within the following text . Make sure to memorize them "
        "I will quiz you about afterwards The for is : Question What ? Answer grass sky sun green blue yellow "
        "Here we go There and back again")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        recs = run_niah(hf_context, ["bf16", "oscar"], [120], [0.5], [Variant.parse("single-number-noise")], 1,
                        chunk=32)
    assert len(recs) == 2 and all(r["tokens"] <= 120 and isinstance(r["output"], str) for r in recs)
    by = {r["method"]: r for r in recs}
    assert by["oscar"]["bits_quantized_tier"] == pytest.approx(2.0 + 32 / 16)  # d = 16, fp16 scale + offset
    assert by["oscar"]["bits_physical"] < by["bf16"]["bits_physical"] == pytest.approx(16.0)
