"""Helpers of the engine tests (imported by name: each test folder's ``conftest`` module shadows the others)."""

import torch


def tiny_hf(arch: str = "llama", seed: int = 0, **kw):
    """A tiny random transformers model (float32) with non-degenerate outputs."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
           "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[arch]
    args = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.2, tie_word_embeddings=False)
    if arch == "qwen3":
        args["head_dim"] = 16
    args.update(kw)
    torch.manual_seed(seed)
    model = cls[1](cls[0](**args)).eval()
    with torch.no_grad():  # visible biases for Qwen2 (centering matters there)
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    return model
