"""Tiny random transformers models (built from config objects, no files) and calibrations for the hf tests.

A uniquely named module (not ``conftest``), so that test directories never import each other's helpers."""

from __future__ import annotations

import torch

from oscarkv.artifact import Calibration, ModelIdentity
from oscarkv.config import QuantSpec
from oscarkv.rotation import random_orthogonal

ARCHS = ("llama", "qwen2", "qwen3", "gemma3")
VOCAB = 96


def tiny_model(arch: str, layers: int = 2, seed: int = 0, kv_heads: int = 2, q_heads: int = 4):
    """A float32 eval-mode model with head_dim 16 (Gemma3: layers alternate sliding window 8 / full)."""
    import transformers as tr

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                  num_attention_heads=q_heads, num_key_value_heads=kv_heads, max_position_embeddings=1024)
    torch.manual_seed(seed)
    if arch == "llama":
        model = tr.LlamaForCausalLM(tr.LlamaConfig(**common))
    elif arch == "qwen2":
        model = tr.Qwen2ForCausalLM(tr.Qwen2Config(**common))
    elif arch == "qwen3":
        model = tr.Qwen3ForCausalLM(tr.Qwen3Config(**common, head_dim=16))
    elif arch == "gemma3":
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
        cfg = tr.Gemma3TextConfig(**common, head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
                                  layer_types=types)
        model = tr.Gemma3ForCausalLM(cfg)
    else:
        raise ValueError(arch)
    if arch == "qwen2":  # biases that carry a constant offset, as in the real family
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.k_proj.bias.normal_(0, 0.5)
                layer.self_attn.v_proj.bias.normal_(0, 0.5)
    return model.eval()


def spec(**kw) -> QuantSpec:
    base = dict(k_clip=0.0, v_clip=0.0, sink=4, window=8, page_size=4)
    base.update(kw)
    return QuantSpec(**base)


def random_calibration(model, qspec: QuantSpec | None = None, seed: int = 1, mu_scale: float = 0.3,
                       clip: tuple[float, float] = (0.0, 0.0)) -> Calibration:
    """Random orthogonal R_K / R_V (per layer or per head, as the spec says), random means and fixed clips."""
    qspec = qspec or spec()
    ident = ModelIdentity.from_config(model.config)
    L, H, d = ident.num_layers, ident.num_kv_heads, ident.head_dim
    g = torch.Generator().manual_seed(seed)
    lead = (L, H) if qspec.granularity == "head" else (L,)
    n = 1
    for x in lead:
        n *= x
    rk = torch.stack([random_orthogonal(d, g) for _ in range(n)]).view(*lead, d, d)
    rv = torch.stack([random_orthogonal(d, g) for _ in range(n)]).view(*lead, d, d)
    return Calibration(
        spec=qspec, model=ident, r_k=rk, r_v=rv, eig_k=torch.zeros(*lead, d), eig_v=torch.zeros(*lead, d),
        mu_k=mu_scale * torch.randn(L, H, d, generator=g), mu_v=mu_scale * torch.randn(L, H, d, generator=g),
        k_clip=torch.full((L,), clip[0]), v_clip=torch.full((L,), clip[1]), provenance={"kind": "test-random"},
    )


def identity_calibration(model, qspec: QuantSpec | None = None) -> Calibration:
    return Calibration.identity(ModelIdentity.from_config(model.config),
                                qspec or spec(centering=False, composition="none"))


def decode_logits(model, ids: torch.Tensor, cache, chunk: int = 1, prompt_len: int = 0) -> torch.Tensor:
    """Feed ``ids`` [B, N] through ``cache``: a prompt of ``prompt_len`` in one pass, then ``chunk`` at a time."""
    outs, t = [], 0
    with torch.no_grad():
        if prompt_len:
            outs.append(model(ids[:, :prompt_len], cache=cache).logits)
            t = prompt_len
        while t < ids.shape[1]:
            outs.append(model(ids[:, t: t + chunk], cache=cache).logits)
            t += chunk
    return torch.cat(outs, 1)
