"""Greedy trajectories of a model and teacher-forced log-probabilities along them, token by token through a cache:
the measurement of "how far does a cached decode drift from the model's own", used by the transformers-integration
benchmark and tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def reference_trajectory(model, prompt: Tensor, new_tokens: int) -> tuple[Tensor, Tensor]:
    """Greedy continuation of ``prompt`` (``[1, P]`` token ids) by ``model`` with its own cache: the tokens
    ``[new_tokens]`` and their next-token log-probabilities ``[new_tokens, V]`` float32 (row ``i`` is the
    distribution token ``i`` was picked from). Exactly ``new_tokens`` tokens: an end-of-sequence token does not
    stop it."""
    out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, pad_token_id=0)
    return out.sequences[0, prompt.shape[1]:], torch.stack([F.log_softmax(x[0].float(), -1) for x in out.logits])


def forced_logprobs(model, cache, prompt: Tensor, tokens: Tensor) -> Tensor:
    """Prefill ``prompt`` (``[1, P]``) into ``cache`` in one call, then feed ``tokens[:-1]`` one at a time (a real
    decode through the cache, teacher-forced): next-token log-probabilities ``[len(tokens), V]`` float32, row ``i``
    the distribution that token ``i`` is scored against. Mutates ``cache``."""
    rows = [model(prompt, cache=cache).logits[0, -1]]
    for t in tokens[:-1]:
        rows.append(model(t.view(1, 1), cache=cache).logits[0, -1])
    return F.log_softmax(torch.stack(rows).float(), -1)


__all__ = ["forced_logprobs", "reference_trajectory"]
