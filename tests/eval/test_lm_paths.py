"""The long-context LM pieces on a tiny model with a real calibration: the cache path against the simulation
with the same chunking, the recorded kernel path, position buckets, physical bits against real caches."""

import warnings

import pytest
import torch

pytest.importorskip("transformers")

from e2e_helpers import make_tiny  # noqa: E402

ALL = ["bf16", "naive-int2", "kivi-2", "int4-hadamard", "oscar", "oscar-auto"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def make_ctx(tiny, tmp_path):
    from oscarkv import models
    from oscarkv.artifact import Calibration
    from oscarkv.eval.backend import HFBackend
    from oscarkv.eval.context import EvalContext
    from oscarkv.eval.store import ResultStore
    from oscarkv.eval.texts import load_eval_text

    def make(kernels: str = "auto"):
        model, tok = models.load(str(tiny.model_dir))
        calib = Calibration.load(tiny.calib_dir, model=model)
        return EvalContext(model=model, tokenizer=tok, model_name="tiny", backend=HFBackend(calib, kernels=kernels),
                           store=ResultStore(tmp_path / "out"), text=load_eval_text(str(tiny.text_file)),
                           calibration=calib, score_from=48, ref_dir=tmp_path / "ref", progress=False)

    return make


@pytest.mark.parametrize("kernels", ["auto", "reference"])
def test_cache_path_equals_simulation_with_the_same_chunks_and_records_its_path(make_ctx, kernels):
    from oscarkv.eval.backend import final_hidden
    from oscarkv.eval.lm import cache_pass

    ctx = make_ctx(kernels)
    wins = ctx.windows(200, 2)
    paths = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for m in ALL:
            hs, info = cache_pass(ctx, m, torch.stack(wins), 16)
            with ctx.simulate(m, chunk=16):
                sim = torch.stack([final_hidden(ctx.model, w) for w in wins])
            assert float((hs - sim).norm() / sim.norm()) < 1e-3, m
            paths[m] = info
    calls = 2 * -(-200 // 16)  # 2 layers x 13 chunks, the batch of 2 windows in one call each
    for m in ALL:
        assert sum(paths[m]["attention"].values()) == calls
    assert paths["bf16"]["path"] == "torch"  # a 16-bit cache: the model's own attention
    if kernels == "auto":  # on the CPU the cache runs its own PyTorch attention
        assert {p["path"] for p in paths.values()} == {"torch"}
    else:  # forced through the dispatcher: its reference (kivi-2's key groups are channel pages)
        assert paths["oscar"]["path"] == paths["naive-int2"]["path"] == paths["kivi-2"]["path"] == "reference"
        assert paths["oscar-auto"]["path"] in ("reference", "mixed")


def test_run_lm_cache_path_buckets_and_physical_bits(make_ctx):
    from oscarkv.eval.lm import run_lm

    ctx = make_ctx()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        recs = run_lm(ctx, ["bf16", "kivi-2", "oscar", "oscar-auto"], 192, 3, bucket=64, path="cache",
                      prefill_chunk=32, batch=2)
        assert run_lm(ctx, ["bf16", "kivi-2", "oscar", "oscar-auto"], 192, 3, bucket=64, path="cache",
                      prefill_chunk=32, batch=2) == []  # resumed: nothing left
    assert len(recs) == 12
    for r in recs:
        bk = r["buckets"]
        assert bk["size"] == 64 and sum(bk["n"]) == r["n"] == 192 - 1 - 48
        assert sum(bk["kl"]) / r["n"] == pytest.approx(r["kld"], rel=1e-9, abs=1e-12)
        assert sum(bk["top1"]) / r["n"] == pytest.approx(r["top1"])
        assert len(r["bits_physical_at"]) == len(bk["n"]) == 3
        if r["method"] == "bf16":
            assert r["kld"] == 0.0 and r["bits_physical_at"] == [16.0, 16.0, 16.0] and r["path"] == "self"
        else:
            assert r["kld"] > 0.0 and r["path"] == "torch"
            assert r["bits_physical_at"][0] > r["bits_physical_at"][-1]  # the 16-bit tiers weigh less later


@pytest.mark.parametrize("method", ["naive-int2", "kivi-2", "int4-hadamard", "oscar", "oscar-auto"])
@pytest.mark.parametrize("tokens", [40, 97, 160])
def test_physical_bits_equal_the_bytes_of_a_real_cache(make_ctx, method, tokens):
    from oscarkv.eval.backend import cache_kwarg, decoder

    ctx = make_ctx()
    ids = ctx.windows(tokens, 1)[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with ctx.cache(method) as new_cache, torch.inference_mode():
            cache = new_cache()
            body = decoder(ctx.model)
            for s in range(0, tokens, 32):
                body(input_ids=ids[None, s: s + 32], **{cache_kwarg(body): cache}, use_cache=True)
            stored = cache.nbytes().bits_per_element
    assert ctx.physical_bits(method, [tokens])[0] == pytest.approx(stored, rel=1e-4)
