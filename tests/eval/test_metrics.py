import math

import pytest
import torch

from oscarkv.eval.metrics import first_divergence, kl_rows, perplexity, relative_error, token_stats


def test_kl_rows_zero_for_identical_and_matches_closed_form():
    logp = torch.log_softmax(torch.randn(5, 11), -1)
    assert torch.equal(kl_rows(logp, logp), torch.zeros(5))
    p = torch.tensor([[0.5, 0.5]]).log()
    q = torch.tensor([[0.9, 0.1]]).log()
    expected = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    assert kl_rows(p, q).item() == pytest.approx(expected, rel=1e-6)


def test_kl_rows_ignores_zero_reference_mass():
    p = torch.tensor([[0.0, float("-inf")]])  # p = [1, 0]
    q = torch.tensor([[math.log(0.5), math.log(0.5)]])
    assert kl_rows(p, q).item() == pytest.approx(math.log(2.0))


def test_token_stats_identical_hidden_gives_zero_kl_and_full_agreement():
    head = torch.nn.Linear(8, 13, bias=False)
    h = torch.randn(37, 8)
    tgt = torch.randint(0, 13, (37,))
    st = token_stats(head, h, h.clone(), tgt, chunk=5).means()
    assert st["n"] == 37 and st["kld"] == 0.0 and st["top1"] == 1.0 and st["logit_rel_err"] == 0.0
    assert st["nll"] == pytest.approx(st["nll_ref"])
    manual = -torch.log_softmax(head(h), -1).gather(-1, tgt[:, None]).mean().item()
    assert st["nll"] == pytest.approx(manual, rel=1e-5)


def test_token_stats_chunking_does_not_change_result():
    head = torch.nn.Linear(8, 13, bias=False)
    a, b = torch.randn(20, 8), torch.randn(20, 8)
    tgt = torch.randint(0, 13, (20,))
    one = token_stats(head, a, b, tgt, chunk=20).means()
    many = token_stats(head, a, b, tgt, chunk=3).means()
    assert one["kld"] > 0
    for k in ("kld", "top1", "nll", "logit_rel_err"):
        assert many[k] == pytest.approx(one[k], rel=1e-5)


def test_token_stats_rejects_mismatched_shapes():
    head = torch.nn.Linear(8, 13)
    with pytest.raises(ValueError, match="matching"):
        token_stats(head, torch.randn(4, 8), torch.randn(5, 8), torch.zeros(4, dtype=torch.long))


def test_first_divergence_relative_error_perplexity():
    assert first_divergence([1, 2, 3], [1, 2, 3]) == 3
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2
    x = torch.ones(4)
    assert relative_error(x, x) == 0.0 and relative_error(2 * x, x) == pytest.approx(1.0)
    assert perplexity(0.0, 10) == 1.0 and perplexity(1.0, 0) == float("inf")
