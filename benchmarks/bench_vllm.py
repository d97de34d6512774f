"""vLLM 0.26.0 BF16 vs vLLM + OSCAR on one GPU: KV capacity (vLLM's own log line), offline throughput at long
context under the same ``gpu_memory_utilization``, and OSCAR logits against the project's transformers reference.

    python benchmarks/bench_vllm.py --out vllm_h200.json [--util 0.15] [--context 32000]

A random-weight Qwen3-shaped model (28 layers, 16/8 heads, d=128) is written first, with a random calibration
(orthogonal rotations, small means, clip 0.96/0.92, sink 64 + window 256). Each engine runs in its own process
(``--child``) so the two never share GPU memory. Both run eager (``enforce_eager``); the BF16 baseline uses
vLLM's default backend (FlashAttention 3 on an H200). A deadline bounds the whole run; phases past it are recorded
as skipped. OSCAR's logits are checked against ``oscarkv.hf.simulate`` (``--max-kl``); if that fails, no speed is
reported and the script exits 1.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

QWEN3 = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
             num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
             rope_theta=1000000.0, tie_word_embeddings=True, rms_norm_eps=1e-6)


def make_model(root: Path) -> tuple[Path, Path]:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    model_dir, calib_dir = root / "qwen3-random", root / "qwen3-random-calib"
    cfg = Qwen3Config(**QWEN3, architectures=["Qwen3ForCausalLM"])
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(model_dir)
    del model
    random_calibration(cfg).save(calib_dir)
    return model_dir, calib_dir


def random_calibration(cfg, seed: int = 0):
    """A calibration for a random model: orthogonal rotations per layer, small means, clip 0.96 / 0.92."""
    import torch

    from oscarkv.artifact import Calibration, ModelIdentity
    from oscarkv.config import QuantSpec
    from oscarkv.rotation import random_orthogonal

    ident = ModelIdentity.from_config(cfg)
    calib = Calibration.identity(ident, QuantSpec(k_clip=0.96, v_clip=0.92))
    g = torch.Generator().manual_seed(seed)
    L, H, d = ident.num_layers, ident.num_kv_heads, ident.head_dim
    calib.r_k = torch.stack([random_orthogonal(d, g) for _ in range(L)])
    calib.r_v = torch.stack([random_orthogonal(d, g) for _ in range(L)])
    calib.mu_k, calib.mu_v = torch.randn(L, H, d, generator=g) * 0.05, torch.randn(L, H, d, generator=g) * 0.05
    calib.k_clip, calib.v_clip = torch.full((L,), 0.96), torch.full((L,), 0.92)
    return calib


def child(spec: dict) -> None:
    """One engine: optional logits task (full log-probs saved), optional throughput task. Prints RESULT json."""
    import torch
    from vllm import LLM, SamplingParams

    kw = dict(model=spec["model"], dtype="bfloat16", enforce_eager=True, skip_tokenizer_init=True,
              gpu_memory_utilization=spec["util"], max_model_len=spec["max_model_len"], seed=0,
              enable_prefix_caching=False, max_num_seqs=spec["max_num_seqs"], max_logprobs=-1,
              max_num_batched_tokens=spec["max_batched_tokens"], disable_log_stats=False)
    if spec.get("oscar"):
        kw.update(attention_config={"backend": "CUSTOM"}, block_size=64, additional_config={"oscar": spec["oscar"]})
    t0 = time.time()
    llm = LLM(**kw)
    out = {"engine_start_s": time.time() - t0}
    gen = torch.Generator().manual_seed(1)
    if spec.get("logits_prompts"):
        prompts = [torch.randint(0, 150000, (n,), generator=gen).tolist() for n in spec["logits_prompts"]]
        sp = SamplingParams(max_tokens=16, temperature=0.0, detokenize=False, logprobs=-1, ignore_eos=True)
        res = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        dense = []
        for r in res:
            steps = r.outputs[0].logprobs
            lp = torch.full((len(steps), QWEN3["vocab_size"]), float("-inf"))
            for i, s in enumerate(steps):
                lp[i, torch.tensor(list(s.keys()))] = torch.tensor([x.logprob for x in s.values()])
            dense.append(lp)
        torch.save({"prompts": prompts, "tokens": [list(r.outputs[0].token_ids) for r in res], "logprobs": dense},
                   spec["logits_out"])
    cc = llm.llm_engine.vllm_config.cache_config
    if cc.num_gpu_blocks:
        out["kv_capacity_blocks"], out["block_size"] = cc.num_gpu_blocks, cc.block_size
    if spec.get("context"):
        ctx, new = spec["context"], spec["gen"]
        cap = (cc.num_gpu_blocks or 0) * cc.block_size
        n = max(1, min(spec["max_num_seqs"], cap // (ctx + new + cc.block_size)))  # as many as fit at once
        prompts = [{"prompt_token_ids": torch.randint(0, 150000, (ctx,), generator=gen).tolist()} for _ in range(n)]
        sp = SamplingParams(max_tokens=new, temperature=0.0, detokenize=False, ignore_eos=True)
        # warm-up: steps that mix one prompt with 0..9 decode rows, then decode-only batches of 9..1, so that
        # first-use work (kernel builds for each launch shape, ~1.7 s each) stays out of the timed phases
        llm.generate(prompts[:10], SamplingParams(max_tokens=12, detokenize=False, ignore_eos=True), use_tqdm=False)
        out.update(num_seqs=n, context=ctx, gen=new, **timed_generate(llm.llm_engine, prompts, sp))
    print("RESULT " + json.dumps(out), flush=True)


# counters, reported per step as differences
_DELTAS = {"prompt_tokens", "generation_tokens", "preemptions", "alloc_retries", "device_allocs"}
_METRICS = {"vllm:prompt_tokens": "prompt_tokens", "vllm:generation_tokens": "generation_tokens",
            "vllm:num_preemptions": "preemptions", "vllm:num_requests_running": "running",
            "vllm:num_requests_waiting": "waiting", "vllm:kv_cache_usage_perc": "kv_usage"}


def _counters(engine) -> dict:
    """vLLM's scheduler counters and gauges now (empty where this vLLM does not report them), and this process's
    CUDA caching allocator (where the model runs in this process: VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    import torch

    out = {}
    if torch.cuda.is_initialized():
        st = torch.cuda.memory_stats()
        out.update(alloc_retries=st.get("num_alloc_retries", 0), device_allocs=st.get("num_device_alloc", 0),
                   reserved_gib=round(st.get("reserved_bytes.all.current", 0) / 2**30, 2))
    try:
        metrics = engine.get_metrics()
    except Exception:  # noqa: BLE001 - stats off or another vLLM: the step times alone
        return out
    for m in metrics:
        key = _METRICS.get(getattr(m, "name", ""))
        if key is not None and isinstance(getattr(m, "value", None), (int, float)):
            out[key] = out.get(key, 0) + m.value
    return out


def timed_generate(engine, prompts: list, sp) -> dict:
    """Run ``prompts`` through the engine's step loop and time its phases: the whole run (prefill included), and
    the steady decode window in which every sequence is decoding (from the step after which all have their first
    token to the first step that finishes one), i.e. decode throughput at batch ``len(prompts)``."""
    import torch

    tokens: dict[str, int] = {}
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, sp)
    window_start = window_end = None
    step_s: list[float] = []  # every step's wall time, until all sequences decode (where the prefill phase goes)
    step_info: list[dict] = []  # ... and what the step held (vLLM's own counters, where it reports them)
    last, seen = t0, _counters(engine)
    gc_s = [0.0, 0.0]  # this process's garbage collection: seconds so far, start of the one running

    def gc_timer(phase, _info):
        if phase == "start":
            gc_s[1] = time.perf_counter()
        else:
            gc_s[0] += time.perf_counter() - gc_s[1]
    gc.callbacks.append(gc_timer)
    gc_seen = 0.0
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        if window_start is None:
            step_s.append(now - last)
            cur = _counters(engine)
            step_info.append({"first_tokens": sum(1 for o in outs if len(o.outputs[0].token_ids) == 1),
                              "gc_s": round(gc_s[0] - gc_seen, 4),
                              **{k: cur[k] - seen.get(k, 0) if k in _DELTAS else cur[k] for k in cur}})
            seen, gc_seen = cur, gc_s[0]
        last = now
        for o in outs:
            tokens[o.request_id] = len(o.outputs[0].token_ids)  # cumulative output kind
        done = sum(tokens.values())
        if window_start is None and len(tokens) == len(prompts):
            window_start = (now, done)
        if window_end is None and window_start is not None and any(o.finished for o in outs):
            window_end = (now, done - sum(1 for o in outs if o.finished))  # tokens of steps before this one
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    gc.callbacks.remove(gc_timer)
    n, new = len(prompts), sp.max_tokens
    res = {"wall_s": wall, "output_tok_s": n * new / wall, "total_tok_s": n * (len(prompts[0]["prompt_token_ids"])
                                                                               + new) / wall}
    if window_start is not None:
        res["prefill_phase_s"] = window_start[0] - t0
        res["prefill_phase_step_s"] = [round(x, 4) for x in step_s]
        res["prefill_phase_steps"] = step_info
    if window_start is not None and window_end is not None and window_end[0] > window_start[0]:
        steps_tok = window_end[1] - window_start[1]
        dt = window_end[0] - window_start[0]
        res.update(decode_window_s=dt, decode_window_tokens=steps_tok, decode_tok_s=steps_tok / dt,
                   decode_step_ms=1e3 * dt / max(1, steps_tok / n))
    return res


def run_child(spec: dict, timeout: float) -> tuple[dict | None, str]:
    env = {**os.environ, "VLLM_USE_V2_MODEL_RUNNER": "0", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    try:
        p = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True,
                           timeout=max(timeout, 1), env=env)
    except subprocess.TimeoutExpired as e:
        return None, f"timeout after {timeout:.0f} s\n{(e.stdout or b'')[-4000:]}"
    log = p.stdout + p.stderr
    lines = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    res = json.loads(lines[-1][7:]) if lines else None
    cap = re.findall(r"KV cache size: ([\d,]+) tokens", log)
    if res is not None and cap:
        res["kv_capacity_tokens"] = int(cap[-1].replace(",", ""))
    return res, log


def logits_check(model_dir: Path, calib_dir: Path, path: Path) -> dict:
    """KL of the project's transformers reference (oscarkv.hf.simulate, same calibration) to vLLM + OSCAR."""
    import torch
    from transformers import AutoModelForCausalLM

    from oscarkv import hf
    from oscarkv.artifact import Calibration

    data = torch.load(path)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).cuda().eval()
    calib = Calibration.load(calib_dir, model)
    kls, agree, maxdiff = [], [], []
    for p, toks, lp in zip(data["prompts"], data["tokens"], data["logprobs"]):
        ids = torch.tensor([p + toks[:-1]], device="cuda")
        with torch.no_grad(), hf.simulate(model, calib, "oscar", prompt_len=len(p)):
            ref = model(ids, use_cache=False).logits[0, len(p) - 1:].float().log_softmax(-1).cpu()
        v = lp[:, : ref.shape[1]]
        kls.append(float((ref.exp() * (ref - v)).nan_to_num(0).sum(-1).mean()))
        agree.append(float((ref.argmax(-1) == torch.tensor(toks)).float().mean()))
        top = ref.topk(20, -1).indices
        maxdiff.append(float((ref.gather(1, top) - v.gather(1, top)).abs().max()))
    return {"kl_ref_vs_vllm_mean": kls, "greedy_agreement": agree, "max_abs_logprob_diff_top20": maxdiff}


def provenance(git_sha: str | None) -> dict:
    import vllm

    from oscarkv.bench.harness import provenance as base

    return {**base(git_sha), "vllm": vllm.__version__}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child")
    ap.add_argument("--out", default="vllm_h200.json")
    ap.add_argument("--work", default="/tmp/oscar-vllm-bench")
    ap.add_argument("--util", type=float, default=0.15)
    ap.add_argument("--context", type=int, default=32000)
    ap.add_argument("--gen", type=int, default=256, help="tokens generated per sequence")
    ap.add_argument("--max-batched-tokens", type=int, default=0,
                    help="vLLM max_num_batched_tokens for both engines (default: the model length, one chunk per "
                         "prompt)")
    ap.add_argument("--deadline", type=float, default=400.0, help="seconds for the whole run")
    ap.add_argument("--git-sha", default=None, help="commit of the code run (default: this checkout's HEAD)")
    ap.add_argument("--max-kl", type=float, default=1e-2,
                    help="largest mean KL (nats/token) of vLLM + OSCAR to the transformers reference; above it, or "
                         "without the check, no speed is reported and the script exits 1")
    a = ap.parse_args()
    if a.child:
        return child(json.loads(a.child))
    t_start = time.time()
    left = lambda: a.deadline - (time.time() - t_start)  # noqa: E731
    root = Path(a.work)
    root.mkdir(parents=True, exist_ok=True)
    model_dir, calib_dir = make_model(root)
    report = {"provenance": provenance(a.git_sha), "model": {"shape": "Qwen3-0.6B-like, random weights", **QWEN3},
              "settings": {"gpu_memory_utilization": a.util, "context": a.context, "gen": a.gen, "enforce_eager": True,
                           "max_num_batched_tokens": a.max_batched_tokens or a.context + a.gen + 64},
              "runs": {}, "logs": {}}
    max_len = a.context + a.gen + 64
    common = {"model": str(model_dir), "util": a.util, "max_model_len": max_len, "context": a.context, "gen": a.gen,
              "max_batched_tokens": a.max_batched_tokens or max_len}
    plan = [  # OSCAR first: its logits check matters most if the deadline cuts the run short
        ("oscar", {**common, "oscar": {"calibration": str(calib_dir)}, "max_num_seqs": 48,
                   "logits_prompts": [1200, 700], "logits_out": str(root / "oscar_logits.pt")}),
        ("bf16", {**common, "max_num_seqs": 64}),
    ]
    for name, spec in plan:
        if left() < 45:
            report["runs"][name] = {"skipped": "deadline"}
            continue
        res, log = run_child(spec, left() - 20)
        report["runs"][name], report["logs"][name] = res, log[-6000:]
        print(name, json.dumps(res), flush=True)
    r = {k: report["runs"].get(k) or {} for k in ("oscar", "bf16")}
    if r["oscar"].get("kv_capacity_tokens") and r["bf16"].get("kv_capacity_tokens"):
        report["kv_capacity_ratio"] = r["oscar"]["kv_capacity_tokens"] / r["bf16"]["kv_capacity_tokens"]
    for key in ("output_tok_s", "decode_tok_s"):
        if r["oscar"].get(key) and r["bf16"].get(key):
            report[key.replace("_tok_s", "") + "_throughput_ratio"] = r["oscar"][key] / r["bf16"][key]
    try:
        report["logits_check"] = logits_check(model_dir, calib_dir, root / "oscar_logits.pt")
    except Exception as e:  # noqa: BLE001 - recorded, and it withholds the speeds below
        report["logits_check"] = {"error": repr(e)[:2000]}
    kls = report["logits_check"].get("kl_ref_vs_vllm_mean")
    refused = None if kls and max(kls) <= a.max_kl else f"logits check failed or missing: {report['logits_check']}"
    if refused:  # no speed for an engine whose outputs do not match the reference
        report["refused"] = refused
        for key in [k for k in report if k.endswith("_ratio")]:
            del report[key]
        for key in ("wall_s", "output_tok_s", "total_tok_s", "decode_tok_s", "decode_step_ms", "prefill_phase_s"):
            (report["runs"].get("oscar") or {}).pop(key, None)
    report["wall_s"] = time.time() - t_start
    Path(a.out).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "logs"}, indent=1))
    if refused:
        raise SystemExit(f"no speed reported: {refused}")


if __name__ == "__main__":
    main()
