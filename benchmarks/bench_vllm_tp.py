"""vLLM 0.26.0 + OSCAR with tensor parallelism on a random-weight Qwen3-8B-shaped model.

    python benchmarks/bench_vllm_tp.py --phase tp1 --out OUT/tp1.json     # greedy tokens at TP=1, BF16 and OSCAR
    python benchmarks/bench_vllm_tp.py --phase tp2 --out OUT/tp2.json     # the same at TP=2, plus KV capacity and
                                                                          # offline throughput, BF16 vs OSCAR
    python benchmarks/bench_vllm_tp.py --merge tp1.json tp2.json --out docs/results/vllm_tp2_h200.json

The model (Qwen3-8B shape: 36 layers, 32/8 heads, d=128, hidden 4096, random weights from transformers' init,
seed 0, optional final-norm gain ``--peak``) is written once under ``--work`` as safetensors, so TP=1 and TP=2
load the same weights (vLLM's "dummy" loader would initialise each shard on its own). The calibration is random too
(orthogonal rotations, small means, clip 0.96/0.92, sink 64 + window 256). Every engine runs in its own process;
both kinds run eager, at the same ``gpu_memory_utilization``.

Greedy tokens: 4 prompts of random token ids (300..1400 tokens, so the 2-bit tier is in use), 24 new tokens, with
the top-20 log-probabilities of every step. Throughput: as many ``--context``-token prompts as the KV capacity
holds (capped by ``--max-seqs``), timed twice: 1 new token (prefill only) and ``--gen`` new tokens; the
difference gives the decode-phase rate.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                rope_theta=1000000.0, tie_word_embeddings=False, rms_norm_eps=1e-6)
PROMPT_LENS = (1400, 900, 600, 300)
FORCED_CHUNK = 256  # prefill chunk of the teacher-forced check: later chunks read the earlier ones as stored
NEW_TOKENS = 24
TOPK = 20
# NVLink multicast off (some multi-GPU hosts hang in NCCL's NVLS setup); children inherit these.
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def make_model(root: Path, peak: float = 1.0) -> tuple[Path, Path]:
    """Random-weight Qwen3-8B-shaped model + random calibration (deterministic; reused when present)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from bench_vllm import random_calibration  # the script's own folder is first on sys.path

    model_dir, calib_dir = root / f"qwen3-8b-random-gain{peak:g}", root / "qwen3-8b-random-calib"
    cfg = Qwen3Config(**QWEN3_8B, architectures=["Qwen3ForCausalLM"])
    if not (model_dir / "config.json").exists():
        torch.manual_seed(0)
        torch.set_default_dtype(torch.bfloat16)
        with torch.device("cuda"):
            model = Qwen3ForCausalLM(cfg)
            # Optional final-norm gain (--peak). Measured: it does not remove greedy ties, since bf16 logits
            # have a relative resolution of 2^-8 whatever their scale; the teacher-forced check is the one to read.
            with torch.no_grad():
                model.model.norm.weight.fill_(peak)
        torch.set_default_dtype(torch.float32)
        model.save_pretrained(model_dir, max_shard_size="4GB")
        del model
        torch.cuda.empty_cache()
    if not (calib_dir / "oscar.json").exists():
        random_calibration(cfg).save(calib_dir)
    return model_dir, calib_dir


def child(spec: dict) -> None:
    """One engine: greedy tokens with top-k log-probs, then (optionally) the throughput runs. Prints RESULT."""
    import torch
    from vllm import LLM, SamplingParams

    kw = dict(model=spec["model"], dtype="bfloat16", enforce_eager=True, skip_tokenizer_init=True,
              gpu_memory_utilization=spec["util"], max_model_len=spec["max_model_len"], seed=0,
              enable_prefix_caching=False, max_num_seqs=spec["max_num_seqs"], max_logprobs=TOPK,
              tensor_parallel_size=spec["tp"])
    if spec.get("oscar"):
        kw.update(attention_config={"backend": "CUSTOM"}, block_size=64, additional_config={"oscar": spec["oscar"]})
    if spec.get("forced"):
        kw.update(enable_chunked_prefill=True, max_num_batched_tokens=FORCED_CHUNK)
    t0 = time.time()
    llm = LLM(**kw)
    out: dict = {"engine_start_s": time.time() - t0}
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 150000, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    sp = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, detokenize=False, logprobs=TOPK, ignore_eos=True)
    res = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    out["greedy"] = [{"tokens": list(r.outputs[0].token_ids),
                      "top": [{str(t): lp.logprob for t, lp in step.items()} for step in r.outputs[0].logprobs]}
                     for r in res]
    if spec.get("forced"):  # teacher-forced: log-prob of every prompt token, prompts prefilled in chunks
        sp = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, prompt_logprobs=0)
        res = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        out["forced"] = [[next(iter(d.values())).logprob if d else None for d in r.prompt_logprobs] for r in res]
    cc = llm.llm_engine.vllm_config.cache_config
    out["kv_capacity_blocks"], out["block_size"] = cc.num_gpu_blocks, cc.block_size
    if spec.get("context"):
        ctx, new = spec["context"], spec["gen"]
        cap = (cc.num_gpu_blocks or 0) * cc.block_size
        n = max(1, min(spec["max_num_seqs"], cap // (ctx + new + cc.block_size)))
        batch = [{"prompt_token_ids": torch.randint(0, 150000, (ctx,), generator=gen).tolist()} for _ in range(n)]
        timings = {}
        for label, m in (("prefill", 1), ("full", new)):
            torch.cuda.synchronize()
            t = time.time()
            llm.generate(batch, SamplingParams(max_tokens=m, temperature=0.0, detokenize=False, ignore_eos=True),
                         use_tqdm=False)
            torch.cuda.synchronize()
            timings[label] = time.time() - t
        dec = timings["full"] - timings["prefill"]
        out.update(num_seqs=n, context=ctx, gen=new, prefill_s=timings["prefill"], wall_s=timings["full"],
                   output_tok_s=n * new / timings["full"], prefill_tok_s=n * ctx / timings["prefill"],
                   decode_tok_s=n * (new - 1) / dec if dec > 0 else None)
    print("RESULT " + json.dumps(out), flush=True)


def run_child(spec: dict, timeout: float) -> tuple[dict | None, str]:
    env = {**os.environ, **SAFE_ENV, "VLLM_USE_V2_MODEL_RUNNER": "0"}
    try:
        p = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True,
                           timeout=max(timeout, 1), env=env)
    except subprocess.TimeoutExpired as e:
        tail = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return None, f"timeout after {timeout:.0f} s\n{tail[-4000:]}"
    log = p.stdout + p.stderr
    lines = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    res = json.loads(lines[-1][7:]) if lines else None
    cap = re.findall(r"KV cache size: ([\d,]+) tokens", log)
    if res is not None and cap:
        res["kv_capacity_tokens_log"] = [int(c.replace(",", "")) for c in cap]
        res["kv_capacity_tokens"] = int(cap[-1].replace(",", ""))
    return res, log


def provenance(git_sha: str | None) -> dict:
    import vllm

    from oscarkv.bench.harness import provenance as base

    return {**base(git_sha), "vllm": vllm.__version__}


def compare(a: list[dict], b: list[dict]) -> dict:
    """Greedy agreement of two runs over the same prompts: exact-match rate, first divergence, and the largest
    top-20 log-prob difference over the steps before the first divergence (same prefix, so comparable)."""
    per = []
    for x, y in zip(a, b):
        n = len(x["tokens"])
        first = next((i for i, (s, t) in enumerate(zip(x["tokens"], y["tokens"])) if s != t), n)
        diffs = [abs(lp - y["top"][i][tok]) for i in range(first) for tok, lp in x["top"][i].items()
                 if tok in y["top"][i]]
        per.append({"first_divergence": first, "tokens": n, "identical": first == n,
                    "max_abs_top20_logprob_diff_before_divergence": max(diffs) if diffs else None})
    return {"prompts": per, "identical_prompts": sum(p["identical"] for p in per), "num_prompts": len(per)}


def phase(a, name: str) -> dict:
    t_start = time.time()
    left = lambda: a.deadline - (time.time() - t_start)  # noqa: E731
    root = Path(a.work)
    root.mkdir(parents=True, exist_ok=True)
    t = time.time()
    model_dir, calib_dir = make_model(root, a.peak)
    model = {"shape": "Qwen3-8B, random weights", "final_norm_gain": a.peak, **QWEN3_8B}
    report = {"phase": name + ("-forced" if a.forced else ""), "provenance": provenance(a.git_sha), "model": model,
              "model_write_s": time.time() - t, "runs": {}, "logs": {}}
    tp = 1 if name == "tp1" else 2
    common = {"model": str(model_dir), "util": a.util, "tp": tp, "max_model_len": max(a.context + a.gen, 2048) + 64}
    if tp == 2 and a.context:
        common.update(context=a.context, gen=a.gen)
    if a.forced:
        common.update(forced=True)
    plan = [("oscar", {**common, "oscar": {"calibration": str(calib_dir)}, "max_num_seqs": a.max_seqs}),
            ("bf16", {**common, "max_num_seqs": a.max_seqs})]
    report["settings"] = {k: v for k, v in common.items() if k != "model"} | {"max_num_seqs": a.max_seqs,
                                                                            "enforce_eager": True}
    for kind, spec in plan:
        if left() < 60:
            report["runs"][kind] = {"skipped": "deadline"}
            continue
        res, log = run_child(spec, left() - 15)
        report["runs"][kind], report["logs"][kind] = res, log[-5000:]
        print(kind, json.dumps({k: v for k, v in (res or {}).items() if k != "greedy"}), flush=True)
    report["wall_s"] = time.time() - t_start
    return report


def merge(paths: list[str]) -> dict:
    phases = {json.loads(Path(p).read_text())["phase"]: json.loads(Path(p).read_text()) for p in paths}
    tp1, tp2 = phases.get("tp1", {}), phases.get("tp2", {})
    sfx = "-forced" if "tp1-forced" in phases else ""
    out = {"provenance": {k: v.get("provenance") for k, v in phases.items()},
           "model": tp2.get("model") or tp1.get("model"),
           "settings": {k: v.get("settings") for k, v in phases.items()}, "runs": {}, "logs": {}}
    for ph, rep in phases.items():
        for kind, res in rep["runs"].items():
            out["runs"][f"{kind}_{ph}"] = res
            out["logs"][f"{kind}_{ph}"] = rep["logs"].get(kind)
    greedy = {k: (v or {}).get("greedy") for k, v in out["runs"].items()}
    checks = {}
    for kind in ("oscar", "bf16"):
        if greedy.get(f"{kind}_tp1") and greedy.get(f"{kind}_tp2"):
            checks[f"{kind}: tp2 vs tp1"] = compare(greedy[f"{kind}_tp1"], greedy[f"{kind}_tp2"])
    if greedy.get("bf16_tp1") and greedy.get("oscar_tp1"):
        checks["oscar vs bf16 at tp1 (quantization effect, for scale)"] = compare(greedy["bf16_tp1"],
                                                                                 greedy["oscar_tp1"])
    out["greedy_checks"] = checks
    forced = {k: (v or {}).get("forced") for k, v in out["runs"].items()}
    fchecks = {}
    for x, y, label in ((f"oscar_tp1{sfx}", f"oscar_tp2{sfx}", "oscar: tp2 vs tp1"),
                        (f"bf16_tp1{sfx}", f"bf16_tp2{sfx}", "bf16: tp2 vs tp1"),
                        (f"bf16_tp1{sfx}", f"oscar_tp1{sfx}", "oscar vs bf16 at tp1 (quantization effect, for scale)")):
        if forced.get(x) and forced.get(y):
            d = [abs(a - b) for p, q in zip(forced[x], forced[y]) for a, b in zip(p, q)
                 if a is not None and b is not None]
            fchecks[label] = {"positions": len(d), "mean_abs_logprob_diff": sum(d) / len(d),
                              "max_abs_logprob_diff": max(d)}
    if fchecks:
        out["forced_checks"] = fchecks
    r = {k: out["runs"].get(f"{k}_tp2") or {} for k in ("oscar", "bf16")}
    for key in ("kv_capacity_tokens", "output_tok_s", "decode_tok_s", "prefill_tok_s"):
        if r["oscar"].get(key) and r["bf16"].get(key):
            out[f"tp2_{key}_ratio"] = r["oscar"][key] / r["bf16"][key]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child")
    ap.add_argument("--phase", choices=("tp1", "tp2"))
    ap.add_argument("--merge", nargs="+")
    ap.add_argument("--out", default="vllm_tp.json")
    ap.add_argument("--work", default="/tmp/oscar-vllm-tp")
    ap.add_argument("--util", type=float, default=0.3)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--gen", type=int, default=192)
    ap.add_argument("--max-seqs", type=int, default=128)
    ap.add_argument("--peak", type=float, default=1.0, help="final RMSNorm gain of the random model")
    ap.add_argument("--forced", action="store_true", help="teacher-forced log-probs (chunked prefill of 256)")
    ap.add_argument("--deadline", type=float, default=500.0, help="seconds for the whole phase")
    ap.add_argument("--git-sha", default=None, help="commit of the code run (default: this checkout's HEAD)")
    a = ap.parse_args()
    if a.child:
        return child(json.loads(a.child))
    if a.merge:
        report = merge(a.merge)
    elif a.phase:
        os.environ.update(SAFE_ENV)
        report = phase(a, a.phase)
    else:
        ap.error("give --phase tp1|tp2 or --merge FILES")
    Path(a.out).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k not in ("logs", "runs")}, indent=1)[:6000])


if __name__ == "__main__":
    main()
