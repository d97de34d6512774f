"""One per-layer artifact with mixed formats (channel and token keys, 2 and 4 bits) gives identical greedy tokens
through the transformers integration (the ``oscarkv generate`` path) and ``oscarkv.LLM``, on a tiny random model,
on SmolLM2-135M and on Qwen2.5-Coder-0.5B (qwen2: biases in the q/k/v projections, 7 query heads per KV head).
(The vLLM plugin's part of the parity runs in its own CI stage, ``scripts/ci_vllm.sh``:
``tests/integrations/vllm/test_engine.py``; the three writers' 2-bit pages are compared bit for bit in
``tests/integrations/vllm/test_core.py``.)"""

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from parity_helpers import mixed_calibration  # noqa: E402

from oscarkv import hf as ohf  # noqa: E402
from oscarkv.artifact import ModelIdentity  # noqa: E402
from oscarkv.cache import TierPolicy  # noqa: E402
from oscarkv.config import QuantSpec  # noqa: E402
from oscarkv.engine import LLM, SamplingParams  # noqa: E402

SPEC = QuantSpec(sink=16, window=16, page_size=16)


def _hf_greedy(model, calib, prompt, n):
    """What ``oscarkv generate`` runs: hf.apply, then transformers' generate with the handle's cache. No
    end-of-sequence token (the engine runs with ``ignore_eos``: an EOS is a token like any other, where
    transformers' ``min_new_tokens`` would mask it)."""
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = None, 0
    with ohf.apply(model, calib, "oscar-auto") as handle, torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             cache=handle.cache(), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def _engine_greedy(model, calib, prompts, n):
    llm = LLM(model, calib, kv="oscar", kv_budget_gb=0.05, max_num_seqs=4)
    assert llm.recipe.method.name == "oscar-auto" and len(set(llm.store.formats)) == 4
    return [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True))]


def test_mixed_formats_same_greedy_tokens_in_transformers_and_engine():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
                      initializer_range=0.3, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    calib = mixed_calibration(ModelIdentity.from_config(cfg), SPEC)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (37, 90)]
    n = 40  # both cross several page demotions of every format, by prefill chunks and by decoding
    want = [_hf_greedy(model, calib, p, n) for p in prompts]
    assert all(len(w) == n for w in want) and _engine_greedy(model, calib, prompts, n) == want


@pytest.mark.slow
def test_mixed_formats_same_greedy_tokens_on_smollm2():
    from oscarkv import models

    try:
        model, tok = models.load("smollm2-135m")
    except Exception as e:  # noqa: BLE001 - the registry package is optional
        pytest.skip(f"SmolLM2 not available: {e}")
    spec = QuantSpec(sink=64, window=64, page_size=64)
    calib = mixed_calibration(ModelIdentity.from_config(model.config), spec, mean_scale=0.0)
    prompts = [tok("The three most important ideas of the paper are")["input_ids"] * 26]  # 234 tokens
    n = 32
    tiers = TierPolicy(spec.sink, spec.window, spec.page_size)
    assert 0 < tiers.quantized(len(prompts[0])) < tiers.quantized(len(prompts[0]) + n)  # 2-bit pages are read
    want = [_hf_greedy(model, calib, p, n) for p in prompts]
    assert _engine_greedy(model, calib, prompts, n) == want


@pytest.mark.slow
def test_mixed_formats_same_greedy_tokens_on_qwen2_5_coder_0_5b():
    """qwen2: biases in the q/k/v projections, 14 query / 2 KV heads of d 64, 24 layers (each format 6 times)."""
    from oscarkv import models

    name = "qwen2.5-coder-0.5b"
    if not models.is_installed(name) and not (models.cached_path(name) / "oscarkv_cache.json").is_file():
        pytest.skip(f"Qwen2.5-Coder-0.5B not available: neither its registry packages (`oscarkv setup --models "
                    f"{name}`) nor its float cache ({models.cached_path(name)}) are there")
    model, tok = models.load(name)
    cfg = model.config
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == ("qwen2", 24,
                                                                                                        14, 2)
    spec = QuantSpec(sink=64, window=64, page_size=64)
    # nonzero means: centering goes through the engine's folding into the q/k/v and o_proj biases
    calib = mixed_calibration(ModelIdentity.from_config(cfg), spec, mean_scale=0.1)
    assert calib.model.head_dim == 64 and model.model.layers[0].self_attn.k_proj.bias is not None
    ids = tok((Path(__file__).parents[1] / "docs" / "method.md").read_text())["input_ids"]
    prompts = [ids[:300]]  # the first of the vLLM stage's prompts (tests/integrations/vllm/test_engine.py)
    n = 32
    tiers = TierPolicy(spec.sink, spec.window, spec.page_size)
    assert 0 < tiers.quantized(300) < tiers.quantized(300 + n)  # 2-bit pages from the prefill and from decoding
    want = [_hf_greedy(model, calib, p, n) for p in prompts]
    assert _engine_greedy(model, calib, prompts, n) == want
