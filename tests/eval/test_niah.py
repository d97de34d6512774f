import pytest
import torch

from eval_standins import CopyBackend, CopyModel, WordTokenizer
from oscarkv.eval.niah import NiahGenerator, Variant, run_niah

ESSAY = " ".join(f"Sentence number {i} talks about topic {i % 17} and other things." for i in range(400))


def test_generator_is_deterministic_by_seed():
    tok = WordTokenizer()
    gen = NiahGenerator(tok, ESSAY)
    v = Variant("multikey", "word", "essay")
    a, b = gen.sample(v, 300, 0.5, seed=3), NiahGenerator(tok, ESSAY).sample(v, 300, 0.5, seed=3)
    assert torch.equal(a.input_ids, b.input_ids) and a.answer == b.answer and a.needles == b.needles
    c = gen.sample(v, 300, 0.5, seed=4)
    assert not torch.equal(a.input_ids, c.input_ids)
    assert len(a.needles) == 4 and len({k for k, _ in a.needles}) == 4


@pytest.mark.parametrize("variant", ["single-number-essay", "single-word-noise", "multikey-number-noise"])
@pytest.mark.parametrize("depth", [0.0, 0.3, 1.0])
def test_sample_fits_length_and_places_needle_at_depth(variant, depth):
    tok = WordTokenizer()
    smp = NiahGenerator(tok, ESSAY).sample(Variant.parse(variant), 400, depth, seed=0)
    n = smp.input_ids.numel()
    assert 300 < n <= 400
    text = tok.decode(smp.input_ids.tolist())
    assert smp.answer in text and text.rstrip().endswith("is :")
    assert abs(smp.needle_token / n - depth) < 0.15
    assert smp.correct(f"  {smp.answer.upper()} .") and not smp.correct("nothing")


def test_variant_parse_rejects_unknown():
    with pytest.raises(ValueError, match="kind-value-haystack"):
        Variant.parse("single-number")
    with pytest.raises(ValueError, match="haystack"):
        Variant.parse("single-number-lorem")


def test_copy_model_finds_planted_needle_and_forgetful_cache_does_not(tiny_context):
    s = tiny_context(model=CopyModel(), backend=CopyBackend(), text=ESSAY)
    s.tokenizer = WordTokenizer()
    recs = run_niah(s, ["bf16", "forgetful"], [200, 400], [0.1, 0.5], [Variant.parse("single-number-essay"),
                    Variant.parse("multikey-word-noise")], samples=2, chunk=64)
    assert len(recs) == 2 * 2 * 2 * 2 * 2
    bf16 = [r["correct"] for r in recs if r["method"] == "bf16"]
    forget = [r["correct"] for r in recs if r["method"] == "forgetful"]
    assert all(bf16) and not any(forget)
    assert run_niah(s, ["bf16"], [200], [0.1], [Variant.parse("single-number-essay")], samples=2,
                    chunk=64) == []
