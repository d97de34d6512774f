"""Generation quality and bytes of KV-cache methods through the transformers integration (``oscarkv.hf``).

1. The unmodified float32 model decodes ``--new-tokens`` greedily after a ``--prompt-tokens`` prompt taken from a
   held-out essay (the reference trajectory and its next-token distributions).
2. Each method prefills the same prompt into its own ``OscarCache`` and is teacher-forced along the reference
   trajectory, one token at a time through the real cache; per step, KL(reference || method) of the next-token
   distributions. Reported: the mean over steps, and how many of the method's argmax tokens agree.
3. Bytes: a ``--bytes-context``-token text prefilled (in chunks) into each method's cache; ``nbytes()`` against a
   16-bit cache of the same tokens.

    python benchmarks/hf_trajectory_kl.py --model smollm2-135m --calibration calibrations/smollm2-135m \\
        --methods bf16,oscar,naive-int2 --out hf_trajectory_kl.json

Prints a table and writes JSON with a provenance line.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import transformers

from oscarkv.bench.harness import provenance
from oscarkv.eval.metrics import kl_rows as kl
from oscarkv.eval.trajectory import forced_logprobs, reference_trajectory


def cache_bytes(model, handle, ids: torch.Tensor, chunk: int):
    cache = handle.cache()
    for t in range(0, ids.shape[1], chunk):
        model(ids[:, t: t + chunk], cache=cache)
    return cache.nbytes()


def main(argv=None) -> int:
    from oscarkv import hf, models
    from oscarkv.artifact import Calibration
    from oscarkv.data import load_corpus

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--calibration", required=True)
    p.add_argument("--methods", default="bf16,oscar,naive-int2")
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--bytes-context", type=int, default=4096)
    p.add_argument("--essay", type=int, default=0, help="index of the held-out essay (evaluation split)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="hf_trajectory_kl.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    model, tok = models.load(args.model)
    calib = Calibration.load(args.calibration, model)
    docs = load_corpus("essays", "evaluation").documents
    text = "\n\n".join(d.text for d in docs[args.essay:])
    ids = tok(text, return_tensors="pt")["input_ids"][:, : max(args.prompt_tokens, args.bytes_context)]
    prompt = ids[:, : args.prompt_tokens]
    t0 = time.perf_counter()
    tokens, ref = reference_trajectory(model, prompt, args.new_tokens)
    prov = {**provenance(), "transformers": transformers.__version__, "threads": args.threads}
    results = {"provenance": prov, "args": vars(args), "document": docs[args.essay].name,
               "reference_seconds": round(time.perf_counter() - t0, 1), "methods": {}}
    print(f"{'method':<22} {'mean KL':>9} {'max KL':>8} {'argmax agree':>12} {'bytes/bf16 @ctx':>16} {'bits/el':>8}")
    for name in args.methods.split(","):
        with hf.apply(model, calib, name) as handle:
            t0 = time.perf_counter()
            logp = forced_logprobs(model, handle.cache(), prompt, tokens)
            secs = time.perf_counter() - t0
            b = cache_bytes(model, handle, ids[:, : args.bytes_context], chunk=512)
        per_step = kl(ref, logp)
        agree = (logp.argmax(-1) == tokens).float().mean().item()
        results["methods"][name] = {
            "kl_mean": per_step.mean().item(), "kl_max": per_step.max().item(), "kl_per_step": per_step.tolist(),
            "argmax_agreement": agree, "seconds": round(secs, 1),
            "bytes": {"context": ids[:, : args.bytes_context].shape[1], "used": b.used, "used_16bit": b.used_16bit,
                      "used_quantized": b.used_quantized, "allocated": b.allocated,
                      "bf16_equivalent": b.bf16_equivalent, "ratio_to_bf16": b.ratio_to_bf16,
                      "bits_per_element": b.bits_per_element},
        }
        print(f"{name:<22} {per_step.mean().item():>9.4f} {per_step.max().item():>8.3f} {agree:>12.3f} "
              f"{b.ratio_to_bf16:>16.4f} {b.bits_per_element:>8.3f}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
