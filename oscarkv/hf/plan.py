"""What the ``"oscar"`` attention function and the cache need of an OSCAR layer (:class:`LayerPlan`), and the names
they share. A leaf of the package: :mod:`.attention`, :mod:`.cache` and :mod:`.simulation` import it, and
:mod:`.prepare` (``apply``) imports them, so no module of the package imports back.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..artifact import Calibration
from ..methods import LayerRecipe, Recipe

ATTN_NAME = "oscar"
PLAN_ATTR = "_oscarkv_plan"
HANDLE_ATTR = "_oscarkv_applied"


@dataclass(eq=False)
class LayerPlan:
    """What the attention function and the cache need for one OSCAR layer (tensors on the model's device)."""

    layer: int
    recipe: Recipe
    lr: LayerRecipe
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    mode: str  # "cache" or "simulate"
    window_dtype: torch.dtype
    prompt_len: int = 0
    chunk: int = 1
    _handle: Any = None
    _dev: dict = field(default_factory=dict)

    @property
    def groups(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    def _tensors(self, device: torch.device) -> tuple[Tensor | None, Tensor | None]:
        if device not in self._dev:
            r = None if self.lr.r_k is None else self.lr.r_k.to(device, torch.float64)
            mu = None if self.lr.mu_k is None else self.lr.mu_k.to(device, torch.float64)
            self._dev[device] = (r, mu)
        return self._dev[device]

    def rotate_keys(self, k: Tensor) -> Tensor:
        """Post-RoPE keys ``[B, Hkv, T, d]`` -> stored basis ``(k - mu_k) @ R_K`` (float32, computed in float64)."""
        r, mu = self._tensors(k.device)
        x = k.to(torch.float64)
        if mu is not None:
            x = x - mu[None, :, None, :]
        if r is not None:
            x = torch.einsum("bhtd,hde->bhte", x, r)
        return x.to(torch.float32)

    def rotate_queries(self, q: Tensor) -> Tensor:
        """Queries ``[B, Hq, T, d]`` -> ``q @ R_K[j // g]`` grouped as ``[B, Hkv, g, T, d]`` (float32)."""
        B, Hq, T, d = q.shape
        r, _ = self._tensors(q.device)
        x = q.reshape(B, self.num_kv_heads, self.groups, T, d)
        if r is None:
            return x.to(torch.float32)
        return torch.einsum("bhgtd,hde->bhgte", x.to(torch.float64), r).to(torch.float32)

    @property
    def handle(self) -> Any:
        """The :class:`~oscarkv.hf.prepare.Applied` this plan belongs to, or None once it is gone."""
        return self._handle() if self._handle is not None else None


def full_attention_layers(config) -> list[bool]:
    """Per layer: True where the layer attends over the whole sequence (OSCAR applies), False for
    sliding-window or chunked layers (:attr:`oscarkv.artifact.ModelIdentity.full_attention`)."""
    types = getattr(config, "layer_types", None)
    return [True] * config.num_hidden_layers if types is None else [t == "full_attention" for t in types]


def fingerprint(calibration: Calibration, method: str) -> str:
    h = hashlib.sha1(method.encode())
    for name in ("r_k", "r_v", "mu_k", "mu_v", "k_clip", "v_clip"):
        h.update(getattr(calibration, name).detach().float().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


__all__ = ["ATTN_NAME", "HANDLE_ATTR", "PLAN_ATTR", "LayerPlan", "fingerprint", "full_attention_layers"]
