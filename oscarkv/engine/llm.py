"""``oscarkv.LLM``: build model + pool + engine from a model and an optional calibration; ``generate`` and
``stream``."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence as Seq

import torch

from ..artifact import Calibration, ModelIdentity
from ..config import QuantSpec
from .core import Engine, Sequence
from .kv import CacheConfig, KVPool, OscarPool, make_pool
from .metrics import Metrics, QuantMonitor
from .model import GEMV_BACKENDS, ModelConfig, Transformer, fold_value_rotation, from_hf
from .sampling import SamplingParams

log = logging.getLogger(__name__)


@dataclass
class Completion:
    """One finished request. ``finish_reason``: "stop", "length" or "abort"."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str | None


def identity_of(cfg: ModelConfig) -> ModelIdentity:
    return ModelIdentity(cfg.arch, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size)


def _load_model(model: Any, dtype: torch.dtype | None, device: str | None) -> tuple[Transformer, Any, tuple]:
    """(engine model, tokenizer or None, eos ids) from a name/folder, a transformers model or a Transformer."""
    tok = None
    if isinstance(model, (str, Path)):
        from ..models import load  # noqa: PLC0415

        model, tok = load(model)
    if isinstance(model, Transformer):
        if dtype is not None or device is not None:
            model = model.to(device=device or next(model.parameters()).device, dtype=dtype)
        return model, tok, ()
    if not hasattr(model, "config") or not hasattr(model, "state_dict"):
        raise TypeError(f"model must be a name, a folder, a transformers model or an engine Transformer, "
                        f"got {type(model).__name__}")
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None) or model.config.eos_token_id
    eos = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
    return from_hf(model, dtype=dtype, device=device), tok, eos


def _prebuild_decode(pool: OscarPool, num_q_heads: int, act_dtype: torch.dtype, pdl: bool) -> int:
    """Build the CUDA 2-bit decode kernel's cubins for every batch the pool can hold, before the first request
    (a launch otherwise builds its configuration on first use: ~1.7 s of nvcc each on the H200 machine, inside
    that request's step). Queries reach it in the activation or the pool's dtype (the same for 16-bit models).
    Returns how many are ready; a failure is logged, and the kernels build on first use."""
    from ..kernels import decode_cuda  # noqa: PLC0415

    ready = 0
    try:
        for k_fmt, v_fmt in dict.fromkeys(pool.formats):  # each layer's (K, V) pool formats
            for q_dtype in dict.fromkeys((act_dtype, pool.dtype)):
                ready += len(decode_cuda.prebuild(k_fmt, num_q_heads, q_dtype, pool.dtype, pool.max_slots,
                                                  v_fmt=v_fmt, pdl=pdl))
    except Exception as e:  # noqa: BLE001 - a start-up optimisation must not stop the engine
        log.warning("the CUDA decode kernel was not built at start (%s); it builds on first use", str(e)[:300])
    return ready


def _calibration(calib: Calibration | str | Path | None, cfg: ModelConfig) -> Calibration:
    ident = identity_of(cfg)
    if calib is None:
        log.warning("no calibration given: the OSCAR cache uses identity rotations and no centering; "
                    "run `oscarkv calibrate` for the method's accuracy")
        return Calibration.identity(ident)
    if not isinstance(calib, Calibration):
        calib = Calibration.load(calib)
    calib.check_model(ident)
    return calib


ENGINE_METHODS = ("oscar", "oscar-auto", "oscar-hadamard", "oscar-noclip")


def _oscar_cache(net: Transformer, calib: Calibration, method: str | None, quiet: bool = False) -> tuple[CacheConfig, dict]:
    """Cache geometry and pool tensors of an OSCAR ``method`` (resolved by :func:`oscarkv.methods.resolve`, the
    same recipe as the transformers cache); folds the value rotation and mean into ``net`` in place."""
    import warnings  # noqa: PLC0415

    from .. import methods  # noqa: PLC0415

    method = method or ("oscar-auto" if calib.layer_formats else "oscar")
    base = method[: -len(methods.NOCENTER)] if method.endswith(methods.NOCENTER) else method
    if base not in ENGINE_METHODS:
        raise ValueError(f"the engine's OSCAR cache serves the methods {list(ENGINE_METHODS)} (and their -nocenter "
                         f"variants), got {method!r}; evaluate other baselines with `oscarkv eval`")
    with warnings.catch_warnings():
        if quiet:
            warnings.simplefilter("ignore")
        recipe = methods.resolve(method, calib)
    spec: QuantSpec = calib.spec
    c = net.cfg
    L, H, d = c.num_layers, c.num_kv_heads, c.head_dim
    eye, zero = torch.eye(d).expand(H, d, d), torch.zeros(H, d)
    centering = spec.centering and recipe.method.centering

    def stack(name: str, default: torch.Tensor) -> torch.Tensor:
        vals = [getattr(lr, name) for lr in recipe.layers]
        return torch.stack([default if v is None or (name.startswith("mu") and not centering) else v.float()
                            for v in vals])

    r_k, r_v, mu_k, mu_v = stack("r_k", eye), stack("r_v", eye), stack("mu_k", zero), stack("mu_v", zero)
    fold_value_rotation(net, r_v, mu_v)
    tuples = tuple((f.k.bits, f.v.bits, f.k.layout) for f in recipe.formats)
    bits = tuples[0][0]
    formats = None if all(t == (bits, bits, "token") for t in tuples) else tuples
    cache = CacheConfig("oscar", recipe.page_size, recipe.sink, recipe.window, bits, recipe.group_size,
                        recipe.meta_dtype, layer_formats=formats)
    clips = torch.tensor([[lr.k_clip for lr in recipe.layers], [lr.v_clip for lr in recipe.layers]])
    return cache, dict(r_k=r_k, mu_k=mu_k, k_clip=clips[0], v_clip=clips[1])


class LLM:
    """Batched paged inference with a BF16 or OSCAR (2-bit) KV cache.

    Args:
        model: registry name or folder (:func:`oscarkv.models.load`), a transformers ``*ForCausalLM`` or an
            engine :class:`~oscarkv.engine.model.Transformer`. With ``kv="oscar"`` the model's value
            projections are rotated in place (``fold_value_rotation``).
        calibration: :class:`~oscarkv.artifact.Calibration` or its folder (OSCAR only).
        kv: "oscar" or "bf16".
        kv_budget_gb: bytes of the KV pool (all layers; 16-bit windows included), in GiB.
        max_num_seqs: concurrent sequences (slots); max_model_len: longest sequence (default: the model's).
        method: the OSCAR method the cache stores (:mod:`oscarkv.methods`): default "oscar-auto" when the
            calibration selected per-layer formats (``layer_formats``), else "oscar".
        window_dtype: dtype of OSCAR's 16-bit tiers (default: the model's if 16-bit, else bfloat16, as in
            :mod:`oscarkv.hf`). The "bf16" cache stores the model's dtype (float32 models on CPU keep float32,
            so outputs equal transformers' exactly).
        gemv: "auto" (default: single-sequence decode steps on CUDA run the fused Triton GEMV, larger ones
            cuBLAS, as measured fastest), "cublas", or "triton" (decode steps of up to 8 sequences run the fused
            Triton GEMV: norms, SiLU gate, bias and residual adds inside the projections; docs/engine.md).
        pdl: programmatic dependent launch of the decode step's kernels on CUDA sm_90+ (each kernel may start
            while the previous one drains; a GEMV loads its first weight tile before waiting for its input;
            inside the captured CUDA graphs these are programmatic edges). ``None`` (default): ``$OSCARKV_PDL``
            ("1" / "0"), on when unset. A no-op on CPU. See :meth:`Transformer.set_pdl`.
    """

    def __init__(self, model: Any, calibration: Calibration | str | Path | None = None, kv: str = "oscar",
                 kv_budget_gb: float = 1.0, *, tokenizer: Any = None, max_num_seqs: int = 16,
                 max_model_len: int | None = None, prefill_chunk: int = 2048, dtype: torch.dtype | None = None,
                 device: str | None = None, cuda_graphs: bool = True, monitor_every: int = 4,
                 eos_token_ids: Seq[int] | None = None, window_dtype: torch.dtype | None = None,
                 method: str | None = None, gemv: str = "auto", pdl: bool | None = None):
        if kv not in ("oscar", "bf16"):
            raise ValueError(f"kv must be 'oscar' or 'bf16', got {kv!r}")
        if gemv not in GEMV_BACKENDS:
            raise ValueError(f"gemv must be one of {list(GEMV_BACKENDS)}, got {gemv!r}")
        net, tok, eos = _load_model(model, dtype, device)
        net.set_gemv(gemv)
        net.set_pdl(pdl)
        self.model, self.tokenizer = net, tokenizer or tok
        cfg = net.cfg
        max_len = max_model_len or cfg.max_position  # may exceed the trained length (benchmarks, RoPE scaling)
        p = next(net.parameters())
        calib_tensors = None
        self.monitor: QuantMonitor | None = None
        if kv == "oscar":
            calib = _calibration(calibration, cfg)
            cache, calib_tensors = _oscar_cache(net, calib, method, quiet=calibration is None)
            self.calibration = calib
        else:
            cache, self.calibration = CacheConfig("bf16", page_size=64), None
        pool_dtype = p.dtype
        if kv == "oscar":
            pool_dtype = window_dtype or (p.dtype if p.dtype in (torch.float16, torch.bfloat16) else torch.bfloat16)
        self.pool: KVPool = make_pool(cache, num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
                                      head_dim=cfg.head_dim, budget_bytes=int(kv_budget_gb * 2**30),
                                      max_slots=max_num_seqs, max_len=max_len, dtype=pool_dtype, device=p.device,
                                      calib=calib_tensors)
        if isinstance(self.pool, OscarPool):
            self.pool.n_q_heads = cfg.num_heads
            if p.device.type == "cuda":
                _prebuild_decode(self.pool, cfg.num_heads, p.dtype, net.step_pdl(p))
        if isinstance(self.pool, OscarPool) and monitor_every > 0:
            self.monitor = self.pool.monitor = QuantMonitor(cfg.num_layers, monitor_every)
        fmts = self.pool.cfg.layer_formats or ()
        if cuda_graphs and p.device.type == "cuda" and any(4 in f[:2] for f in fmts):
            # 4-bit pages decode through the PyTorch reference (no Triton/CUDA 4-bit decode yet): not capturable
            log.warning("the calibration selects 4-bit layers, whose decode runs the reference op: CUDA graphs off")
            cuda_graphs = False
        eos = tuple(eos_token_ids) if eos_token_ids is not None else eos
        if not eos and self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos = (self.tokenizer.eos_token_id,)
        self.engine = Engine(net, self.pool, eos_ids=eos, max_model_len=max_len, prefill_chunk=prefill_chunk,
                             cuda_graphs=cuda_graphs)
        self.engine.detok = self._hit_stop
        self.metrics = Metrics()

    # ---------------------------------------------------------------------------------------- text
    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer: pass tokenizer=... or give token ids")
            return list(self.tokenizer.encode(prompt))
        return [int(t) for t in prompt]

    def decode(self, ids: list[int]) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode(ids, skip_special_tokens=True)

    def _hit_stop(self, seq: Sequence) -> bool:
        text = self.decode(seq.out) or ""
        return any(s in text for s in seq.params.stop)

    def _text(self, seq: Sequence) -> str | None:
        text = self.decode(seq.out)
        if text is not None and seq.params.stop:
            cut = [text.find(s) for s in seq.params.stop if s in text]
            text = text[: min(cut)] if cut else text
        return text

    def completion(self, seq: Sequence) -> Completion:
        return Completion(seq.prompt, list(seq.out), self._text(seq), seq.finish_reason)

    # ------------------------------------------------------------------------------------ generate
    def submit(self, prompt: str | list[int], params: SamplingParams | None = None, on_token=None) -> Sequence:
        """Queue one request (validated now) without running the engine."""
        seq = Sequence(self.encode(prompt), params or SamplingParams(), on_token)
        try:
            self.engine.add(seq)
        except ValueError:
            self.metrics.inc("requests_rejected_total")
            raise
        self.metrics.inc("requests_total")
        self.metrics.inc("prompt_tokens_total", len(seq.prompt))
        return seq

    def abort(self, seq_id: int) -> bool:
        """Cancel a queued or running request (``finish_reason`` "abort", its pages and slot freed); False if it
        is not (or no longer) in the engine."""
        return self.engine.abort(seq_id)

    def step(self) -> list[Sequence]:
        done = self.engine.step()
        for seq in done:
            self.metrics.inc("requests_finished_total")
        return done

    def generate(self, prompts: str | list, params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[Completion]:
        """Run all prompts (strings or token-id lists) to completion, batched; results in prompt order."""
        single = isinstance(prompts, str) or (prompts and isinstance(prompts[0], int))
        prompts = [prompts] if single else list(prompts)
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(plist)} sampling params for {len(prompts)} prompts")
        seqs = [self.submit(p, sp) for p, sp in zip(prompts, plist)]
        while self.engine.has_work():
            self.step()
        return [self.completion(s) for s in seqs]

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None) -> Iterator[int]:
        """Yield token ids of one request as they are generated (runs the engine in this thread)."""
        seq = self.submit(prompt, params)
        sent = 0
        while seq.finish_reason is None and self.engine.has_work():
            self.step()
            while sent < len(seq.out):
                sent += 1
                yield seq.out[sent - 1]

    # ------------------------------------------------------------------------------------- metrics
    def gauges(self) -> dict[str, float]:
        pool, eng = self.pool, self.engine
        tokens = sum(pool.lens[s.slot] for s in eng.running if s.slot >= 0)
        elems = tokens * 2 * pool.L * pool.H * pool.d
        used = pool.used_bytes()
        return {
            "running_requests": len(eng.running), "waiting_requests": len(eng.waiting),
            "kv_pool_bytes": pool.nbytes(), "kv_pool_used_bytes": used,
            "kv_pages_total": pool.alloc.capacity, "kv_pages_free": pool.alloc.num_free,
            "kv_tokens": tokens, "kv_bits_per_element": 8 * used / elems if elems else 0.0,
            "kv_paged_bits_per_element": 8 * pool.bytes_per_token_paged() / (2 * pool.L * pool.H * pool.d),
            "generation_tokens_per_s": self.metrics.tokens_per_s(eng.stats["generated_tokens"]),
            "preemptions": eng.stats["preemptions"],
        }


__all__ = ["LLM", "Completion", "SamplingParams"]
