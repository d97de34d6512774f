"""``OscarCache``: a transformers ``Cache`` with one :class:`OscarLayer` per full-attention layer.

Each OscarLayer owns a one-layer, growable :class:`~oscarkv.cache.PagedStore` (16-bit sink + recent window,
quantized pages in between, one slot per sequence of the batch). ``update`` does not store anything yet: it parks
the chunk's new K/V, hands itself to the ``"oscar"`` attention function through the forward's keyword arguments,
and returns *sealed* tensors that raise if any other attention function touches them. The attention function
attends to the stored prefix as stored and to the chunk in full precision, then commits the chunk
(``extend_attention_ref`` semantics; decode is a chunk of one).

Left padding is supported: padding tokens are never stored, so every sequence of a batch keeps its own tiers
(its sink is its first real tokens). Beam search, cropping and batch reordering are not supported.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import Tensor

try:
    from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, Cache, CacheLayerMixin, get_layer_types_and_kwargs
except ImportError as e:  # pragma: no cover
    raise ImportError("oscarkv.hf needs transformers: pip install 'oscar-kv[hf]'") from e

from .. import methods
from ..cache import Bytes, PagedStore, chunk_attention, growable_store
from ..formats import describe_layers
from .plan import ATTN_NAME, HANDLE_ATTR, PLAN_ATTR, LayerPlan, fingerprint


class _Sealed(torch.Tensor):
    """A chunk's K/V as returned by :meth:`OscarLayer.update`: only the ``"oscar"`` attention may use them."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(
            "an OscarCache's keys/values reached an attention function other than oscarkv's: the model must run "
            f"with attn_implementation={ATTN_NAME!r}, installed by oscarkv.hf.apply(model, calibration, method) "
            "(do not change the attention implementation while the cache is in use)"
        )


def _seal(t: Tensor) -> Tensor:
    return t.as_subclass(_Sealed)


class OscarLayer(CacheLayerMixin):
    """One attention layer's quantized cache (see the module docstring)."""

    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(self, plan: LayerPlan, window_dtype: torch.dtype, kernel_backend: str | None = None):
        super().__init__()
        self.plan, self.window_dtype, self.kernel_backend = plan, window_dtype, kernel_backend
        self.store: PagedStore | None = None
        self.timeline = 0  # positions seen, padding included (what masks and position ids count)
        self._pending: tuple[Tensor, Tensor, Tensor, Tensor] | None = None

    # --------------------------------------------------------------------------- transformers' layer API
    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        B, H, _, d = key_states.shape
        p = self.plan
        if (H, d) != (p.num_kv_heads, p.head_dim):
            raise ValueError(f"layer {p.layer}: keys have {H} heads of dim {d}, the cache was built for "
                             f"{p.num_kv_heads} heads of dim {p.head_dim} (a cache of another model?)")
        self.device = key_states.device
        self.store = growable_store(p.recipe, [p.layer], B, H, d, self.window_dtype, key_states.device)
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        fwd = kwargs.get("kwargs")
        if not isinstance(fwd, dict):
            raise TypeError(f"{type(self.plan).__name__}: the model's attention did not pass its keyword arguments "
                            "to cache.update(..., kwargs=kwargs): OscarCache needs transformers >= 5.24, the first "
                            "release whose attention layers do that (5.23 and earlier do not: pip install -U "
                            "'transformers>=5.24'), and an architecture that follows it")
        self._check_model()
        if self._pending is not None:
            raise RuntimeError(f"layer {self.plan.layer}: the previous chunk was never attended/committed; the "
                               f"model is not running the {ATTN_NAME!r} attention function")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[0] != self.store.num_slots:
            raise ValueError(f"this OscarCache holds {self.store.num_slots} sequences, the input has "
                             f"{key_states.shape[0]}; build a new cache with handle.cache()")
        sk, sv = _seal(key_states), _seal(value_states)
        self._pending = (key_states, value_states, sk, sv)
        fwd["oscar_layer"] = self
        return sk, sv

    def _check_model(self) -> None:
        handle = self.plan.handle
        if handle is None or not handle.active:
            raise RuntimeError("this OscarCache belongs to an apply() handle that was restored (or to a model that "
                               "no longer exists); build a new cache after oscarkv.hf.apply(...)")
        impl = handle.model.config._attn_implementation
        if impl != ATTN_NAME:
            raise ValueError(f"the model runs attn_implementation={impl!r}; OscarCache needs {ATTN_NAME!r} "
                             "(installed by oscarkv.hf.apply)")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.timeline + query_length, 0

    def get_seq_length(self) -> int:
        return self.timeline

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.store, self.timeline, self._pending, self.is_initialized = None, 0, None, False

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("OscarCache cannot crop: quantized tokens are never rewritten")

    def reorder_cache(self, beam_idx) -> None:
        raise NotImplementedError("OscarCache does not support beam search (sequences own their pages)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.timeline:
            raise NotImplementedError("OscarCache cannot repeat a non-empty batch")

    def batch_select_indices(self, indices) -> None:
        if self.timeline:
            raise NotImplementedError("OscarCache cannot select from a non-empty batch")

    def offload(self) -> None:
        pass

    def prefetch(self) -> None:
        pass

    # -------------------------------------------------------------------------------------- attention
    def attend(self, module, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, scaling: float,
               softcap: float | None = None) -> Tensor:
        """Attention of the pending chunk, then commit it. ``query`` ``[B, Hq, T, d]``; returns
        ``[B, T, Hq, d]`` in the rotated value basis (``o_proj`` folds it back)."""
        plan = getattr(module, PLAN_ATTR, None)
        if plan is not self.plan:
            raise RuntimeError(
                f"this OscarCache was built for another model or another apply() (layer {self.plan.layer}); "
                "build the cache from the handle of the model you run: handle.cache()")
        if self._pending is None or key is not self._pending[2] or value is not self._pending[3]:
            raise RuntimeError("attention called with keys/values that did not come from this cache's update()")
        k_raw, v_raw = self._pending[:2]
        B, Hq, T, d = query.shape
        q = plan.rotate_queries(query)
        k = plan.rotate_keys(k_raw)
        v = v_raw.to(torch.float32)
        valid, self_masks = self._chunk_masks(mask, B, T, query.device)
        if self._kernels_apply(query, valid, softcap):
            res = self._attend_kernels(q, k, v, scaling)
        else:
            out = torch.empty(B, plan.num_kv_heads, plan.groups, T, d, dtype=torch.float32, device=query.device)
            for b in range(B):
                sm = None if self_masks is None else self_masks[b]
                out[b] = chunk_attention(q[b], partial(self.store.prefix, 0, b), k[b], v[b], sm, scaling, softcap)
            res = out.reshape(B, Hq, T, d).transpose(1, 2)
        st = self.store
        for b in range(B):
            keep = slice(None) if valid is None else valid[b]
            kb, vb = k[b][:, keep].transpose(0, 1), v[b][:, keep].transpose(0, 1)
            st.reserve(b, st.lens[b] + kb.shape[0])
            st.write(0, b, kb, vb)
            st.commit(b, kb.shape[0])
        self.timeline += T
        self._pending = None
        return res.to(query.dtype)

    def _kernels_apply(self, query: Tensor, valid: Tensor | None, softcap: float | None) -> bool:
        """Use ``oscarkv.kernels.dispatch.extend_attention``: on CUDA (or when a backend is forced), for a quantized
        layer, no soft-capping and a chunk without padding."""
        if self.kernel_backend is None and not query.is_cuda:
            return False
        return self.store.k_pages[0] is not None and softcap is None and (valid is None or bool(valid.all()))

    def _attend_kernels(self, q: Tensor, k: Tensor, v: Tensor, scaling: float) -> Tensor:
        """The kernels' extend op over this layer's pools: q ``[B, Hkv, g, T, d]`` -> ``[B, T, Hq, d]``."""
        from ..kernels import dispatch

        B, H, g, T, d = q.shape
        st = self.store
        # the kernel wants k_new/v_new with identical strides: clone to canonical strides (contiguous() keeps
        # a size-1 token dimension's stride as it is, so a decode step's k and v could still differ)
        kn, vn = (x.transpose(1, 2).clone(memory_format=torch.contiguous_format) for x in (k, v))
        qlen, len16 = st.lengths(range(B))
        return dispatch.extend_attention(
            q.reshape(B, H * g, T, d).transpose(1, 2), kn, vn, st.k_pages[0], st.v_pages[0], st.block_table[:B],
            qlen, st.buf[0, 0, :B], st.buf[1, 0, :B], len16, scaling,
            backend=self.kernel_backend or "auto").float()

    def _chunk_masks(self, mask: Tensor | None, B: int, T: int, device) -> tuple[Tensor | None, Tensor | None]:
        """Validity of the chunk's tokens ``[B, T]`` and the masks among them ``[B, T, T]`` from the 4D mask
        (``None`` = no padding, causal). Only left padding is accepted."""
        if mask is None:
            return None, None
        if mask.ndim != 4 or mask.shape[-1] != self.timeline + T or mask.shape[-2] != T:
            raise ValueError(f"attention mask of shape {tuple(mask.shape)} does not match {T} new tokens after "
                             f"{self.timeline} cached positions")
        allowed = mask[:, 0] if mask.dtype == torch.bool else mask[:, 0] > torch.finfo(mask.dtype).min / 2
        if allowed.shape[0] != B:
            allowed = allowed.expand(B, -1, -1)
        self_masks = allowed[:, :, self.timeline:]
        valid = self_masks[:, -1, :]
        for b in range(B):
            n = self.store.lens[b]
            seen = allowed[b, -1, : self.timeline]
            expect_prefix = torch.arange(self.timeline, device=device) >= self.timeline - n
            row = valid[b].to(torch.int8)
            left_padded = bool((row[1:] >= row[:-1]).all()) and (n == 0 or bool(row.all()))
            if not (torch.equal(seen, expect_prefix) and left_padded):
                raise ValueError("OscarCache supports left padding only (tokenizer.padding_side='left', padding "
                                 "only before a sequence's first token); got another attention-mask pattern")
        return valid, self_masks

    def nbytes(self) -> Bytes:
        return self.store.nbytes() if self.store is not None else Bytes()


def _plain_layer(config, i: int):
    types, kwargs = get_layer_types_and_kwargs(config)
    return DYNAMIC_LAYER_TYPE_MAPPING[types[i]](**kwargs[i])


class OscarCache(Cache):
    """The transformers cache for a model prepared by :func:`oscarkv.hf.apply` (build it with
    ``handle.cache()`` or :meth:`from_calibration`). Full-attention layers are :class:`OscarLayer`;
    sliding-window layers keep transformers' bounded 16-bit layer.

    ``kernel_backend``: ``None`` (default) runs the chunked PyTorch attention on CPU and
    ``oscarkv.kernels.dispatch.extend_attention`` (Triton on supported formats) on CUDA; a dispatch backend
    name ("reference", "triton", ...) forces the dispatch path (tests)."""

    def __init__(self, handle, window_dtype: torch.dtype | None = None, kernel_backend: str | None = None):
        """``handle``: the :class:`~oscarkv.hf.prepare.Applied` of ``oscarkv.hf.apply`` (active, cache mode)."""
        if not getattr(handle, "active", False) or getattr(handle, "mode", None) != "cache":
            raise TypeError("OscarCache needs an active handle from oscarkv.hf.apply(model, calibration, method)")
        self.handle = handle
        dtype16 = self.window_dtype = window_dtype or handle.window_dtype
        cfg = handle.model.config.get_text_config(decoder=True)
        layers = [OscarLayer(handle.plans[i], dtype16, kernel_backend) if i in handle.plans else _plain_layer(cfg, i)
                  for i in range(cfg.num_hidden_layers)]
        super().__init__(layers=layers)

    @classmethod
    def from_calibration(cls, model, calibration, method: str = "oscar",
                         window_dtype: torch.dtype | None = None) -> OscarCache:
        """A cache for ``model`` already prepared by ``oscarkv.hf.apply(model, calibration, method)``."""
        handle = getattr(model, HANDLE_ATTR, None)
        name = methods.get(method).name
        if handle is None or handle.mode != "cache":
            raise RuntimeError("call oscarkv.hf.apply(model, calibration, method) first: the cache stores values in "
                               "the rotated basis folded into v_proj/o_proj")
        if handle.fingerprint != fingerprint(calibration, name):
            raise ValueError(f"the model was prepared with method {handle.method.name!r} and another calibration or "
                             f"method than ({name!r}); use that handle's .cache()")
        return cls(handle, window_dtype)

    def nbytes(self) -> Bytes:
        """Physical bytes of all layers (see :class:`oscarkv.cache.Bytes`), each at its real dtype: the OSCAR layers'
        quantized pages and 16-bit tiers, and the K/V other layers (sliding-window layers) hold in the model's
        own cache (``used_unquantized``; float32 on a float32 model)."""
        total = Bytes()
        for layer in self.layers:
            if isinstance(layer, OscarLayer):
                total = total + layer.nbytes()
            elif getattr(layer, "keys", None) is not None and layer.keys.numel():
                kb = layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
                el = layer.keys.numel() + layer.values.numel()
                total = total + Bytes(tokens=layer.keys.shape[0] * layer.keys.shape[2], used_unquantized=kb,
                                      allocated=kb, bf16_equivalent=2 * el, elements=el)
        return total

    @property
    def quantized_layers(self) -> list[int]:
        return [i for i, layer in enumerate(self.layers) if isinstance(layer, OscarLayer)]

    def memory_report(self) -> str:
        """One line: which layers are quantized, stored bytes by kind at their real dtypes, against the same tokens
        in a 16-bit cache, and the physical bits per stored element."""
        b, mib = self.nbytes(), 2**20
        q = self.quantized_layers
        other = ""
        if len(q) < len(self.layers):
            dtypes = sorted({str(layer.keys.dtype).replace("torch.", "") for layer in self.layers
                             if not isinstance(layer, OscarLayer) and getattr(layer, "keys", None) is not None})
            other = f" + {b.used_unquantized / mib:.2f} MiB in unquantized layers ({', '.join(dtypes) or '-'})"
        dtype16 = str(self.window_dtype).replace("torch.", "")
        return (f"KV cache (quantized layers {describe_layers(q, len(self.layers))}): {b.used / mib:.2f} MiB stored "
                f"({b.used_quantized / mib:.2f} MiB quantized + {b.used_16bit / mib:.2f} MiB {dtype16} sink/window"
                f"{other}) vs {b.bf16_equivalent / mib:.2f} MiB in 16-bit: ratio {b.ratio_to_bf16:.3f}, "
                f"{b.bits_per_element:.2f} bits/element; {b.allocated / mib:.2f} MiB allocated")


__all__ = ["OscarCache", "OscarLayer"]
