"""Offline calibration: statistics from a model's own attention inputs -> rotations, means and clip ratios.

``calibrate(model, tokenizer, "shakespeare", spec=QuantSpec(), tokens=8192, seed=0)`` returns a
:class:`~oscarkv.artifact.Calibration`. See ``docs/calibration.md`` for what is measured and why.
"""

from __future__ import annotations

import os
import platform
import time
from typing import Any, Sequence

import torch
from torch import Tensor

from ..artifact import Calibration, ModelIdentity
from ..config import DEFAULT_K_CLIP, DEFAULT_V_CLIP, QuantSpec, resolve_clip
from ..rotation import RotationError, is_power_of_two
from .fit import choose_ratio, clip_errors, fit_windows, rotations
from .stats import CalibrationStats, Recorder, capture, finalize

DataLike = Any  # corpus name/path, Corpus, list[str], Chunks, or list of LongTensor chunks


def check_model(model: Any, spec: QuantSpec, name: str = "") -> ModelIdentity:
    """The model's identity; raises for unsupported architectures and for a head_dim the composition cannot
    rotate (the Hadamard needs a power of two)."""
    ident = ModelIdentity.from_config(model.config, name)
    if spec.composition in ("uhp", "uh", "h") and not is_power_of_two(ident.head_dim):
        raise RotationError(
            f"head_dim = {ident.head_dim} is not a power of two: composition {spec.composition!r} needs a "
            "Sylvester Hadamard. Use a spec with composition 'u' or 'none' for this model."
        )
    return ident


def plan_chunks(data: DataLike, tokenizer: Any, *, tokens: int, seq_len: int, seed: int, holdout: float,
                chat_template: bool = False) -> tuple[list[Tensor], list[Tensor], dict]:
    """``(stats_chunks, holdout_chunks, data_provenance)`` for a token budget; chunks are LongTensors ``[n]``."""
    from ..data import Chunks, Corpus, chunk_lengths, load_corpus, mix_parts, sample_chunks, sample_mixed_chunks

    n_hold = int(round(tokens * holdout))
    if isinstance(data, Chunks) or (isinstance(data, (list, tuple)) and data and isinstance(data[0], Tensor)):
        chunks = list(data.input_ids if isinstance(data, Chunks) else data)
        return *_split_given(chunks, tokens, n_hold), {"kind": "token chunks", "chunks": len(chunks)}
    if tokenizer is None:
        raise ValueError("text data needs a tokenizer (or pass pre-tokenized chunks)")
    corpus = data if isinstance(data, Corpus) else None
    mix: list[Corpus] = []
    if isinstance(data, (str, os.PathLike)):
        parts = mix_parts(str(data)) if not os.path.isfile(data) else [str(data)]
        if len(parts) > 1:
            mix = [load_corpus(p, "calibration") for p in parts]
        else:
            corpus = load_corpus(data, "calibration")
    stat_len = chunk_lengths(tokens - n_hold, seq_len)
    hold_len = []
    if n_hold:  # a mix holds out one chunk per corpus where the budget allows (chunks of at least 256 tokens)
        hold_len = chunk_lengths(n_hold, max(256, -(-n_hold // len(mix))) if mix else seq_len)
    if mix:
        sampled = sample_mixed_chunks(tokenizer, mix, stat_len + hold_len, seed=seed, chat_template=chat_template)
        prov = {"corpus": str(data), "split": "calibration", "mix": [c.describe() for c in mix]}
    else:
        sampled = sample_chunks(tokenizer, corpus if corpus is not None else list(data), stat_len + hold_len,
                                seed=seed, chat_template=chat_template)
        prov = corpus.describe() if corpus is not None else {"kind": "texts", "count": len(data)}
    prov["chunks"] = [f"{name}@{off}" for name, off in sampled.origin]
    k = len(stat_len)
    return sampled.input_ids[:k], sampled.input_ids[k:], prov


def _split_given(chunks: list[Tensor], tokens: int, n_hold: int) -> tuple[list[Tensor], list[Tensor]]:
    """Truncate given chunks to the budget; the trailing chunks covering ``n_hold`` tokens are held out."""
    kept, total = [], 0
    for c in chunks:
        if total >= tokens:
            break
        kept.append(c.reshape(-1)[: tokens - total])
        total += kept[-1].numel()
    hold: list[Tensor] = []
    while n_hold > 0 and len(kept) > 1 and sum(c.numel() for c in hold) < n_hold:
        hold.insert(0, kept.pop())
    return kept, hold


def _forward(model: Any, chunks: Sequence[Tensor], bar: Any) -> None:
    body = getattr(model, "model", model)  # the decoder stack: skips the LM head, which calibration never needs
    device = next(model.parameters()).device
    for ids in chunks:
        body(input_ids=ids.view(1, -1).to(device), use_cache=False)
        if bar is not None:
            bar.update(int(ids.numel()))


def _clip(recorder: Recorder, rot: dict[str, Tensor], stats: CalibrationStats, spec: QuantSpec, progress: bool
          ) -> tuple[Tensor, Tensor, dict]:
    """Per-layer clip ratios (fitted or fixed) and the fit's record for provenance."""
    from tqdm.auto import tqdm

    L, H = stats.mu_k.shape[:2]
    k_clip = torch.full((L,), resolve_clip(spec.k_clip, DEFAULT_K_CLIP))
    v_clip = torch.full((L,), resolve_clip(spec.v_clip, DEFAULT_V_CLIP))
    record: dict[str, Any] = {}
    if not spec.fitted_clip:
        return k_clip, v_clip, record
    grid = list(spec.clip_grid)
    record = {"grid": grid, "k_error": [], "v_error": []}
    for i in tqdm(range(L), desc="fitting clip ratios", unit="layer", disable=not progress):
        held = recorder.layers[i].held_out
        layer = {n: (rot[n][i] if rot[n][i].ndim == 3 else rot[n][i].expand(H, -1, -1)).contiguous()
                 for n in ("r_k", "r_v")}
        zeros = torch.zeros_like(stats.mu_k[i])
        layer["mu_k"] = (stats.mu_k[i] if spec.centering else zeros).float()
        layer["mu_v"] = (stats.mu_v[i] if spec.centering else zeros).float()
        for which, clip in (("k", k_clip), ("v", v_clip)):
            if getattr(spec, f"{which}_clip") != "fitted":
                continue
            errs = clip_errors(held, layer, spec, grid, which)
            clip[i] = choose_ratio(grid, errs)
            record[f"{which}_error"].append([round(e, 6) for e in errs])
        if spec.bit_budget is None:
            recorder.layers[i].held_out = []  # free the layer's held-out q/k/v (format selection needs them)
    return k_clip, v_clip, record


def calibrate(
    model: Any,
    tokenizer: Any,
    data: DataLike,
    *,
    spec: QuantSpec | None = None,
    tokens: int = 8192,
    seed: int = 0,
    seq_len: int = 1024,
    holdout: float = 0.125,
    chat_template: bool = False,
    progress: bool = True,
    name: str = "",
    return_stats: bool = False,
) -> Calibration | tuple[Calibration, CalibrationStats]:
    """Calibrate OSCAR rotations, K/V means and clip ratios for ``model`` from ``tokens`` tokens of ``data``.

    Args:
        model: a transformers causal LM (llama, qwen2, qwen3 or gemma3_text), float32 on the CPU preferred.
        tokenizer: its tokenizer (may be None when ``data`` is already token chunks).
        data: a corpus name or .txt/.jsonl path (its calibration split is used), a ``Corpus``, a list of texts,
            a ``Chunks`` object or a list of LongTensor chunks.
        spec: the quantization spec (composition, granularity, target, weighting, centering, clip settings).
        tokens: total token budget; with fitted clipping the last ``holdout`` fraction is held out for the fit
            and the rest feeds the statistics.
        seed: chunk sampling seed. seq_len: tokens per forward chunk.
        return_stats: also return the raw float64 :class:`CalibrationStats`.
    """
    from tqdm.auto import tqdm

    spec = spec or QuantSpec()
    start = time.time()
    ident = check_model(model, spec, name)
    if spec.bit_budget is not None:
        from .select import check_budget

        check_budget(spec.bit_budget, ident.head_dim, spec)  # before any forward pass
    stat_chunks, hold_chunks, data_prov = plan_chunks(
        data, tokenizer, tokens=tokens, seq_len=seq_len, seed=seed,
        holdout=holdout if spec.fitted_clip or spec.bit_budget is not None else 0.0, chat_template=chat_template)
    if (spec.fitted_clip or spec.bit_budget is not None) and not hold_chunks:
        raise ValueError("fitted clip ratios and format selection need held-out chunks: give at least two chunks, "
                         "or fixed k_clip/v_clip and no bit_budget")
    need_c_s = spec.target == "attention"
    recorder = Recorder(ident.num_layers, ident.num_kv_heads, ident.head_dim,
                        need_kv=need_c_s and spec.value_weighting == "quadratic",
                        need_softmax=need_c_s and spec.value_weighting == "softmax")
    n_stat = sum(int(c.numel()) for c in stat_chunks)
    n_hold = sum(int(c.numel()) for c in hold_chunks)
    was_training = model.training
    model.eval()
    with torch.no_grad(), capture(model, recorder), tqdm(
        total=n_stat + n_hold, desc="calibration forward", unit="tok", disable=not progress
    ) as bar:
        _forward(model, stat_chunks, bar)
        recorder.phase = "holdout"
        _forward(model, hold_chunks, bar)
    model.train(was_training)
    stats = finalize(recorder, centering=spec.centering, value_weighting=spec.value_weighting, need_c_s=need_c_s)
    rot = rotations(stats, spec)
    k_clip, v_clip, fit_record = _clip(recorder, rot, stats, spec, progress)
    mu_k, mu_v = (stats.mu_k, stats.mu_v) if spec.centering else (torch.zeros_like(stats.mu_k),) * 2
    calib = Calibration(
        spec=spec, model=ident, r_k=rot["r_k"], r_v=rot["r_v"], eig_k=rot["eig_k"], eig_v=rot["eig_v"],
        mu_k=mu_k.float(), mu_v=mu_v.float(), k_clip=k_clip, v_clip=v_clip,
        provenance=_provenance(data_prov, n_stat, n_hold, seed, seq_len, chat_template, fit_record, start, hold_chunks,
                               spec),
    )
    if spec.bit_budget is not None:
        from .select import select_formats

        calib.layer_formats, record = select_formats([acc.held_out for acc in recorder.layers], calib,
                                                     spec.bit_budget, progress,
                                                     quantized_layers=quantized_layers(model))
        calib.provenance["format_selection"] = record
        calib.validate_shapes()
    for acc in recorder.layers:
        acc.held_out = []
    return (calib, stats) if return_stats else calib


def quantized_layers(model: Any) -> list[bool]:
    """Per layer: whether the cache quantizes it (its full-attention layers; sliding-window layers keep a bounded
    16-bit cache, see :mod:`oscarkv.hf.prepare`)."""
    from ..hf.prepare import full_attention_layers

    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return full_attention_layers(cfg)


def select_from(model: Any, tokenizer: Any, calib: Calibration, data: DataLike, *, budget: float | str | None = None,
                progress: bool = True) -> Calibration:
    """Per-layer format selection for an existing calibration ``calib`` (rotations, means and clip kept): one
    forward pass over its held-out chunks (re-drawn from ``data`` with the token budget, seed, chunk length and
    held-out fraction recorded in its provenance), then :func:`~oscarkv.calib.select.select_formats`. Returns a
    new Calibration with ``layer_formats`` and ``spec.bit_budget`` set."""
    import dataclasses

    from .select import check_budget, select_formats

    calib.check_model(model)
    budget = calib.spec.bit_budget if budget is None else budget
    budget = "kivi" if budget is None else budget
    check_budget(budget, calib.model.head_dim, calib.spec)  # before the held-out forward pass
    p = calib.provenance
    tokens, seed, seq_len = int(p.get("tokens", 8192)), int(p.get("seed", 0)), int(p.get("seq_len", 1024))
    n_hold = int(p.get("holdout_tokens", 0)) or int(round(tokens * 0.125))
    _, hold_chunks, data_prov = plan_chunks(data, tokenizer, tokens=tokens, seq_len=seq_len, seed=seed,
                                            holdout=n_hold / tokens, chat_template=bool(p.get("chat_template")))
    if not hold_chunks:
        raise ValueError("format selection needs held-out chunks; the calibration's token budget gave none")
    m = calib.model
    recorder = Recorder(m.num_layers, m.num_kv_heads, m.head_dim, need_kv=False, need_softmax=False)
    recorder.phase = "holdout"
    model.eval()
    with torch.no_grad(), capture(model, recorder):
        _forward(model, hold_chunks, None)
    formats, record = select_formats([acc.held_out for acc in recorder.layers], calib, budget, progress,
                                     quantized_layers=quantized_layers(model))
    names = data_prov.get("chunks")
    record["held_out"] = {"tokens": sum(int(c.numel()) for c in hold_chunks),
                          "chunks": names[-len(hold_chunks):] if isinstance(names, list) else len(hold_chunks)}
    prov = {**p, "format_selection": record}
    return dataclasses.replace(calib, spec=calib.spec.replace(bit_budget=budget), layer_formats=formats,
                               provenance=prov)


def _provenance(data_prov: dict, n_stat: int, n_hold: int, seed: int, seq_len: int, chat_template: bool,
                fit_record: dict, start: float, hold_chunks: list[Tensor], spec: QuantSpec) -> dict:
    import transformers

    from .. import __version__

    if hold_chunks:
        fit_record["fit_sink_window"] = [list(fit_windows(int(c.numel()), spec)) for c in hold_chunks]
    return {
        "kind": "calibration",
        "data": data_prov,
        "tokens": n_stat + n_hold,
        "stats_tokens": n_stat,
        "holdout_tokens": n_hold,
        "seed": seed,
        "seq_len": seq_len,
        "chat_template": chat_template,
        "clip_fit": fit_record,
        "oscarkv_version": __version__,
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "python_version": platform.python_version(),
        "wall_time_s": round(time.time() - start, 2),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


__all__ = ["calibrate", "select_from", "quantized_layers", "check_model", "plan_chunks", "CalibrationStats"]
