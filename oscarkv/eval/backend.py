"""How the harness runs a model under a KV-cache method.

The harness needs two things from a method, and nothing else:

* ``simulate(model, method, prompt_len=0, chunk=1)``: a context manager under which ONE full forward pass gives, at
  every position, the logits a token-by-token decode through the method's cache would give (teacher forcing: KLD,
  PPL, greedy agreement, fidelity); the first ``prompt_len`` tokens count as a prompt prefilled in one pass.
* ``cache(model, method)``: a context manager yielding a factory of fresh cache objects to pass to the model as
  ``past_key_values`` (chunked prefill of a prompt, then greedy decode: NIAH and ``greedy --mode decode``).

:class:`HFBackend` provides both from :mod:`oscarkv.hf` and a calibration; tests use small stand-ins.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, ContextManager, Iterator, Protocol

import torch
from torch import Tensor


KERNELS = ("auto", "reference")


class Backend(Protocol):
    """What the evaluation harness needs from a set of KV-cache methods."""

    def simulate(self, model: Any, method: str, prompt_len: int = 0, chunk: int = 1) -> ContextManager[Any]: ...

    def cache(self, model: Any, method: str) -> ContextManager[Callable[[], Any]]: ...

    def describe(self, model: Any, method: str) -> dict: ...


class HFBackend:
    """Methods of :mod:`oscarkv.methods` through :mod:`oscarkv.hf` with one calibration artifact, plus optional
    extra calibrations addressed as ``method@label`` (e.g. ``oscar@head`` for a per-head calibration).

    ``calibration`` may be ``None`` for data-free methods only (bf16, naive-int2, quarot-int2, kivi-2,
    int4-hadamard); the adapter then passes an identity calibration.

    ``kernels`` picks the attention of the caches that generation metrics decode through (teacher-forced
    metrics never touch it): ``"auto"`` is :class:`oscarkv.hf.OscarCache`'s default (the chunked PyTorch attention
    on CPU; on CUDA ``oscarkv.kernels.dispatch.extend_attention``, i.e. the Triton kernel for 2-bit token pages and
    the PyTorch reference for other formats); ``"reference"`` forces the dispatcher's PyTorch reference for every
    paged format, on any device.
    """

    def __init__(self, calibration: Any = None, extra: dict[str, Any] | None = None, kernels: str = "auto"):
        if kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {list(KERNELS)}, got {kernels!r}")
        self.calibration = calibration
        self.extra = dict(extra or {})
        self.kernels = kernels
        self._tags: dict[int, str] = {}
        self._recipes: dict[tuple[int, str], Any] = {}

    def split(self, method: str) -> tuple[str, Any]:
        """``(registry name, calibration)`` of ``method`` or ``method@label``."""
        base, _, label = method.partition("@")
        if not label:
            return base, self.calibration
        if label not in self.extra:
            raise ValueError(f"method {method!r} names calibration {label!r}, but only {sorted(self.extra)} were "
                             "given (--extra-calibration LABEL=DIR)")
        return base, self.extra[label]

    def calibration_tag(self, method: str) -> str:
        from .store import calibration_tag

        calib = self.split(method)[1]
        key = id(calib)
        if key not in self._tags:
            self._tags[key] = calibration_tag(calib)
        return self._tags[key]

    def _resolve(self, model: Any, method: str) -> tuple[str, Any]:
        base, calib = self.split(method)
        if calib is None:
            from ..artifact import Calibration, ModelIdentity

            calib = Calibration.identity(ModelIdentity.from_config(model.config))
        return base, calib

    def simulate(self, model: Any, method: str, prompt_len: int = 0, chunk: int = 1) -> ContextManager[Any]:
        from .. import hf

        base, calib = self._resolve(model, method)
        return hf.simulate(model, calib, base, prompt_len=prompt_len, chunk=chunk)

    @contextlib.contextmanager
    def cache(self, model: Any, method: str) -> Iterator[Callable[[], Any]]:
        from .. import hf

        base, calib = self._resolve(model, method)
        handle = hf.apply(model, calib, base)
        try:
            factory = _cache_factory(handle)
            if self.kernels != "auto":
                factory = functools.partial(factory, kernel_backend=self.kernels)
            yield factory
        finally:
            remove = getattr(handle, "remove", None) or getattr(handle, "restore", None)
            if callable(remove):
                remove()

    def recipe(self, model: Any, method: str) -> Any:
        """The :class:`oscarkv.methods.Recipe` ``method`` stores the model's K/V with (resolved once)."""
        import warnings

        from .. import methods

        key = (id(model), method)
        if key not in self._recipes:
            base, calib = self._resolve(model, method)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # resolve()'s warnings are about numerics, not the layout
                self._recipes[key] = methods.resolve(base, calib)
        return self._recipes[key]

    def physical_bits(self, model: Any, method: str, tokens: list[int]) -> list[float]:
        """Bits per stored K/V element after each of ``tokens`` tokens, 16-bit tiers and layers the cache keeps
        in 16-bit (sliding-window layers) included."""
        from ..hf.prepare import full_attention_layers
        from .paths import physical_bits

        recipe = self.recipe(model, method)
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        d = self._resolve(model, method)[1].model.head_dim
        mask = full_attention_layers(cfg)
        return [round(physical_bits(recipe, d, t, mask), 4) for t in tokens]

    def describe(self, model: Any, method: str) -> dict:
        """Nominal bits per element of the quantized tier (K and V averaged over the layers the cache quantizes),
        the method's description and its calibration."""
        from .. import methods

        base, calib = self.split(method)
        m = methods.get(base)
        bits = 16.0
        if m.quantized:
            from ..hf.prepare import full_attention_layers

            cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
            from .paths import nominal_bits

            bits = nominal_bits(self.recipe(model, method), self._resolve(model, method)[1].model.head_dim,
                                full_attention_layers(cfg))
        return {"method": method, "bits": float(bits),
                "description": m.description, "calibration": self.calibration_tag(method),
                "calibration_provenance": getattr(calib, "provenance", None)}


def _cache_factory(handle: Any) -> Callable[[], Any]:
    """Turn whatever ``hf.apply`` returned into a zero-argument cache factory."""
    for attr in ("new_cache", "make_cache", "cache"):
        fn = getattr(handle, attr, None)
        if callable(fn):
            return fn
    if callable(handle):
        return handle
    raise TypeError(f"oscarkv.hf.apply returned {type(handle).__name__}, which gives no way to build a cache")


# ------------------------------------------------------------------------------------------ model access
def decoder(model: Any) -> Any:
    """The transformer body (embeddings + layers + final norm) of a causal-LM wrapper."""
    body = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    if body is None or body is model:
        raise ValueError(f"{type(model).__name__} has no decoder body at .{model.base_model_prefix}")
    return body


def output_head(model: Any) -> Callable[[Tensor], Tensor]:
    """``hidden [n, D] -> logits [n, V]`` (float32) as the model computes them, final logit soft-capping included,
    but always in float32: on a 16-bit model the head's weight is read once in float32 (bfloat16 logits are
    spaced 0.125 apart at 16, noise that would swamp a KLD of 0.01), so every metric compares final hidden
    states through one exact head. On a float32 model this is the model's own ``lm_head``."""
    lm_head = model.get_output_embeddings()
    cap = getattr(getattr(model.config, "get_text_config", lambda: model.config)(), "final_logit_softcapping", None)
    weight, bias = lm_head.weight, getattr(lm_head, "bias", None)
    if weight.dtype != torch.float32:
        weight = weight.detach().float()
        bias = None if bias is None else bias.detach().float()

    @torch.inference_mode()
    def head(h: Tensor) -> Tensor:
        logits = torch.nn.functional.linear(h.to(weight.device, torch.float32), weight, bias)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    return head


@torch.inference_mode()
def final_hidden(model: Any, input_ids: Tensor) -> Tensor:
    """Final hidden states ``[T, D]`` (float32, on the model's device) of one sequence ``input_ids`` ``[T]``."""
    dev = next(model.parameters()).device
    out = decoder(model)(input_ids=input_ids.view(1, -1).to(dev), use_cache=False)
    return out.last_hidden_state[0].float()


@torch.inference_mode()
def greedy_generate(
    model: Any,
    prompt: Tensor,
    cache: Any,
    max_new_tokens: int,
    *,
    chunk: int = 256,
    stop_ids: tuple[int, ...] = (),
) -> list[int]:
    """Prefill ``prompt`` ``[T]`` into ``cache`` in chunks of ``chunk`` tokens counted from the prompt's end
    (the first chunk holds the remainder; each chunk attends to the earlier ones as stored), then decode greedily
    one token at a time through the cache. The next token is the
    argmax of :func:`output_head` (float32) on the body's last hidden state, the same head the teacher-forced
    metrics use, so ``greedy`` in teacher and decode mode and NIAH pick tokens alike on any model dtype."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    dev = next(model.parameters()).device
    ids = prompt.view(1, -1).to(dev)
    step = _next_token_logits(model)
    logits = None
    for s, e in chunk_bounds(ids.shape[1], chunk):
        logits = step(ids[:, s:e], cache)
    out: list[int] = []
    for _ in range(max_new_tokens):
        tok = int(logits.argmax())
        out.append(tok)
        if tok in stop_ids or len(out) == max_new_tokens:
            break
        logits = step(torch.tensor([[tok]], device=dev), cache)
    return out


@torch.inference_mode()
def greedy_generate_batch(
    model: Any,
    prompts: list[Tensor],
    cache: Any,
    max_new_tokens: int,
    *,
    chunk: int = 256,
    pad_id: int = 0,
) -> list[list[int]]:
    """:func:`greedy_generate` for several prompts at once: the prompts (``[T_b]`` each) are left-padded to the
    longest, prefilled together in chunks of ``chunk`` tokens (padding masked out, position ids counted from each
    prompt's first real token, so every sequence sees exactly what it would alone) and decoded greedily for
    ``max_new_tokens`` tokens each. The cache must accept left padding (``OscarCache`` and transformers' caches
    do)."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    if len(prompts) == 1:
        return [greedy_generate(model, prompts[0], cache, max_new_tokens, chunk=chunk)]
    dev = next(model.parameters()).device
    T = max(int(p.numel()) for p in prompts)
    ids = torch.full((len(prompts), T), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), T, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, T - p.numel():] = p
        mask[b, T - p.numel():] = 1
    ids, mask = ids.to(dev), mask.to(dev)
    body, head = decoder(model), output_head(model)
    kw = cache_kwarg(body)

    def step(x: Tensor, upto: int) -> Tensor:
        m = mask[:, :upto]
        pos = (m.cumsum(-1) - 1).clamp_min(0)[:, upto - x.shape[1]:]
        h = body(input_ids=x, attention_mask=m, position_ids=pos, **{kw: cache}, use_cache=True).last_hidden_state
        return head(h[:, -1])

    logits = None
    for s, e in chunk_bounds(T, chunk):
        logits = step(ids[:, s:e], e)
    out: list[list[int]] = [[] for _ in prompts]
    for t in range(max_new_tokens):
        tok = logits.argmax(-1)
        for b in range(len(prompts)):
            out[b].append(int(tok[b]))
        if t + 1 == max_new_tokens:
            break
        mask = torch.cat([mask, torch.ones(len(prompts), 1, dtype=mask.dtype, device=dev)], 1)
        logits = step(tok[:, None], mask.shape[1])
    return out


def chunk_bounds(T: int, chunk: int) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` of a prefill of ``T`` tokens in chunks of ``chunk`` counted from the end."""
    first = T % chunk or min(T, chunk)
    return [(0, first)] + [(s, s + chunk) for s in range(first, T, chunk)] if T else []


def _next_token_logits(model: Any) -> Callable[[Tensor, Any], Tensor]:
    """``(ids [1, T], cache) -> logits [V]`` of the last position: the decoder body and :func:`output_head`
    where the model has them, else the model's own logits (stand-ins without a body)."""
    try:
        body, head = decoder(model), output_head(model)
    except (ValueError, AttributeError):
        kw = cache_kwarg(model)
        return lambda ids, cache: model(input_ids=ids, **{kw: cache}, use_cache=True, logits_to_keep=1).logits[0, -1]
    kw = cache_kwarg(body)
    return lambda ids, cache: head(body(input_ids=ids, **{kw: cache}, use_cache=True).last_hidden_state[0, -1:])[0]


def cache_kwarg(model: Any) -> str:
    """``cache`` where the model's forward takes it (transformers >= 5.2x), else ``past_key_values``."""
    import inspect

    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


__all__ = ["Backend", "HFBackend", "KERNELS", "decoder", "output_head", "final_hidden", "greedy_generate",
           "greedy_generate_batch",
           "cache_kwarg"]
