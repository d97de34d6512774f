"""``oscarkv inspect DIR``: summarise a calibration artifact (spectra, clip ratios, bits, provenance)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

TOP = 8


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", help="calibration folder (written by `oscarkv calibrate`)")
    parser.add_argument("--plot", metavar="PNG", help="also write a plot of the per-layer eigen-spectra")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON instead of a table")


def spectrum_summary(eig: torch.Tensor, top: int = TOP) -> tuple[torch.Tensor, torch.Tensor]:
    """Per layer: share of the target's energy in its ``top`` eigen-directions and condition ``l_1 / l_d``
    (heads averaged where per head). ``eig`` is ``[L, d]`` or ``[L, H, d]``, descending."""
    e = eig.to(torch.float64).clamp_min(0)
    if e.ndim == 3:
        share = (e[..., :top].sum(-1) / e.sum(-1).clamp_min(1e-300)).mean(1)
        cond = (e[..., 0] / e[..., -1].clamp_min(1e-12)).mean(1)
    else:
        share = e[:, :top].sum(-1) / e.sum(-1).clamp_min(1e-300)
        cond = e[:, 0] / e[:, -1].clamp_min(1e-12)
    return share, cond


def summary_rows(calib: Any) -> list[dict]:
    share_k, cond_k = spectrum_summary(calib.eig_k)
    share_v, cond_v = spectrum_summary(calib.eig_v)
    return [
        {"layer": i, "k_clip": round(float(calib.k_clip[i]), 4), "v_clip": round(float(calib.v_clip[i]), 4),
         f"k_top{TOP}": round(float(share_k[i]), 4), f"v_top{TOP}": round(float(share_v[i]), 4),
         "k_cond": float(cond_k[i]), "v_cond": float(cond_v[i]),
         "mu_k_norm": round(float(calib.mu_k[i].norm(dim=-1).mean()), 3),
         "mu_v_norm": round(float(calib.mu_v[i].norm(dim=-1).mean()), 3)}
        for i in range(calib.model.num_layers)
    ]


def format_summary(calib: Any, path: str | Path | None = None) -> str:
    """A human-readable summary: model, spec, provenance, per-layer table, bits per element."""
    m, s, p = calib.model, calib.spec, calib.provenance
    data = p.get("data", {})
    lines = [
        f"model        {m.name or '?'} ({m.architecture}, {m.num_layers} layers, {m.num_q_heads}/{m.num_kv_heads} "
        f"q/kv heads, head_dim {m.head_dim})",
        f"data         {data.get('corpus', data.get('kind', '?'))} [{data.get('split', '-')}], "
        f"{p.get('tokens', '?')} tokens ({p.get('stats_tokens', '?')} statistics + {p.get('holdout_tokens', 0)} "
        f"held out for clip fitting), seed {p.get('seed', '?')}, seq_len {p.get('seq_len', '?')}",
        f"spec         composition {s.composition}, granularity {s.granularity}, target {s.target}, "
        f"weighting {s.value_weighting}, centering {s.centering}, clip K {s.k_clip} / V {s.v_clip}",
        f"format       {s.bits}-bit, group {s.group_for(m.head_dim)}, {s.meta_dtype} scale/offset: "
        f"{calib.bits_per_element():.3f} bits/element in the quantized tier (sink {s.sink}, window {s.window} "
        "tokens stay 16-bit)",
    ]
    lines.append(f"quantized    {quantized_layers_line(calib)}")
    if "wall_time_s" in p:
        lines.append(f"calibrated   in {p['wall_time_s']:.1f} s with oscarkv {p.get('oscarkv_version')}, torch "
                     f"{p.get('torch_version')}, transformers {p.get('transformers_version')}")
    rows = summary_rows(calib)
    lines.append("")
    lines.append(f"layer  k_clip  v_clip  K top-{TOP}  V top-{TOP}    K cond    V cond  |mu_k|  |mu_v|")
    for r in rows:
        lines.append(f"{r['layer']:5d}  {r['k_clip']:6.3f}  {r['v_clip']:6.3f}  {r[f'k_top{TOP}']:8.1%}  "
                     f"{r[f'v_top{TOP}']:8.1%}  {r['k_cond']:8.2g}  {r['v_cond']:8.2g}  {r['mu_k_norm']:6.2f}  "
                     f"{r['mu_v_norm']:6.2f}")
    lines.append(f"(top-{TOP}: share of the key/value target's energy in its {TOP} largest eigen-directions; "
                 "cond: largest / smallest eigenvalue)")
    lines += format_lines(calib)
    if path is not None:
        lines.append(f"saved        {Path(path).resolve()}")
    return "\n".join(lines)


def quantized_layers_line(calib: Any) -> str:
    """Which layers the cache quantizes: the full-attention ones (the others keep the model's own cache)."""
    from oscarkv.formats import describe_layers

    m = calib.model
    full = [i for i, f in enumerate(m.full_attention) if f]
    line = f"layers {describe_layers(full, m.num_layers)}"
    if len(full) < m.num_layers:
        kinds = sorted({t for t in m.layer_types if t != "full_attention"})
        line += (f" (full attention); the {m.num_layers - len(full)} {'/'.join(kinds)} layers are not quantized "
                 "(they keep the model's own cache, at its dtype)")
    return line


def format_rows(calib: Any) -> list[dict]:
    """Per layer: the selected key/value formats and their predicted held-out errors (empty without
    ``layer_formats``)."""
    if calib.layer_formats is None:
        return []
    rows = []
    for i, entry in enumerate(calib.layer_formats):
        k, v = (f.label for f in calib.formats(i)) if calib.model.full_attention[i] else ("not quantized",) * 2
        rows.append({"layer": i, "k": k, "v": v, "k_error": entry.get("k_error"), "v_error": entry.get("v_error")})
    return rows


def format_lines(calib: Any) -> list[str]:
    """The ``layer_formats`` table (oscar-auto), or nothing."""
    rows = format_rows(calib)
    if not rows:
        return []
    from oscarkv.methods import nominal_bits

    sel = calib.provenance.get("format_selection", {})
    budget = sel.get("budget", calib.spec.bit_budget)
    bits = nominal_bits("oscar-auto", calib.model.head_dim, calib)
    lines = ["", f"per-layer formats (method oscar-auto): {bits:.3f} bits/element in the quantized tier of the "
             f"quantized layers, budget {budget}",
             "layer  key format                   pred. K err  value format                 pred. V err"]
    for r in rows:
        ke = "-" if r["k_error"] is None else f"{r['k_error']:.4f}"
        ve = "-" if r["v_error"] is None else f"{r['v_error']:.4f}"
        lines.append(f"{r['layer']:5d}  {r['k']:27s}  {ke:>11s}  {r['v']:27s}  {ve:>11s}")
    lines.append("(pred. err: relative attention-output error of the layer on held-out calibration tokens, only K "
                 "or only V quantized; format = layout+bits/rotation@clip)")
    return lines


def plot(calib: Any, out: str | Path) -> Path:
    """Normalised eigen-spectra per layer for keys and values (log scale), one line per layer."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit("--plot needs matplotlib: pip install 'oscar-kv[eval]'") from e
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    L = calib.model.num_layers
    cmap = plt.get_cmap("viridis")
    for ax, eig, title in ((axes[0], calib.eig_k, "key target"), (axes[1], calib.eig_v, "value target")):
        e = eig.to(torch.float64).clamp_min(1e-12)
        e = e.mean(1) if e.ndim == 3 else e
        for i in range(L):
            ax.semilogy((e[i] / e[i].sum()).numpy(), color=cmap(i / max(L - 1, 1)), lw=0.8)
        ax.set_title(f"{title} eigenvalues (share, per layer)")
        ax.set_xlabel("eigen-direction (descending)")
    axes[0].set_ylabel("share of energy")
    fig.suptitle(f"{calib.model.name or calib.model.architecture}: layer 0 (dark) to {L - 1} (light)")
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def run(args: argparse.Namespace) -> int:
    from oscarkv.artifact import Calibration

    calib = Calibration.load(args.path)  # a damaged artifact: ArtifactError, one line on stderr (oscarkv.cli)
    if args.json:
        full = [i for i, f in enumerate(calib.model.full_attention) if f]
        print(json.dumps({"model": calib.model.to_dict(), "spec": calib.spec.to_dict(), "layers": summary_rows(calib),
                          "quantized_layers": full,
                          "bits_per_element": calib.bits_per_element(), "layer_formats": format_rows(calib),
                          "provenance": calib.provenance}, indent=2))
    else:
        print(format_summary(calib, args.path))
    if args.plot:
        print(f"plot         {plot(calib, args.plot).resolve()}")
    return 0
