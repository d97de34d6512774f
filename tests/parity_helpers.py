"""A per-layer artifact with mixed formats (channel and token keys, 2 and 4 bits) for any model: the input of the
runtime parity checks (transformers integration, engine, vLLM plugin)."""

import torch

from oscarkv.artifact import Calibration, ModelIdentity
from oscarkv.config import QuantSpec
from oscarkv.rotation import random_orthogonal

# cycled over the layers: every key layout and width, 2- and 4-bit values, each rotation kind; layers 0 and 1 differ
# in page bytes (vLLM then keeps one page size per layer)
MIXED = [
    {"k": {"layout": "channel", "bits": 2, "rotation": "none"}, "v": {"layout": "token", "bits": 4,
                                                                       "rotation": "calibrated", "clip": 0.9}},
    {"k": {"layout": "token", "bits": 2, "rotation": "hadamard", "clip": 0.96},
     "v": {"layout": "token", "bits": 2, "rotation": "none", "clip": 0.0}},
    {"k": {"layout": "channel", "bits": 4, "rotation": "calibrated"}, "v": {"layout": "token", "bits": 2,
                                                                             "rotation": "calibrated", "clip": 0.92}},
    {"k": {"layout": "token", "bits": 4, "rotation": "calibrated", "clip": 0.95},
     "v": {"layout": "token", "bits": 2, "rotation": "hadamard", "clip": 0.9}},
]


def mixed_calibration(ident: ModelIdentity, spec: QuantSpec, seed: int = 0, mean_scale: float = 0.3) -> Calibration:
    """Random orthogonal rotations, random means and clips, and ``layer_formats`` cycling through :data:`MIXED`."""
    L, H, d = ident.num_layers, ident.num_kv_heads, ident.head_dim
    g = torch.Generator().manual_seed(seed)
    rot = lambda: torch.stack([random_orthogonal(d, g) for _ in range(L)])  # noqa: E731
    calib = Calibration(spec=spec, model=ident, r_k=rot(), r_v=rot(), eig_k=torch.zeros(L, d),
                        eig_v=torch.zeros(L, d), mu_k=torch.randn(L, H, d, generator=g) * mean_scale,
                        mu_v=torch.randn(L, H, d, generator=g) * mean_scale, k_clip=torch.full((L,), 0.95),
                        v_clip=torch.full((L,), 0.9))
    calib.layer_formats = [MIXED[i % len(MIXED)] for i in range(L)]
    calib.validate_shapes()
    return calib
