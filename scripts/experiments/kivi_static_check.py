"""Independent static KIVI check (see quality.md, open issues): KL vs the plain model on essays window 0 of
SmolLM2 for per-channel post-RoPE keys and/or per-token values, all but the last 128 tokens quantized.
Run: python scripts/experiments/kivi_static_check.py"""
import torch, warnings
warnings.simplefilter("ignore")
from oscarkv import models
from oscarkv.quant import quantize_per_channel, dequantize_per_channel, fake_quantize
from oscarkv.eval.texts import load_eval_text, tokenize, windows
from oscarkv.eval.metrics import kl_rows
from transformers.models.llama import modeling_llama as ml
model, tok = models.load("smollm2-135m")
ids = windows(tokenize(tok, load_eval_text("essays").text), 1024, 1)[0]
orig = ml.apply_rotary_pos_emb
mode = {"k": None, "v": None}
R = 128  # full-precision residual at the end (static approximation)
def kq(k):
    T = k.shape[2]; n = ((T - R) // 32) * 32
    if mode["k"] == "channel" and n > 0:
        k = k.clone(); k[:, :, :n] = dequantize_per_channel(quantize_per_channel(k[:, :, :n].float(), bits=2, group_size=32)).to(k.dtype)
    return k
def hook(q, k, cos, sin, *a, **kw):
    qq, kk = orig(q, k, cos, sin, *a, **kw)
    return qq, kq(kk)
ml.apply_rotary_pos_emb = hook
def vhook(mod, args, out):
    if mode["v"] is None: return out
    B, T, D = out.shape; n = ((T - R) // 32) * 32
    x = out.view(B, T, -1, 64).clone()
    g = None if mode["v"] == "token" else 32
    x[:, :n] = fake_quantize(x[:, :n].float(), bits=2, group_size=g).to(x.dtype)
    return x.view(B, T, D)
for layer in model.model.layers: layer.self_attn.v_proj.register_forward_hook(vhook)
def logp():
    with torch.no_grad(): return torch.log_softmax(model(ids[None], use_cache=False).logits[0, 320:-1].float(), -1)
ref = logp()
for k, v in ((None, "token"), (None, "g32"), ("channel", None), ("channel", "token")):
    mode.update(k=k, v=v); print(k, v, round(kl_rows(ref, logp()).mean().item(), 4), flush=True)
