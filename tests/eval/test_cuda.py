"""``oscarkv eval --device cuda`` end to end (GPU only): every task, the main methods and oscar-auto, on a tiny
random Llama with head_dim 64 and a small real calibration (page size 16, so the Triton kernels apply).

Stated tolerances, CUDA float32 against the CPU on the same model, calibration and text: the reference PPL to
1e-4 relative (no quantization in it: only the order of float32 sums differs); KLD to 5 % relative or 1e-4
absolute and fidelity's logit error to 5 % relative (a float32 difference can move a value across a
quantization boundary, so a code may differ); top-1 and greedy agreement to 0.05 / 1 token; NIAH bookkeeping
(prompt tokens, physical bits) exactly and at least 80 % of the decoded outputs identical. The Triton extend
kernel (products in float16) against the PyTorch reference: relative error of the final hidden states below
2e-2.
"""

import math
import warnings

import pytest
import torch

pytest.importorskip("transformers")

from e2e_helpers import CONTEXT, METHODS, check_properties, make_tiny, records, run_eval, summary  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def runs(tiny, tmp_path_factory):
    """The same evaluation on the CPU and on CUDA (float32; the caches through the dispatcher's reference on
    CUDA, so this does not depend on the Triton path tested below)."""
    root = tmp_path_factory.mktemp("runs")
    assert run_eval(tiny, root / "cpu") == 0
    assert run_eval(tiny, root / "cuda", "--kernels", "reference", device="cuda") == 0
    return root / "cpu", root / "cuda"


def _close(a: float, b: float, rel: float, abs_: float = 0.0) -> bool:
    return abs(a - b) <= max(rel * max(abs(a), abs(b)), abs_)


def test_cuda_run_has_the_harness_properties_and_says_where_it_ran(runs):
    _, cuda = runs
    s = summary(cuda)
    check_properties(s)
    assert s[("greedy", "bf16", CONTEXT)]["exact"] == 1.0
    for task in ("lm", "niah", "greedy", "fidelity"):
        assert {r["device"] for r in records(cuda, task).values()} == {"cuda"}
    lm = records(cuda, "lm")
    assert all(r["cuda_peak_gib"] > 0 for r in lm.values() if r["method"] != "bf16")
    assert "device cuda" in (cuda / "summary.md").read_text()


def test_cuda_float32_agrees_with_the_cpu(runs):
    cpu, cuda = (summary(p) for p in runs)
    c = CONTEXT
    for m in METHODS:
        a, b = cpu[("lm", m, c)], cuda[("lm", m, c)]
        assert _close(a["ppl_ref"], b["ppl_ref"], 1e-4), (m, a["ppl_ref"], b["ppl_ref"])
        assert _close(a["kld"], b["kld"], 5e-2, 1e-4), (m, a["kld"], b["kld"])
        assert abs(a["top1"] - b["top1"]) <= 0.05, m
        fa, fb = cpu[("fidelity", m, c)], cuda[("fidelity", m, c)]
        assert _close(fa["logit_rel_err"], fb["logit_rel_err"], 5e-2, 1e-6), (m, fa, fb)
        assert abs(cpu[("greedy", m, c)]["first_div"] - cuda[("greedy", m, c)]["first_div"]) <= 1.0, m
    na, nb = (records(p, "niah") for p in runs)
    assert na.keys() == nb.keys()
    for k in na:
        assert na[k]["tokens"] == nb[k]["tokens"] and na[k]["bits_physical"] == nb[k]["bits_physical"], k
    same = sum(na[k]["output"] == nb[k]["output"] for k in na)
    assert same >= 0.8 * len(na), f"{same}/{len(na)} NIAH outputs identical"


def test_cuda_bfloat16_run(tiny, tmp_path):
    out = tmp_path / "out"
    assert run_eval(tiny, out, "--dtype", "bfloat16", "--kernels", "reference", device="cuda") == 0
    s = summary(out)
    check_properties(s)
    assert {r["dtype"] for r in records(out, "lm").values()} == {"bfloat16"}


def test_triton_cache_path_matches_the_reference(tiny):
    """OscarCache on CUDA with the default dispatch (the Triton extend kernel for 2-bit token pages, layer 1 of
    oscar-auto included; its layer 0, 2-bit keys with 4-bit values, falls back to the reference) against the
    dispatcher's PyTorch reference: chunked prefill then decode steps."""
    import oscarkv.hf as hf
    from oscarkv import models
    from oscarkv.artifact import Calibration
    from oscarkv.eval.backend import _cache_kwarg, decoder, output_head

    model, _ = models.load(tiny.model_dir)
    model.cuda()
    calib = Calibration.load(tiny.calib_dir, model=model)
    ids = torch.randint(1, model.config.vocab_size, (1, 300), generator=torch.Generator().manual_seed(0)).cuda()
    body, head = decoder(model), output_head(model)
    kw = _cache_kwarg(body)
    bounds = [0, 64, 128, 192, 256, 288, *range(289, 301)]  # chunked prefill (64, then 32), then 12 decode steps
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for method in ("oscar", "naive-int2", "oscar-auto"):
            hidden = {}
            with hf.apply(model, calib, method) as h, torch.inference_mode():
                for backend in (None, "reference"):
                    cache, outs = h.cache(kernel_backend=backend), []
                    for s, e in zip(bounds[:-1], bounds[1:]):
                        outs.append(body(input_ids=ids[:, s:e], **{kw: cache}, use_cache=True).last_hidden_state[0])
                    hidden[backend] = (torch.cat(outs), cache.nbytes())
            (a, bytes_a), (b, bytes_b) = hidden[None], hidden["reference"]
            err = float((a - b).norm() / b.norm())
            assert math.isfinite(err) and err < 2e-2, (method, err)
            assert bytes_a == bytes_b
            assert (head(a[-12:]).argmax(-1) == head(b[-12:]).argmax(-1)).float().mean() >= 0.75, method


def test_cuda_niah_through_the_triton_kernels(tiny, tmp_path):
    out = tmp_path / "out"
    assert run_eval(tiny, out, methods=["bf16", "naive-int2", "oscar", "oscar-auto"], tasks=["niah"],
                    device="cuda") == 0
    recs = records(out, "niah")
    assert len(recs) == 16 and all(r["protocol"]["kernels"] == "auto" for r in recs.values())
