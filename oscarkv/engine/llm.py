"""``oscarkv.LLM``: model + KV store + engine from a model, an optional calibration and an :class:`EngineConfig`;
``submit`` / ``abort`` / ``step`` / ``generate`` / ``stream``, text helpers and gauges."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..artifact import Calibration, ModelIdentity
from ..cache import Paged16Store, PagedStore, geometry_for, policy_for
from ..formats import describe_layers
from .attention import KeyRotation
from .config import EngineConfig
from .core import Engine
from ..cache.monitor import QuantMonitor
from .metrics import Metrics
from .model import ModelConfig, Transformer, fold_value_rotation, from_hf
from .sampling import SamplingParams
from .sequence import Sequence

log = logging.getLogger(__name__)
ENGINE_METHODS = ("oscar", "oscar-auto", "oscar-hadamard", "oscar-noclip")


@dataclass
class Completion:
    """One finished request. ``finish_reason``: "stop", "length", "abort" or "error" (``error`` says why)."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str | None
    error: str | None = None


def identity_of(cfg: ModelConfig) -> ModelIdentity:
    return ModelIdentity(cfg.arch, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size)


def _load_model(model: Any, dtype: torch.dtype | None, device: str | None) -> tuple[Transformer, Any, tuple]:
    """(engine model, tokenizer or None, eos ids) from a name/folder, a transformers model or a Transformer."""
    tok = None
    if isinstance(model, (str, Path)):
        from ..models import load

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


def _prebuild_decode(store: PagedStore, num_q_heads: int, act_dtype: torch.dtype, pdl: bool) -> int:
    """Build the CUDA 2-bit decode kernel's cubins for every batch the store can hold, before the first request
    (a launch otherwise builds its configuration on first use: ~1.7 s of nvcc each on the H200 machine, inside
    that request's step). Queries reach it in the activation or the 16-bit tiers' dtype. Returns how many are
    ready; a failure is logged, and the kernels build on first use."""
    from ..kernels import decode_cuda

    ready = 0
    try:
        pairs = dict.fromkeys((k.fmt, v.fmt) for k, v in zip(store.k_pages, store.v_pages) if k is not None)
        for k_fmt, v_fmt in pairs:  # each layer's (K, V) page formats
            for q_dtype in dict.fromkeys((act_dtype, store.dtype16)):
                ready += len(decode_cuda.prebuild(k_fmt, num_q_heads, q_dtype, store.dtype16, store.num_slots,
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


def _oscar_store(net: Transformer, calib: Calibration, config: EngineConfig, max_len: int, dtype16: torch.dtype,
                 quiet: bool) -> tuple[PagedStore, KeyRotation, Any]:
    """The OSCAR store of ``config.method`` (resolved by :func:`oscarkv.methods.resolve`, the recipe the
    transformers cache uses, so both store the same content); folds the value rotation and mean into ``net``."""
    import warnings

    from .. import methods

    method = config.method or ("oscar-auto" if calib.layer_formats else "oscar")
    base = method.removesuffix(methods.NOCENTER)
    if base not in ENGINE_METHODS:
        raise ValueError(f"the engine's OSCAR cache serves the methods {list(ENGINE_METHODS)} (and their -nocenter "
                         f"variants), got {method!r}; evaluate other baselines with `oscarkv eval`")
    with warnings.catch_warnings():
        if quiet:
            warnings.simplefilter("ignore")
        recipe = methods.resolve(method, calib)
    c = net.cfg
    H, d = c.num_kv_heads, c.head_dim
    eye, zero = torch.eye(d).expand(H, d, d), torch.zeros(H, d)

    def stack(name: str, default: torch.Tensor) -> torch.Tensor:
        return torch.stack([default if getattr(lr, name) is None else getattr(lr, name).float()
                            for lr in recipe.layers])

    fold_value_rotation(net, stack("r_v", eye), stack("mu_v", zero))
    device = next(net.parameters()).device
    rotation = KeyRotation(stack("r_k", eye), stack("mu_k", zero), device)
    store = PagedStore.for_budget(recipe.formats, policy_for(recipe), geometry_for(recipe, H, d),
                                  budget_bytes=int(config.kv_budget_gb * 2**30), num_slots=config.max_num_seqs,
                                  max_len=max_len, dtype16=dtype16, device=device)
    return store, rotation, recipe


class LLM:
    """Batched paged inference with a BF16 or OSCAR (2-bit) KV cache.

    Args:
        model: registry name or folder (:func:`oscarkv.models.load`), a transformers ``*ForCausalLM`` or an
            engine :class:`~oscarkv.engine.model.Transformer`. With ``kv="oscar"`` the model's value
            projections are rotated in place (``fold_value_rotation``).
        calibration: :class:`~oscarkv.artifact.Calibration` or its folder (OSCAR only).
        config: an :class:`EngineConfig` (or a mapping of its fields); ``**options`` override its fields
            (``LLM(model, calib, kv="oscar", kv_budget_gb=2)``). Unknown options are an error.
        tokenizer: for text prompts and stop strings (default: the one loaded with a registry model).
    """

    def __init__(self, model: Any, calibration: Calibration | str | Path | None = None,
                 config: EngineConfig | Mapping[str, Any] | None = None, *, tokenizer: Any = None, **options: Any):
        if isinstance(calibration, (EngineConfig, Mapping)):
            raise ValueError("the second argument of LLM is the calibration; pass the engine options as config=...")
        if config is None or isinstance(config, Mapping):
            config = EngineConfig.from_dict({**(config or {}), **options})
        elif options:
            config = config.replace(**options)
        self.config = cfg = config
        net, tok, eos = _load_model(model, cfg.dtype, cfg.device)
        net.set_gemv(cfg.gemv)
        net.set_pdl(cfg.pdl)
        self.model, self.tokenizer = net, tokenizer or tok
        mc = net.cfg
        max_len = cfg.max_model_len or mc.max_position  # may exceed the trained length (benchmarks, RoPE scaling)
        p = next(net.parameters())
        self.monitor: QuantMonitor | None = None
        self.calibration, self.recipe, rotation = None, None, None
        if cfg.kv == "oscar":
            self.calibration = _calibration(calibration, mc)
            dtype16 = cfg.window_dtype or (p.dtype if p.dtype in (torch.float16, torch.bfloat16) else torch.bfloat16)
            self.store, rotation, self.recipe = _oscar_store(net, self.calibration, cfg, max_len, dtype16,
                                                             quiet=calibration is None)
            if p.device.type == "cuda":
                _prebuild_decode(self.store, mc.num_heads, p.dtype, net.step_pdl(p))
            if cfg.monitor_every > 0:
                self.monitor = self.store.monitor = QuantMonitor(mc.num_layers, cfg.monitor_every)
        else:
            if calibration is not None:
                raise ValueError("a calibration applies to kv='oscar' only; drop it or use kv='oscar'")
            self.store = Paged16Store.for_budget(mc.num_layers, mc.num_kv_heads, mc.head_dim, 64,
                                                 budget_bytes=int(cfg.kv_budget_gb * 2**30),
                                                 num_slots=cfg.max_num_seqs, max_len=max_len, dtype=p.dtype,
                                                 device=p.device)
        eos = cfg.eos_token_ids if cfg.eos_token_ids is not None else eos
        if not eos and self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos = (self.tokenizer.eos_token_id,)
        self.engine = Engine(net, self.store, rotation=rotation, eos_ids=tuple(eos), max_model_len=max_len,
                             max_num_seqs=cfg.max_num_seqs, prefill_chunk=cfg.prefill_chunk,
                             cuda_graphs=cfg.cuda_graphs)
        self.engine.detok = self._hit_stop
        self.metrics = Metrics()
        self._counted = {"generation_tokens_total": 0, "preemptions_total": 0}
        log.info("oscarkv engine: %s", self.describe())

    # ------------------------------------------------------------------------------------ reporting
    def describe(self) -> str:
        """One line: the cache, which layers are quantized and in which formats, physical bits per element."""
        mc, st = self.model.cfg, self.store
        if self.recipe is None:
            return (f"{self.config.kv} cache ({st.dtype}) for all {mc.num_layers} layers, "
                    f"{st.allocator.capacity} pages of {st.page_size} tokens")
        q = self.recipe.quantized_layers
        fmts = {f.label for f in self.recipe.formats if f is not None}
        bits = 8 * PagedStore.page_bytes(st.formats, st.geo) / (2 * st.page_size * len(q) * st.H * st.d)
        return (f"OSCAR {self.recipe.method.name}: quantized layers {describe_layers(q, mc.num_layers)} "
                f"({len(fmts)} format{'s' if len(fmts) > 1 else ''}: {', '.join(sorted(fmts))}), "
                f"{bits:.3f} bits/element in the quantized tier; 16-bit tiers in {st.dtype16} (sink "
                f"{st.policy.sink} + window {st.policy.window}); {st.allocator.capacity} pages of {st.page_size} "
                "tokens")

    # ---------------------------------------------------------------------------------------- text
    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer: pass tokenizer=... or give token ids")
            return list(self.tokenizer.encode(prompt))
        if not isinstance(prompt, (list, tuple)):
            raise ValueError(f"a prompt is a string or a list of token ids, got {type(prompt).__name__}")
        return list(prompt)

    def decode(self, ids: list[int]) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode(ids, skip_special_tokens=True)

    def _hit_stop(self, seq: Sequence) -> bool:
        text = self.decode(seq.out) or ""
        return any(s in text for s in seq.params.stop)

    def text(self, seq: Sequence) -> str | None:
        """The generated text of ``seq``, cut at the first stop string (None without a tokenizer)."""
        text = self.decode(seq.out)
        if text is not None and seq.params.stop:
            cut = [text.find(s) for s in seq.params.stop if s in text]
            text = text[: min(cut)] if cut else text
        return text

    _text = text

    def completion(self, seq: Sequence) -> Completion:
        return Completion(seq.prompt, list(seq.out), self.text(seq), seq.finish_reason, seq.error)

    # ------------------------------------------------------------------------------------ requests
    def _check(self, ids: Any, params: SamplingParams) -> list[int]:
        """Token ids of a request, or a ``ValueError`` saying what is wrong with it."""
        vocab = self.model.cfg.vocab_size
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int)]
        if bad:
            raise ValueError(f"token ids must be ints, got {bad[0]!r}")
        out = [t for t in list(ids) + list(params.stop_token_ids) if not 0 <= t < vocab]
        if out:
            raise ValueError(f"token id {out[0]} is outside the vocabulary [0, {vocab})")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer: pass tokenizer=... or use stop_token_ids")
        return list(ids)

    def submit(self, prompt: str | list[int], params: SamplingParams | None = None, on_token=None) -> Sequence:
        """Queue one request (validated now: a bad prompt or bad parameters raise ``ValueError`` and nothing is
        queued) without running the engine. ``on_token(seq, token)`` is called in the engine's thread."""
        params = params if params is not None else SamplingParams()
        try:
            if not isinstance(params, SamplingParams):
                raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
            seq = Sequence(self._check(self.encode(prompt), params), params, on_token)
            self.engine.add(seq)
        except ValueError:
            self.metrics.inc("requests_rejected_total")
            raise
        self.metrics.inc("requests_total")
        self.metrics.inc("prompt_tokens_total", len(seq.prompt))
        return seq

    def abort(self, seq_id: int) -> bool:
        """Cancel a queued or running request; False if it is not (or no longer) in the engine."""
        found = self.engine.abort(seq_id)
        if found:
            self.metrics.inc("requests_aborted_total")
        return found

    def has_work(self) -> bool:
        return self.engine.has_work()

    def step(self) -> list[Sequence]:
        """One engine step (never raises for a request's failure: that request ends with
        ``finish_reason == "error"``); returns the requests that finished in it."""
        done = self.engine.step()
        for seq in done:
            self.metrics.inc("requests_failed_total" if seq.finish_reason == "error" else "requests_finished_total")
        for counter, now in (("generation_tokens_total", self.engine.stats["generated_tokens"]),
                             ("preemptions_total", self.engine.preemptions)):
            self.metrics.inc(counter, now - self._counted[counter])
            self._counted[counter] = now
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
        st, eng = self.store, self.engine
        running = [s for s in eng.running if s.slot >= 0]
        tokens = sum(st.lens[s.slot] for s in running)
        L, H, d = self.model.cfg.num_layers, st.H, st.d
        elems = tokens * 2 * L * H * d
        pages_used = st.allocator.capacity - st.allocator.num_free
        if isinstance(st, PagedStore):
            page_bytes = PagedStore.page_bytes(st.formats, st.geo)
            used = pages_used * page_bytes + len(running) * st.buf[:, :, 0].numel() * st.buf.element_size()
        else:
            page_bytes = Paged16Store.page_bytes(L, H, d, st.page_size, st.dtype)
            used = pages_used * page_bytes
        return {
            "running_requests": len(eng.running), "waiting_requests": len(eng.waiting),
            "kv_pool_bytes": st.allocated_bytes(), "kv_pool_used_bytes": used,
            "kv_pages_total": st.allocator.capacity, "kv_pages_free": st.allocator.num_free,
            "kv_tokens": tokens, "kv_bits_per_element": 8 * used / elems if elems else 0.0,
            "kv_paged_bits_per_element": 8 * page_bytes / (2 * L * H * d * st.page_size),
            "generation_tokens_per_s": self.metrics.tokens_per_s(eng.stats["generated_tokens"]),
            "preemptions": eng.preemptions,
        }


__all__ = ["LLM", "Completion", "EngineConfig", "SamplingParams", "identity_of"]
