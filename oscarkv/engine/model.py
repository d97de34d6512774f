"""Llama / Qwen2 / Qwen3 decoder in plain PyTorch, with fused QKV and gate-up projections.

Weights come from a transformers model, a safetensors folder or random initialisation from a config (for
benchmarks on machines without real weights). An OSCAR calibration's value rotation and mean are folded into
``v_proj`` (stored values are ``(v - mu_v) @ R_V``) and ``o_proj`` (per-head input columns rotated by ``R_V^T``,
``mu_v`` added back through an ``o_proj`` bias), so attention outputs in the rotated basis need no runtime work.
Attention itself is delegated to the KV store (:mod:`oscarkv.cache`) through ``ctx`` (:mod:`oscarkv.engine.attention`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..kernels import dispatch as ops

ARCHS = ("llama", "qwen2", "qwen3")


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and options of a decoder. ``qkv_bias``: Qwen2; ``qk_norm``: Qwen3."""

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    max_position: int = 131072

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"arch must be one of {list(ARCHS)}, got {self.arch!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")

    @classmethod
    def from_hf(cls, cfg: Any) -> "ModelConfig":
        """From a transformers config (``model_type`` llama, qwen2 or qwen3)."""
        cfg = getattr(cfg, "text_config", None) or cfg
        arch = cfg.model_type
        if arch not in ARCHS:
            raise ValueError(f"model type {arch!r} is not supported by the engine; supported: {list(ARCHS)}")
        types = getattr(cfg, "layer_types", None) or ()
        sliding = [i for i, t in enumerate(types) if t != "full_attention"]
        if sliding or (not types and getattr(cfg, "use_sliding_window", False)):
            raise ValueError(f"the engine serves full-attention models; layers {sliding or 'all'} of this model use "
                             "sliding-window attention: run it with `oscarkv generate` (the transformers "
                             "integration quantizes its full-attention layers)")
        if getattr(cfg, "mlp_bias", False):
            raise ValueError("MLP biases are not supported by the engine")
        rope = getattr(cfg, "rope_parameters", None) or {}
        return cls(
            arch=arch, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size, num_layers=cfg.num_hidden_layers,
            num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads or cfg.num_attention_heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
            rms_eps=cfg.rms_norm_eps, rope_theta=float(rope.get("rope_theta", getattr(cfg, "rope_theta", 1e4))),
            tie_embeddings=bool(cfg.tie_word_embeddings),
            qkv_bias=arch == "qwen2" or bool(getattr(cfg, "attention_bias", False)), qk_norm=arch == "qwen3",
            max_position=cfg.max_position_embeddings,
        )


# Published shapes of the Qwen3 models used by the GPU benchmarks (random weights).
PRESETS = {
    "qwen3-8b": ModelConfig("qwen3", 151936, 4096, 12288, 36, 32, 8, 128, 1e-6, 1e6, False, False, True, 40960),
    "qwen3-4b": ModelConfig("qwen3", 151936, 2560, 9728, 36, 32, 8, 128, 1e-6, 1e6, True, False, True, 40960),
    "tiny-llama": ModelConfig("llama", 512, 128, 256, 2, 4, 2, 32, 1e-6, 1e4, True, False, False, 4096),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer, self.cfg = layer, cfg
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, q + 2 * kv, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(q, cfg.hidden_size, bias=False)
        self.sizes = (q, kv, kv)
        if cfg.qk_norm:
            self.q_norm, self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_eps), RMSNorm(cfg.head_dim, cfg.rms_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, ctx: Any, pdl: bool = False) -> Tensor:
        return self.o_proj(self.core(self.qkv(x), cos, sin, ctx, pdl))

    def core(self, qkv: Tensor, cos: Tensor, sin: Tensor, ctx: Any, pdl: bool = False) -> Tensor:
        """From the fused QKV projection to the attention output ``[N, Hq * d]`` (before ``o_proj``). ``pdl``:
        QK-prep and the decode attention as programmatic dependent launches (a decode step's chain)."""
        c = self.cfg
        r_k, mu_k = ctx.rotation(self.layer)
        qn = self.q_norm.weight if c.qk_norm else None
        kn = self.k_norm.weight if c.qk_norm else None
        q, kv = ops.qk_prep(qkv, c.num_heads, c.num_kv_heads, c.head_dim, cos, sin, qn, kn, c.rms_eps, r_k, mu_k,
                            ctx.kv_dest(self.layer), pdl=pdl)
        o = ctx.attention(self.layer, q, kv, pdl=pdl) if pdl else ctx.attention(self.layer, q, kv)
        return o.reshape(qkv.shape[0], -1)  # [N, Hq, d] in the (rotated) value basis


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.attn = Attention(cfg, layer)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.gate_up = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor, residual: Tensor | None, cos: Tensor, sin: Tensor, ctx: Any,
                pdl: bool = False) -> tuple[Tensor, Tensor]:
        """Pre-norm block with the residual add fused into the norms: returns (mlp output, residual). ``pdl``:
        our kernels as programmatic dependents (the cuBLAS projections between them are ordinary launches)."""
        eps = self.input_norm.eps
        h, residual = ops.rmsnorm(x, self.input_norm.weight, eps, residual, pdl=pdl)
        h, residual = ops.rmsnorm(self.attn(h, cos, sin, ctx, pdl), self.post_norm.weight, eps, residual, pdl=pdl)
        return self.down(ops.silu_mul(self.gate_up(h), pdl=pdl)), residual

    def forward_gemv(self, x: Tensor, cos: Tensor, sin: Tensor, ctx: Any, pdl: bool = False) -> Tensor:
        """The same block for a few decode rows with the fused GEMV (``ops.gemv``): the norms and the SiLU gate
        run in the next projection's prologue, the residual adds in the previous one's epilogue. ``x`` is the
        residual stream (input + all earlier outputs); returns the stream after this block. ``pdl``: all seven
        kernels (four GEMVs, QK-prep, the attention's two) are programmatic dependent launches: each may start
        while the one before drains, and a GEMV loads its first weight tile before waiting for its input."""
        eps, a = self.input_norm.eps, self.attn
        qkv = ops.gemv(x, a.qkv.weight, a.qkv.bias, norm=self.input_norm.weight, eps=eps, pdl=pdl)
        o = a.core(qkv, cos, sin, ctx, pdl)
        x = ops.gemv(o, a.o_proj.weight, a.o_proj.bias, residual=x, pdl=pdl)
        gu = ops.gemv(x, self.gate_up.weight, norm=self.post_norm.weight, eps=eps, pdl=pdl)
        return ops.gemv(gu, self.down.weight, act="silu", residual=x, pdl=pdl)


GEMV_BACKENDS = ("auto", "cublas", "triton")
# "auto": the fused Triton GEMV for single-row decode steps only. Measured on the H200 (gemv_probe_h200.log):
# at M = 1 it beats cuBLAS plus separate norm ops (8B step 5.09 vs 5.52 ms of GEMV, 4B 3.38 vs 3.46), at M = 4
# and 8 it loses (8B 5.56 vs 5.26 ms), so larger batches keep cuBLAS.
GEMV_AUTO_MAX_M = 1

class Transformer(nn.Module):
    """``forward(tokens [N], positions [N], ctx, last [M] | None) -> logits [M, vocab]`` (float32).

    ``gemv``: "cublas" (``nn.Linear`` everywhere), "triton" (decode steps of up to ``kernels.dispatch.GEMV_MAX_M``
    rows on CUDA run the fused Triton GEMV, :meth:`Block.forward_gemv`) or "auto" (the default: the Triton GEMV
    for ``GEMV_AUTO_MAX_M`` rows, where it measured faster); prefill and larger batches keep ``nn.Linear``.

    ``pdl`` (``set_pdl``; on by default, ``EngineConfig.pdl``): decode steps on CUDA sm_90+ launch our Triton kernels
    (and the CUDA decode attention) as programmatic dependents, and compute the embedding and RoPE tables in one
    kernel of ours (``ops.embed_rope``) and the logits as float32 in the lm_head GEMV, so that a single-row
    step on the fused GEMV is one chain of PDL kernels. A no-op on CPU and under the Triton interpreter."""

    def __init__(self, cfg: ModelConfig, gemv: str = "auto", pdl: bool = True):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        d = cfg.head_dim
        self.set_rope(1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float) / d)), 1.0)
        self.set_gemv(gemv)
        self.set_pdl(pdl)

    def set_rope(self, inv_freq: Tensor, scaling: float = 1.0) -> None:
        """RoPE frequencies ``[d/2]`` (float32) and attention scaling."""
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        # both halves, so the step computes cos/sin of [N, d] without a cat
        self.register_buffer("inv_freq2", torch.cat((self.inv_freq, self.inv_freq)), persistent=False)
        self.rope_scaling = float(scaling)

    def set_gemv(self, gemv: str) -> None:
        if gemv not in GEMV_BACKENDS:
            raise ValueError(f"gemv must be one of {list(GEMV_BACKENDS)}, got {gemv!r}")
        self.gemv = gemv

    def set_pdl(self, pdl: bool) -> None:
        """Programmatic dependent launch of the decode step's kernels (set before a CUDA graph is captured)."""
        if not isinstance(pdl, bool):
            raise ValueError(f"pdl must be true or false, got {pdl!r}")
        self.pdl = pdl

    def _use_gemv(self, x: Tensor) -> bool:
        if self.gemv == "cublas" or not ops.uses_kernels(x):
            return False

        return x.shape[0] <= (ops.GEMV_MAX_M if self.gemv == "triton" else GEMV_AUTO_MAX_M)

    def step_pdl(self, x: Tensor, last: Tensor | None = None) -> bool:
        """Whether a forward on ``x``'s device runs its kernels as programmatic dependents: ``pdl`` set, a decode
        step (``last is None``) and a device where it exists (:func:`ops.pdl_available`)."""
        return getattr(self, "pdl", False) and last is None and ops.pdl_available(x)

    def forward(self, tokens: Tensor, positions: Tensor, ctx: Any, last: Tensor | None = None) -> Tensor:
        w = self.embed.weight
        pdl = self.step_pdl(w, last)
        if pdl:  # one kernel of ours instead of six torch ops: the step's chain of PDL kernels starts here
            x, cos, sin = ops.embed_rope(tokens, positions, w, self.inv_freq2, self.rope_scaling, pdl=True)
        else:
            x, cos, sin = ops.embed_rope(tokens, positions, w, self.inv_freq2, self.rope_scaling, backend="reference")
        if last is None and self._use_gemv(x):
            for block in self.layers:
                x = block.forward_gemv(x, cos, sin, ctx, pdl)
            logits = ops.gemv(x, self.lm_head.weight, norm=self.norm.weight, eps=self.norm.eps,
                              out_dtype=torch.float32 if pdl else None, pdl=pdl)
            return logits.float()
        residual = None
        for block in self.layers:
            x, residual = block(x, residual, cos, sin, ctx, pdl)
        if last is not None:
            x, residual = x[last], residual[last]
        return self.lm_head(ops.rmsnorm(x, self.norm.weight, self.norm.eps, residual, pdl=pdl)[0]).float()

    def weight_bytes(self) -> int:
        """Bytes of weights one decode step reads (the embedding table is only indexed, unless tied)."""
        seen, total = set(), 0
        for name, p in self.named_parameters():
            if id(p) in seen or (name == "embed.weight" and not self.cfg.tie_embeddings):
                continue
            seen.add(id(p))
            total += p.numel() * p.element_size()
        return total


# --------------------------------------------------------------------------------------------- loading
_HF_NAMES = {  # our name -> HF names concatenated along dim 0
    "attn.qkv.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "attn.qkv.bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    "attn.o_proj.weight": ("self_attn.o_proj.weight",),
    "attn.q_norm.weight": ("self_attn.q_norm.weight",),
    "attn.k_norm.weight": ("self_attn.k_norm.weight",),
    "input_norm.weight": ("input_layernorm.weight",),
    "post_norm.weight": ("post_attention_layernorm.weight",),
    "gate_up.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "down.weight": ("mlp.down_proj.weight",),
}


def _convert_state(cfg: ModelConfig, hf: dict[str, Tensor]) -> dict[str, Tensor]:
    """Map an HF state dict (``model.layers.i.*`` names) onto :class:`Transformer` names."""
    out = {"embed.weight": hf["model.embed_tokens.weight"], "norm.weight": hf["model.norm.weight"]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = hf["lm_head.weight"]
    for i in range(cfg.num_layers):
        for ours, theirs in _HF_NAMES.items():
            names = [f"model.layers.{i}.{n}" for n in theirs]
            if all(n in hf for n in names):
                out[f"layers.{i}.{ours}"] = torch.cat([hf[n] for n in names])
    return out


def from_state_dict(cfg: ModelConfig, state: dict[str, Tensor], dtype: torch.dtype, device: str | torch.device,
                    inv_freq: Tensor | None = None, rope_scaling: float = 1.0) -> Transformer:
    with torch.device("meta"):
        model = Transformer(cfg)
    model = model.to_empty(device=device).to(dtype)
    model.load_state_dict(_convert_state(cfg, state), strict=False, assign=False)
    inv = inv_freq if inv_freq is not None else (
        1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float) / cfg.head_dim)))
    model.set_rope(inv.to(device=device, dtype=torch.float32), rope_scaling)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    _check_loaded(model, state, cfg)
    return model.eval()


def _check_loaded(model: Transformer, state: dict[str, Tensor], cfg: ModelConfig) -> None:
    expected = set(_convert_state(cfg, state))
    missing = [n for n, _ in model.named_parameters() if n not in expected and not n.startswith("lm_head")]
    if missing:
        raise ValueError(f"weights missing for {missing[:5]}{' ...' if len(missing) > 5 else ''}")


def from_hf(hf_model: Any, dtype: torch.dtype | None = None, device: str | torch.device | None = None) -> Transformer:
    """Build from a loaded transformers ``*ForCausalLM`` (weights copied; RoPE frequencies taken as-is)."""
    cfg = ModelConfig.from_hf(hf_model.config)
    p = next(hf_model.parameters())
    rot = hf_model.model.rotary_emb
    return from_state_dict(cfg, hf_model.state_dict(), dtype or p.dtype, device or p.device,
                           rot.inv_freq.float(), float(getattr(rot, "attention_scaling", 1.0)))


def from_folder(path: str | Path, dtype: torch.dtype = torch.bfloat16, device: str = "cpu") -> Transformer:
    """Build from a transformers folder: ``config.json`` + ``*.safetensors``."""
    from safetensors.torch import load_file
    from types import SimpleNamespace

    path = Path(path)
    raw = json.loads((path / "config.json").read_text())
    raw.setdefault("rope_parameters", {"rope_theta": raw.get("rope_theta", 1e4), "rope_type": "default"})
    if raw["rope_parameters"].get("rope_type", "default") != "default":
        raise ValueError("only default RoPE is supported from a folder; load the model with transformers instead")
    cfg = ModelConfig.from_hf(SimpleNamespace(**{"num_key_value_heads": None, "head_dim": None, **raw}))
    state: dict[str, Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        state.update(load_file(str(f)))
    if not state:
        raise FileNotFoundError(f"no .safetensors files in {path}")
    return from_state_dict(cfg, state, dtype, device)


@torch.no_grad()
def random_model(cfg: ModelConfig, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
                 seed: int = 0) -> Transformer:
    """Random weights (std 0.02, unit norms) directly on ``device``: for benchmarks without real weights."""
    with torch.device("meta"):
        model = Transformer(cfg)
    model = model.to_empty(device=device).to(dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.fill_(1.0)
        elif p.ndim == 1:
            p.zero_()
        else:
            p.normal_(0.0, 0.02, generator=gen)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    d = cfg.head_dim
    model.set_rope((1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float) / d))).to(device))
    return model.eval()


@torch.no_grad()
def fold_value_rotation(model: Transformer, r_v: Tensor, mu_v: Tensor) -> None:
    """Fold V centering and rotation into the weights, in place (exact in real arithmetic).

    ``r_v`` ``[L, Hkv, d, d]`` (or ``[L, d, d]``), ``mu_v`` ``[L, Hkv, d]``: afterwards ``v_proj`` yields
    ``(v - mu_v) @ R_V`` and ``o_proj`` maps the rotated attention output back and adds ``mu_v`` as a bias.
    """
    c = model.cfg
    L, H, Hq, d = c.num_layers, c.num_kv_heads, c.num_heads, c.head_dim
    r_v = r_v if r_v.ndim == 4 else r_v.unsqueeze(1).expand(L, H, d, d)
    for i, block in enumerate(model.layers):
        attn = block.attn
        w = attn.qkv.weight
        r, mu = r_v[i].to(w.device, torch.float64), mu_v[i].to(w.device, torch.float64)  # [H, d, d], [H, d]
        q_sz, kv_sz = attn.sizes[0], attn.sizes[1]
        wv = w[q_sz + kv_sz:].double().view(H, d, -1)  # v = x @ wv^T: head h rows
        w[q_sz + kv_sz:] = torch.einsum("hde,hdk->hek", r, wv).reshape(H * d, -1).to(w.dtype)
        bv = attn.qkv.bias[q_sz + kv_sz:].double().view(H, d) if attn.qkv.bias is not None else torch.zeros_like(mu)
        new_bv = torch.einsum("hd,hde->he", bv - mu, r).reshape(-1)
        if attn.qkv.bias is None:
            attn.qkv.bias = nn.Parameter(torch.zeros(w.shape[0], dtype=w.dtype, device=w.device))
        attn.qkv.bias[q_sz + kv_sz:] = new_bv.to(w.dtype)
        kv_of = torch.arange(Hq, device=w.device) // (Hq // H)
        wo = attn.o_proj.weight.double().view(-1, Hq, d)  # columns of query head j
        bias = torch.einsum("ojd,jd->o", wo, mu[kv_of])
        attn.o_proj.weight.copy_(torch.einsum("ojd,jde->oje", wo, r[kv_of]).reshape(wo.shape[0], -1))
        old = attn.o_proj.bias.double() if attn.o_proj.bias is not None else 0.0
        attn.o_proj.bias = nn.Parameter((bias + old).to(w.dtype))


def config_dict(cfg: ModelConfig) -> dict:
    return asdict(cfg)


__all__ = ["ModelConfig", "Transformer", "PRESETS", "from_hf", "from_folder", "from_state_dict", "random_model",
           "fold_value_rotation"]
