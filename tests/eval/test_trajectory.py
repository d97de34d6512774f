"""reference_trajectory / forced_logprobs: teacher-forcing a model along its own greedy trajectory, through a
fresh cache of its own kind, gives back the distributions the trajectory was picked from."""

import pytest
import torch

pytest.importorskip("transformers")

from oscarkv.eval.metrics import kl_rows  # noqa: E402
from oscarkv.eval.trajectory import forced_logprobs, reference_trajectory  # noqa: E402


def _tiny():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      initializer_range=0.3)
    return LlamaForCausalLM(cfg).eval()


def test_forced_along_own_trajectory_reproduces_it():
    from transformers import DynamicCache

    model = _tiny()
    prompt = torch.randint(0, 128, (1, 11), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        tokens, ref = reference_trajectory(model, prompt, 9)
        logp = forced_logprobs(model, DynamicCache(), prompt, tokens)
    assert tokens.shape == (9,) and ref.shape == logp.shape == (9, 128)
    assert torch.equal(logp.argmax(-1), tokens)  # greedy: each token is its row's argmax
    assert kl_rows(ref, logp).max().item() < 1e-5


def test_forced_logprobs_see_the_cache():
    """A cache that forgets the prompt changes the rows: the prefill really goes through the given cache."""
    from transformers import DynamicCache

    model = _tiny()
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, 128, (1, 16), generator=g)
    tokens = torch.randint(0, 128, (5,), generator=g)
    with torch.inference_mode():
        full = forced_logprobs(model, DynamicCache(), prompt, tokens)
        short = forced_logprobs(model, DynamicCache(), prompt[:, -2:], tokens)
    assert kl_rows(full, short).mean().item() > 1e-3
