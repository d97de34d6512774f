"""Helpers for the calibration tests (a unique module name, unlike conftest): tiny random models, an
independent q/k/v capture and a tiny word-level tokenizer."""

from __future__ import annotations

import importlib

import torch

ARCHS = ("llama", "qwen2", "qwen3", "gemma3")
VOCAB = 96


def tiny_model(arch: str, layers: int = 2, seed: int = 0, head_dim: int = 16, kv_heads: int = 2, q_heads: int = 4):
    """A float32 eval-mode model (Gemma3: layers alternate sliding window 8 / full; Qwen2: offset biases)."""
    import transformers as tr

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                  num_attention_heads=q_heads, num_key_value_heads=kv_heads, max_position_embeddings=1024,
                  head_dim=head_dim)
    torch.manual_seed(seed)
    if arch == "llama":
        model = tr.LlamaForCausalLM(tr.LlamaConfig(**common))
    elif arch == "qwen2":
        model = tr.Qwen2ForCausalLM(tr.Qwen2Config(**common))
    elif arch == "qwen3":
        model = tr.Qwen3ForCausalLM(tr.Qwen3Config(**common))
    elif arch == "gemma3":
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
        cfg = tr.Gemma3TextConfig(**common, sliding_window=8, query_pre_attn_scalar=16, layer_types=types)
        model = tr.Gemma3ForCausalLM(cfg)
    else:
        raise ValueError(arch)
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
                proj.weight.normal_(0, 0.3)  # larger than the init so attention is far from uniform
            if arch == "qwen2":
                attn.k_proj.bias.normal_(0, 1.0)
                attn.v_proj.bias.normal_(0, 1.0)
            for norm in ("q_norm", "k_norm"):
                if hasattr(attn, norm):
                    getattr(attn, norm).weight.normal_(0.5, 0.3)
    return model.eval()


def capture_qkv(model, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Post-RoPE, post-QK-norm ``(q [Hq,T,d], k [Hkv,T,d], v [Hkv,T,d])`` per layer, recomputed from each attention
    module's weights, norms and the modeling file's ``apply_rotary_pos_emb`` (not through the attention interface)."""
    out = []
    handles = []

    def pre_hook(module, args, kwargs):
        h = kwargs.get("hidden_states", args[0] if args else None)
        cos, sin = kwargs["position_embeddings"]
        shape = (*h.shape[:-1], -1, module.head_dim)
        q = module.q_proj(h).view(shape).transpose(1, 2)
        k = module.k_proj(h).view(shape).transpose(1, 2)
        v = module.v_proj(h).view(shape).transpose(1, 2)
        if hasattr(module, "q_norm"):
            q, k = module.q_norm(q), module.k_norm(k)
        rope = importlib.import_module(type(module).__module__).apply_rotary_pos_emb
        q, k = rope(q, k, cos, sin)
        out.append((q[0].detach().clone(), k[0].detach().clone(), v[0].detach().clone()))

    for layer in model.model.layers:
        handles.append(layer.self_attn.register_forward_pre_hook(pre_hook, with_kwargs=True))
    try:
        with torch.no_grad():
            model(input_ids=ids.view(1, -1))
    finally:
        for hd in handles:
            hd.remove()
    return out


def eager_attention_probs(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """Softmax attention probabilities ``[Hq, T, T]`` per layer from an eager run with ``output_attentions``."""
    previous = model.config._attn_implementation
    model.config._attn_implementation = "eager"
    try:
        with torch.no_grad():
            out = model(input_ids=ids.view(1, -1), output_attentions=True)
    finally:
        model.config._attn_implementation = previous
    return [a[0].double() for a in out.attentions]


def word_tokenizer(chat: bool = False):
    """A word-level fast tokenizer over a small vocabulary (ids < VOCAB); ``<s>`` is prepended as BOS."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>", "<u>", "</u>"] + [f"w{i}" for i in range(VOCAB - 5)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    if chat:
        fast.chat_template = "{% for m in messages %}<u> {{ m['content'] }} </u>{% endfor %}"
    return fast


def word_text(n_words: int, seed: int = 0) -> str:
    g = torch.Generator().manual_seed(seed)
    return " ".join(f"w{i}" for i in torch.randint(0, VOCAB - 5, (n_words,), generator=g).tolist())
