"""``oscarkv generate``: generate text through transformers with a quantized KV cache, then print a one-line
memory report (stored bytes against the same tokens in a 16-bit cache).

Example::

    oscarkv generate --model smollm2-135m --calibration calibrations/smollm2-135m --method oscar \\
        --prompt "The three most important ideas in this essay are" --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import sys
import time


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="smollm2-135m | qwen2.5-coder-0.5b | qwen2.5-coder-1.5b | HF folder "
                                                  "| .gguf file")
    p.add_argument("--calibration", help="calibration artifact folder (required by the oscar family and by "
                                         "centering; data-free '-nocenter' methods run without one)")
    p.add_argument("--method", default="oscar", help="cache method (see `oscarkv.methods`; default oscar)")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text")
    prompt.add_argument("--prompt-file", help="read the prompt from a text file")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (default 64)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    p.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=float, default=0.8, help="sampling temperature (default 0.8)")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass (default 0.95)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--window-dtype", choices=["auto", "bfloat16", "float16", "float32"], default="auto",
                   help="dtype of the 16-bit tiers (auto: the model's if 16-bit, else bfloat16)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")


def _calibration(args, model):
    from ..artifact import Calibration, ModelIdentity
    from ..methods import get

    method = get(args.method)
    if args.calibration:
        return Calibration.load(args.calibration, model)
    if method.quantized and (method.centering or method.rotation == "calibrated"):
        raise SystemExit(f"error: method {method.name!r} needs --calibration DIR (or use a data-free "
                         "'-nocenter' baseline such as naive-int2-nocenter)")
    return Calibration.identity(ModelIdentity.from_config(model.config))


def run(args: argparse.Namespace) -> int:
    import torch

    from .. import hf, models
    from ..methods import get

    get(args.method)  # an unknown name fails before the model loads
    if args.threads:
        torch.set_num_threads(args.threads)
    prompt = args.prompt if args.prompt is not None else open(args.prompt_file, encoding="utf-8").read()
    model, tok = models.load(args.model)
    calib = _calibration(args, model)
    if args.chat:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
    else:
        ids = tok(prompt, return_tensors="pt")["input_ids"]
    wdt = None if args.window_dtype == "auto" else getattr(torch, args.window_dtype)
    gen = dict(max_new_tokens=args.max_new_tokens, do_sample=args.sample,
               pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
    if args.sample:
        gen.update(temperature=args.temperature, top_p=args.top_p)
        torch.manual_seed(args.seed)
    with hf.apply(model, calib, args.method, window_dtype=wdt) as handle, torch.inference_mode():
        cache = handle.cache()
        t0 = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), cache=cache, **gen)
        dt = time.perf_counter() - t0
    new = out[0, ids.shape[1]:]
    print(tok.decode(new, skip_special_tokens=True))
    print(f"[{args.method}] {ids.shape[1]} prompt + {len(new)} new tokens in {dt:.1f}s; {cache.memory_report()}",
          file=sys.stderr)
    return 0
