"""KIVI gap (quality.md, "KIVI"): static KIVI variants on SmolLM2, essays window 0 (1024 tokens), KL vs the plain
float32 model over positions >= 320. Keys per channel in groups of 32 tokens (post- or pre-RoPE), values per token
(64-channel rows), 2 bits with fp16 scale/offset, the last 128 tokens in full precision; optionally the first
``sink`` tokens in full precision too. Run: python scripts/experiments/kivi_variants.py"""
import warnings

import torch
from transformers.models.llama import modeling_llama as ml

from oscarkv import models
from oscarkv.eval.metrics import kl_rows
from oscarkv.eval.texts import load_eval_text, tokenize, windows
from oscarkv.quant import dequantize_per_channel, fake_quantize, quantize_per_channel

warnings.simplefilter("ignore")
torch.set_num_threads(1)
model, tok = models.load("smollm2-135m")
ids = windows(tokenize(tok, load_eval_text("essays").text), 1024, 1)[0]
R, G, D = 128, 32, 64
mode = {"k": None, "v": None, "sink": 0, "R": R}


def span(T):
    """Quantized token range [s, e): after the sink, whole groups of 32, the last >= 128 tokens kept."""
    s = mode["sink"]
    return s, s + max(0, ((T - mode["R"] - s) // G) * G)


def quant_keys(k):  # k [B, H, T, d]
    s, e = span(k.shape[2])
    if e > s:
        k = k.clone()
        k[:, :, s:e] = dequantize_per_channel(quantize_per_channel(k[:, :, s:e].float(), bits=2, group_size=G)).to(k.dtype)
    return k


orig = ml.apply_rotary_pos_emb


def rope_hook(q, k, cos, sin, *a, **kw):
    qq, kk = orig(q, k, cos, sin, *a, **kw)
    return qq, (quant_keys(kk) if mode["k"] == "post" else kk)


def kproj_hook(mod, args, out):  # pre-RoPE keys: k_proj output [B, T, H*d]
    if mode["k"] != "pre":
        return out
    B, T, HD = out.shape
    x = out.view(B, T, -1, D).transpose(1, 2)
    return quant_keys(x).transpose(1, 2).reshape(B, T, HD)


def vproj_hook(mod, args, out):
    if mode["v"] is None:
        return out
    B, T, HD = out.shape
    s, e = span(T)
    x = out.view(B, T, -1, D).clone()
    x[:, s:e] = fake_quantize(x[:, s:e].float(), bits=2, group_size=32 if mode["v"] == "g32" else None).to(x.dtype)
    return x.view(B, T, HD)


ml.apply_rotary_pos_emb = rope_hook
for layer in model.model.layers:
    layer.self_attn.k_proj.register_forward_hook(kproj_hook)
    layer.self_attn.v_proj.register_forward_hook(vproj_hook)


def logp():
    with torch.no_grad():
        return torch.log_softmax(model(ids[None], use_cache=False).logits[0, 320:-1].float(), -1)


ref = logp()
VARIANTS = [("post", "token", 0, 128), ("post", "token", 64, 128), ("pre", "token", 0, 128), ("pre", "token", 64, 128),
            ("post", None, 0, 128), ("post", None, 64, 128), (None, "token", 0, 128), (None, "token", 64, 128),
            ("pre", None, 0, 128), ("post", "token", 64, 256), ("pre", "token", 64, 256), ("pre", "g32", 64, 256)]
import sys
for k, v, sink, r in VARIANTS[int(sys.argv[1]) if len(sys.argv) > 1 else 0:]:
    mode.update(k=k, v=v, sink=sink, R=r)
    print(f"keys={k} values={v} sink={sink} residual={r}: KL {kl_rows(ref, logp()).mean().item():.4f}", flush=True)
