"""``oscarkv calibrate``: calibrate rotations, means and clip ratios, select a format per layer and per K/V, and
write an artifact folder.

With no arguments it runs the embedded default: SmolLM2-135M on the calibration splits of the default mix
(:data:`oscarkv.data.DEFAULT_CALIBRATION`), 4096 tokens, the default recipe (:meth:`QuantSpec.default_recipe`:
16-bit tiers no larger than KIVI-2's, per-layer formats under KIVI-2's nominal bits; ``--bit-budget none`` skips
the selection, ``--config`` replaces the recipe), written to ``./oscar-smollm2-135m``, and prints a summary with
the physical bits of the result.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_TOKENS = 4096
SUMMARY_LENGTHS = (4096, 32768)  # contexts at which the summary states physical bits


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="smollm2-135m | qwen2.5-coder-0.5b | qwen2.5-coder-1.5b | HF folder | .gguf file "
                             f"(default {DEFAULT_MODEL})")
    from oscarkv.data import DEFAULT_CALIBRATION

    parser.add_argument("--data", default=DEFAULT_CALIBRATION,
                        help="shakespeare | kjv | essays | code | docs (calibration split), a mix such as code+docs, "
                             f"or a .txt/.jsonl file (default {DEFAULT_CALIBRATION})")
    parser.add_argument("--tokens", type=int, default=DEFAULT_TOKENS, help=f"token budget (default {DEFAULT_TOKENS})")
    parser.add_argument("--out", help="artifact folder (default ./oscar-<model>)")
    parser.add_argument("--config", help="QuantSpec file (.yaml/.yml/.json); unknown keys are errors")
    parser.add_argument("--seed", type=int, default=0, help="chunk sampling seed (default 0)")
    parser.add_argument("--seq-len", type=int, default=1024, help="tokens per calibration chunk (default 1024)")
    parser.add_argument("--holdout", type=float, default=0.125,
                        help="fraction of the budget held out to fit clip ratios (default 0.125)")
    parser.add_argument("--granularity", choices=("layer", "head"), help="override the spec's granularity")
    parser.add_argument("--composition", choices=("uhp", "uh", "u", "h", "none"),
                        help="override the spec's rotation composition")
    from oscarkv.config import DEFAULT_RECIPE

    parser.add_argument("--bit-budget", type=_budget, default=None, metavar="BITS|kivi|none",
                        help="select a format per layer and per K/V (method oscar-auto) under this mean number of "
                             "bits per element of the quantized layers' 2-bit tier; 'kivi' = KIVI-2's nominal bits "
                             f"at the model's head_dim; 'none' = one format for all layers (default: the --config "
                             f"file's bit_budget, else {DEFAULT_RECIPE['bit_budget']}; docs/recipe.md)")
    parser.add_argument("--select-from", metavar="DIR",
                        help="only run the format selection for the existing artifact DIR (its rotations, means and "
                             "clip ratios are kept; its held-out chunks are re-drawn from --data) and write --out")
    parser.add_argument("--chat-template", action="store_true", help="wrap each chunk in the model's chat template")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads for this run (default: torch's choice). On a shared, oversubscribed "
                             "machine --threads 1 can be several times faster")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


def _budget(text: str):
    if text in ("kivi", "none"):
        return text
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--bit-budget wants a number of bits per element or 'kivi', got {text!r}")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"--bit-budget must be > 0, got {text!r}")
    return value


def _spec(args: argparse.Namespace):
    from oscarkv.config import QuantSpec

    spec = QuantSpec.load(args.config) if args.config else QuantSpec.default_recipe()
    overrides = {k: getattr(args, k) for k in ("granularity", "composition") if getattr(args, k)}
    budget = args.bit_budget
    if budget is None:
        from oscarkv.config import DEFAULT_RECIPE

        budget = spec.bit_budget if spec.bit_budget is not None else DEFAULT_RECIPE["bit_budget"]
    overrides["bit_budget"] = None if budget == "none" else budget
    return spec.replace(**overrides)


def run(args: argparse.Namespace) -> int:
    import torch

    from oscarkv import models
    from oscarkv.artifact import UnsupportedModelError
    from oscarkv.calib import calibrate
    from oscarkv.config import ConfigError
    from oscarkv.data import DataNotAvailableError
    from oscarkv.rotation import RotationError

    from .inspect import format_summary

    if args.threads is not None:
        if args.threads < 1:
            print("error: --threads must be at least 1", file=sys.stderr)
            return 2
        torch.set_num_threads(args.threads)  # this process is the CLI's own: no library-wide state is touched
    if args.tokens < 2:
        print("error: --tokens must be at least 2", file=sys.stderr)
        return 2
    out = Path(args.out or f"oscar-{Path(str(args.model)).name.removesuffix('.gguf')}")
    t0 = time.time()
    try:
        spec = _spec(args)
        print(f"loading {args.model} ...", file=sys.stderr)
        model, tok = models.load(args.model, dtype=torch.float32)
        load_s = time.time() - t0
        if args.select_from:
            return _select_only(args, model, tok, out, t0)
        calib = calibrate(model, tok, args.data, spec=spec, tokens=args.tokens, seed=args.seed, seq_len=args.seq_len,
                          holdout=args.holdout, chat_template=args.chat_template, progress=not args.quiet,
                          name=str(args.model))
    except (models.ModelNotAvailableError, DataNotAvailableError, UnsupportedModelError, RotationError,
            ConfigError, FileNotFoundError, ValueError) as e:  # ArtifactError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2
    calib.provenance["model_load_s"] = round(load_s, 2)
    bits = physical_summary(model, calib)
    calib.save(out)
    print(format_summary(calib, out))
    if bits:
        print(bits)
    print(f"total        {time.time() - t0:.1f} s (model load {load_s:.1f} s, calibration "
          f"{calib.provenance['wall_time_s']:.1f} s)")
    return 0


def _select_only(args: argparse.Namespace, model, tok, out: Path, t0: float) -> int:
    """``--select-from DIR``: format selection for an existing artifact, written to ``--out``."""
    from oscarkv.artifact import Calibration
    from oscarkv.calib import select_from

    from .inspect import format_summary

    if Path(args.select_from).resolve() == out.resolve():
        raise ValueError("--out must differ from --select-from (the source artifact is not overwritten)")
    base = Calibration.load(args.select_from, model=model)
    from oscarkv.config import DEFAULT_RECIPE

    if args.bit_budget == "none":
        raise ValueError("--select-from selects per-layer formats: give a --bit-budget (BITS or kivi), not none")
    calib = select_from(model, tok, base, args.data, budget=args.bit_budget or DEFAULT_RECIPE["bit_budget"],
                        progress=not args.quiet)
    calib.provenance["selected_from"] = str(Path(args.select_from).resolve())
    calib.provenance["selection_wall_time_s"] = round(time.time() - t0, 2)
    bits = physical_summary(model, calib)
    calib.save(out)
    print(format_summary(calib, out))
    if bits:
        print(bits)
    return 0


def physical_summary(model, calib) -> str:
    """One line on the per-layer selection's bits (nominal over the quantized layers; physical, 16-bit tiers
    included, at :data:`SUMMARY_LENGTHS` tokens, next to KIVI-2's), also recorded in the provenance; empty
    without per-layer formats."""
    import warnings

    from oscarkv import methods
    from oscarkv.calib import quantized_layers
    from oscarkv.eval.paths import physical_bits

    sel = calib.provenance.get("format_selection")
    if calib.layer_formats is None or not sel:
        return ""
    mask, d = quantized_layers(model), calib.model.head_dim
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        auto, kivi = methods.resolve("oscar-auto", calib), methods.resolve("kivi-2", calib)
    phys = {n: round(physical_bits(auto, d, n, mask), 4) for n in SUMMARY_LENGTHS}
    ref = {n: round(physical_bits(kivi, d, n, mask), 4) for n in SUMMARY_LENGTHS}
    sel["physical_bits"] = {str(n): b for n, b in phys.items()}
    sel["kivi2_physical_bits"] = {str(n): b for n, b in ref.items()}
    at = ", ".join(f"{phys[n]:.3f} at {n} tokens (kivi-2 {ref[n]:.3f})" for n in SUMMARY_LENGTHS)
    return (f"per-layer    {sel['bits_per_element']:.3f} bits/element nominal over {sel.get('quantized_layers', '?')} "
            f"quantized layers (budget {sel['budget']:.3f}); physical, 16-bit tiers included: {at}")
