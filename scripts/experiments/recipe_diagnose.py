"""Per-layer, per-head, K-vs-V held-out error of candidate formats on evaluation windows (docs/recipe.md).

Static (not propagated) relative attention-output error of each layer with only K or only V quantized, under the
cache's tier rule at the window's length, for every candidate format of oscarkv.calib.select.

    python scripts/experiments/recipe_diagnose.py MODEL CALIB_DIR LENGTH [WINDOWS [oracle]] > out.json

With "oracle", the rotations and means are recomputed from the evaluation windows themselves (an in-domain
calibration on the very tokens evaluated: the best any calibration data or size could do) and only the method's
format (token2/calibrated, fitted clip) and channel pages are scored.
"""

import json
import sys

import torch

from oscarkv import models
from oscarkv.artifact import Calibration, TensorFormat as F
from oscarkv.calib.select import score_layer
from oscarkv.calib.stats import Recorder, capture
from oscarkv.eval.texts import bos_id, load_eval_text, tokenize, windows


def oracle(calib, rec):
    """The calibration's spec applied to statistics of the captured windows themselves."""
    import dataclasses

    from oscarkv.calib.fit import rotations
    from oscarkv.calib.stats import finalize

    m = calib.model
    stats_rec = Recorder(m.num_layers, m.num_kv_heads, m.head_dim, need_kv=True, need_softmax=False)
    for acc, src in zip(stats_rec.layers, rec.layers):
        for h in src.held_out:
            acc.add(h.q, h.k, h.v)
    stats = finalize(stats_rec, centering=True, value_weighting="quadratic")
    rot = rotations(stats, calib.spec)
    return dataclasses.replace(calib, r_k=rot["r_k"], r_v=rot["r_v"], eig_k=rot["eig_k"], eig_v=rot["eig_v"],
                               mu_k=stats.mu_k.float(), mu_v=stats.mu_v.float())


def main(model_name: str, calib_dir: str, length: int, count: int = 1, mode: str = "") -> None:
    torch.set_num_threads(1)
    model, tok = models.load(model_name, dtype=torch.float32)
    calib = Calibration.load(calib_dir, model=model)
    text = load_eval_text("essays")
    ids = windows(tokenize(tok, text.text), length, count, bos_id(tok))
    m = calib.model
    rec = Recorder(m.num_layers, m.num_kv_heads, m.head_dim, need_kv=False, need_softmax=False)
    rec.phase = "holdout"
    with torch.no_grad(), capture(model, rec):
        for w in ids:
            model.model(input_ids=w.view(1, -1), use_cache=False)
    if mode == "oracle":
        calib = oracle(calib, rec)
    spec = calib.spec.replace(clip_grid=(1.0, 0.96, 0.92, 0.88))  # a coarser grid than calibration's, for speed
    cands = {"k": [F("token", 2, "calibrated"), F("token", 2, "hadamard"), F("token", 2, "none"),
                   F("channel", 2, "none"), F("channel", 2, "calibrated"), F("token", 4, "calibrated")],
             "v": [F("token", 2, "calibrated"), F("token", 2, "hadamard"), F("token", 2, "none"),
                   F("token", 4, "calibrated")]}
    if mode == "oracle":
        cands = {"k": [F("token", 2, "calibrated"), F("channel", 2, "none")], "v": [F("token", 2, "calibrated")]}
    out = {"model": model_name, "length": length, "windows": len(ids), "mode": mode or "calibration", "layers": []}
    for i in range(m.num_layers):
        t = calib.layer(i)
        layer = {n: t[n].float().contiguous() for n in ("r_k", "r_v", "mu_k", "mu_v")}
        row = {"layer": i}
        for which in ("k", "v"):
            row[which] = [{"format": s.format.label, "bits": s.bits, "error": round(s.error, 5),
                           "head_error": [round(e, 5) for e in s.head_error]}
                          for s in score_layer(rec.layers[i].held_out, layer, spec, which, cands[which], max_queries=256)]
        out["layers"].append(row)
        print(f"layer {i}: K oscar {row['k'][0]['error']:.3f} V oscar {row['v'][0]['error']:.3f}", file=sys.stderr)
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]) if len(sys.argv) > 4 else 1,
         sys.argv[5] if len(sys.argv) > 5 else "")
