"""vLLM 0.26.0 as its users run it against vLLM + OSCAR on one GPU: KV capacity (vLLM's own log line), offline
throughput at long context under the same ``gpu_memory_utilization``, and OSCAR logits against the project's
transformers reference.

    python benchmarks/bench_vllm.py --out vllm.json [--modes bf16,fp8,int4_per_token_head,oscar] \
        [--shape 0.6b|8b] [--contexts 32000] [--gens 128,1024] [--util 0.15]

A random-weight Qwen3-shaped model is written first, with a random calibration (orthogonal rotations, small means,
clip 0.96/0.92, sink 64 + window 256). Each mode is one engine in its own process (``--child``), so that no two
share GPU memory; each engine runs every (context, output length) cell with as many sequences as fit at once.
Modes (``MODES``): vLLM's defaults (``bf16``: CUDA graphs on, FlashAttention 3 on Hopper), ``bf16-eager``, vLLM's
own quantized caches (``fp8``, ``int4_per_token_head``, ``int8_per_token_head``, ``nvfp4``, ``turboquant_*``), and
the plugin (``oscar``: vLLM's defaults plus the backend, whose decode batches run inside vLLM's full CUDA graphs;
``oscar-piecewise``; ``oscar-eager``). A mode that fails at start is recorded
with the last lines of its log. A deadline bounds the whole run; modes past it are recorded as skipped. OSCAR's
logits are checked against ``oscarkv.hf.simulate`` (``--max-kl``); if that fails, no OSCAR speed is reported and
the script exits 1.
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
from collections import Counter
from pathlib import Path

QWEN3 = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
             num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
             rope_theta=1000000.0, tie_word_embeddings=True, rms_norm_eps=1e-6)
SHAPES = {"0.6b": ("Qwen3-0.6B-like", QWEN3),
          "8b": ("Qwen3-8B-like", {**QWEN3, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                                   "num_attention_heads": 32, "tie_word_embeddings": False})}
# engine keyword arguments of each mode, on top of the shared ones (vLLM's defaults: CUDA graphs on)
MODES = {
    "bf16": {}, "bf16-eager": {"enforce_eager": True},
    **{dt: {"kv_cache_dtype": dt} for dt in ("fp8", "int4_per_token_head", "int8_per_token_head", "nvfp4",
                                             "turboquant_3bit_nc", "turboquant_k3v4_nc", "turboquant_4bit_nc",
                                             "turboquant_k8v4")},
    "oscar": {"oscar": True}, "oscar-eager": {"oscar": True, "enforce_eager": True},
    # vLLM's piecewise graphs only: attention outside vLLM's graphs (the backend's own per-layer decode graphs)
    "oscar-piecewise": {"oscar": True, "compilation_config": {"cudagraph_mode": "PIECEWISE"}},
}


def make_model(root: Path, shape: dict, max_len: int) -> tuple[Path, Path]:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    model_dir, calib_dir = root / "qwen3-random", root / "qwen3-random-calib"
    cfg = Qwen3Config(**{**shape, "max_position_embeddings": max(shape["max_position_embeddings"], max_len)},
                      architectures=["Qwen3ForCausalLM"])
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


class KernelBuilds:
    """Counts the kernels built in this process: Triton JIT compilations (every kernel module, vLLM's too) and the
    plugin's CUDA decode cubins loaded. ``take()`` returns what was built since the last call, by kernel name."""

    def __init__(self):
        import triton

        self.seen: list[str] = []
        runtime = triton.knobs.runtime
        previous = runtime.jit_post_compile_hook

        def hook(*args, **kw):
            fn = kw.get("fn")
            base = getattr(fn, "fn", fn)
            self.seen.append(f"{getattr(base, '__module__', '?')}.{getattr(base, '__name__', '?')}")
            return previous(*args, **kw) if previous is not None else None

        runtime.jit_post_compile_hook = hook
        self._cubins = self._cubin_misses()

    @staticmethod
    def _cubin_misses() -> int:
        from oscarkv.kernels import decode_cuda

        return decode_cuda._functions.cache_info().misses

    def take(self) -> dict:
        names, self.seen = self.seen, []
        cubins = self._cubin_misses()
        delta, self._cubins = cubins - self._cubins, cubins
        return {"triton": len(names), "decode_cubins": delta, "by_kernel": dict(Counter(names))}


def child(spec: dict) -> None:
    """One engine: optional logits task (full log-probs saved), then every (context, output length) cell with as
    many sequences as fit at once. Prints RESULT json."""
    import torch
    from vllm import LLM, SamplingParams

    mode = dict(MODES[spec["mode"]])
    kw = dict(model=spec["model"], dtype="bfloat16", enforce_eager=mode.pop("enforce_eager", False),
              skip_tokenizer_init=True, gpu_memory_utilization=spec["util"], max_model_len=spec["max_model_len"],
              seed=0, enable_prefix_caching=False, max_num_seqs=spec["max_num_seqs"], max_logprobs=-1,
              max_num_batched_tokens=spec["max_batched_tokens"], disable_log_stats=False)
    if mode.pop("oscar", False):
        kw.update(attention_config={"backend": "CUSTOM"}, block_size=64,
                  additional_config={"oscar": {"calibration": spec["calibration"]}})
    kw.update(mode)
    builds = KernelBuilds()
    t0 = time.time()
    llm = LLM(**kw)
    out = {"engine_start_s": time.time() - t0, "engine_kwargs": {k: v for k, v in kw.items() if k != "model"},
           "model_runner": "v2" if llm.llm_engine.vllm_config.use_v2_model_runner else "v1",
           "kernel_builds": {"engine_start": builds.take()}}
    gen = torch.Generator().manual_seed(1)
    vocab = llm.llm_engine.vllm_config.model_config.get_vocab_size()
    if spec.get("logits_prompts"):
        prompts = [torch.randint(0, 150000, (n,), generator=gen).tolist() for n in spec["logits_prompts"]]
        sp = SamplingParams(max_tokens=16, temperature=0.0, detokenize=False, logprobs=-1, ignore_eos=True)
        res = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        dense = []
        for r in res:
            steps = r.outputs[0].logprobs
            lp = torch.full((len(steps), vocab), float("-inf"))
            for i, s in enumerate(steps):
                lp[i, torch.tensor(list(s.keys()))] = torch.tensor([x.logprob for x in s.values()])
            dense.append(lp)
        torch.save({"prompts": prompts, "tokens": [list(r.outputs[0].token_ids) for r in res], "logprobs": dense},
                   spec["logits_out"])
    cc = llm.llm_engine.vllm_config.cache_config
    if cc.num_gpu_blocks:
        out["kv_capacity_blocks"], out["block_size"] = cc.num_gpu_blocks, cc.block_size
    cap = (cc.num_gpu_blocks or 0) * cc.block_size
    out["cells"], warmed = [], False
    for ctx in spec["contexts"]:
        for new in spec["gens"]:
            if time.time() - t0 > spec["budget_s"]:
                out["cells"].append({"context": ctx, "gen": new, "skipped": "mode budget"})
                continue
            n = max(1, min(spec["max_num_seqs"], cap // (ctx + new + cc.block_size)))  # as many as fit at once
            prompts = [{"prompt_token_ids": torch.randint(0, 150000, (ctx,), generator=gen).tolist()}
                       for _ in range(n)]
            if not warmed:  # steps that mix one prompt with decode rows, then decode-only batches: first-use work
                llm.generate(prompts[:10], SamplingParams(max_tokens=12, detokenize=False, ignore_eos=True),
                             use_tqdm=False)  # (graph captures of new shapes, kernel builds) stays out of the timing
                out["kernel_builds"]["first_requests"] = builds.take()  # should be none: all built at start
                warmed = True
            sp = SamplingParams(max_tokens=new, temperature=0.0, detokenize=False, ignore_eos=True)
            out["cells"].append({"num_seqs": n, "context": ctx, "gen": new,
                                 **timed_generate(llm.llm_engine, prompts, sp)})
            print("CELL " + json.dumps({k: v for k, v in out["cells"][-1].items()
                                        if not k.startswith("prefill_phase_step")}), flush=True)
    out["kernel_builds"]["timed_cells"] = builds.take()
    if spec.get("profile_prefill"):
        out["prefill_profile"] = profile_prefill(llm, spec["contexts"][0], gen)
    print("RESULT " + json.dumps(out), flush=True)


def profile_prefill(llm, ctx: int, gen) -> list[dict]:
    """The GPU kernels of one ``ctx``-token prompt's prefill (one chunk, one output token), by total CUDA time:
    where a prefill's time goes, for the record."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    from vllm import SamplingParams

    prompt = {"prompt_token_ids": torch.randint(0, 150000, (ctx,), generator=gen).tolist()}
    sp = SamplingParams(max_tokens=1, detokenize=False, ignore_eos=True)
    llm.generate([prompt], sp, use_tqdm=False)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        llm.generate([prompt], sp, use_tqdm=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    rows = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
    return [{"wall_s": round(wall, 4)}] + [
        {"name": e.key[:120], "calls": e.count, "cuda_ms": round(e.device_time_total / 1e3, 3),
         "cpu_ms": round(e.cpu_time_total / 1e3, 3)} for e in rows[:30]]


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
        res["prefill_s_per_prompt"] = res["prefill_phase_s"] / len(prompts)
        res["prefill_phase_step_s"] = [round(x, 4) for x in step_s]
        res["prefill_phase_steps"] = step_info
    if window_start is not None and window_end is not None and window_end[0] > window_start[0]:
        steps_tok = window_end[1] - window_start[1]
        dt = window_end[0] - window_start[0]
        res.update(decode_window_s=dt, decode_window_tokens=steps_tok, decode_tok_s=steps_tok / dt,
                   decode_step_ms=1e3 * dt / max(1, steps_tok / n))
    return res


# VLLM_USE_V2_MODEL_RUNNER per choice; "default": what a user of each engine runs, i.e. vLLM's own choice (V2 for
# dense models) for vLLM's backends, and V1 for OSCAR (the plugin refuses V2)
RUNNERS = {"default": None, "v1": "0", "v2": "1"}


def child_env(mode: str, runner: str, base: dict) -> dict:
    """The environment of one engine's process: ``base`` with the model-runner choice of ``mode`` under
    ``runner`` (a key of :data:`RUNNERS`), the engine core in-process."""
    env = {k: v for k, v in base.items() if k != "VLLM_USE_V2_MODEL_RUNNER"}
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    value = RUNNERS["v1"] if runner == "default" and MODES[mode].get("oscar") else RUNNERS[runner]
    if value is not None:
        env["VLLM_USE_V2_MODEL_RUNNER"] = value
    return env


def run_child(spec: dict, timeout: float, runner: str = "default") -> tuple[dict | None, str]:
    env = child_env(spec["mode"], runner, dict(os.environ))
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


def ratios(runs: dict, base: str = "bf16") -> dict:
    """Each mode against ``base`` (vLLM's defaults): KV capacity, and per cell decode and whole-run output
    throughput and prefill time per prompt."""
    ref = runs.get(base) or {}
    ref_cells = {(c["context"], c["gen"]): c for c in ref.get("cells", []) if "wall_s" in c}
    out = {}
    for name, r in runs.items():
        if name == base or not r or "cells" not in r:
            continue
        row = {}
        if r.get("kv_capacity_tokens") and ref.get("kv_capacity_tokens"):
            row["kv_capacity"] = r["kv_capacity_tokens"] / ref["kv_capacity_tokens"]
        for c in r["cells"]:
            rc = ref_cells.get((c["context"], c["gen"]))
            if rc is None or "wall_s" not in c:
                continue
            cell = {"output_tok_s": c["output_tok_s"] / rc["output_tok_s"]}
            if c.get("decode_tok_s") and rc.get("decode_tok_s"):
                cell["decode_tok_s"] = c["decode_tok_s"] / rc["decode_tok_s"]
            if c.get("prefill_s_per_prompt") and rc.get("prefill_s_per_prompt"):
                cell["prefill_s_per_prompt"] = c["prefill_s_per_prompt"] / rc["prefill_s_per_prompt"]
            row[f"{c['context']}x{c['gen']}"] = cell
        out[name] = row
    return out


def plot(report: dict, path: Path) -> Path:
    """One PNG: per mode, KV capacity and, per (context, output length) cell, decode and whole-run output
    throughput and prefill seconds per prompt, as bars (modes without a figure are left out of that panel)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {m: r for m, r in report["runs"].items() if r and r.get("cells")}
    cells = sorted({(c["context"], c["gen"]) for r in runs.values() for c in r["cells"] if "wall_s" in c})
    panels = [("KV capacity (tokens)", lambda r, c: r.get("kv_capacity_tokens"), [None])]
    panels += [(f"{what}, {ctx // 1000}K x {gen}", key, [(ctx, gen)]) for ctx, gen in cells
               for what, key in (("decode tok/s", "decode_tok_s"), ("whole-run output tok/s", "output_tok_s"),
                                 ("prefill s / prompt", "prefill_s_per_prompt"))]
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 3.6), squeeze=False)
    for ax, (title, key, (cell,)) in zip(axes[0], panels):
        names, vals = [], []
        for m, r in runs.items():
            if cell is None:
                v = key(r, None)
            else:
                c = next((c for c in r["cells"] if (c["context"], c["gen"]) == cell), {})
                v = c.get(key)
            if v:
                names.append(m)
                vals.append(v)
        ax.bar(range(len(vals)), vals,
               color=["tab:blue" if n.startswith("oscar") else "tab:gray" for n in names])
        ax.set_xticks(range(len(vals)), names, rotation=60, ha="right", fontsize=7)
        ax.set_title(title, fontsize=8)
    gpu = report["provenance"].get("gpu", "")
    fig.suptitle(f"vLLM {report['provenance'].get('vllm', '')}, {report['model']['shape']}, {gpu}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child")
    ap.add_argument("--out", default="vllm.json")
    ap.add_argument("--work", default="/tmp/oscar-vllm-bench")
    ap.add_argument("--modes", default="oscar,bf16,fp8,int4_per_token_head,turboquant_k3v4_nc",
                    help=f"comma-separated, from {', '.join(MODES)}; vLLM's defaults (bf16) are the base of the "
                         "ratios")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="0.6b")
    ap.add_argument("--util", type=float, default=0.15)
    ap.add_argument("--contexts", default="32000", help="comma-separated prompt lengths")
    ap.add_argument("--gens", default="128,1024", help="comma-separated output lengths (tokens per sequence)")
    ap.add_argument("--max-batched-tokens", type=int, default=0,
                    help="vLLM max_num_batched_tokens for every engine (default: the model length, one chunk per "
                         "prompt)")
    ap.add_argument("--mode-budget", type=float, default=240.0,
                    help="seconds one engine may take for its cells (later cells are skipped; the process is "
                         "killed at twice this)")
    ap.add_argument("--profile-prefill", action="store_true", help="profile one prefill of each engine")
    ap.add_argument("--deadline", type=float, default=560.0, help="seconds for the whole run")
    ap.add_argument("--git-sha", default=None, help="commit of the code run (default: this checkout's HEAD)")
    ap.add_argument("--max-kl", type=float, default=1e-2,
                    help="largest mean KL (nats/token) of vLLM + OSCAR to the transformers reference; above it, or "
                         "without the check, no OSCAR speed is reported and the script exits 1")
    ap.add_argument("--model-runner", choices=sorted(RUNNERS), default="default",
                    help="vLLM's model runner for every engine (default: vLLM's own choice, V2 for dense models, "
                         "for vLLM's backends; V1 for OSCAR, which refuses V2)")
    ap.add_argument("--plot", help="draw a result JSON as a PNG next to it (no GPU needed), and exit")
    a = ap.parse_args()
    if a.child:
        return child(json.loads(a.child))
    if a.plot:
        print(plot(json.loads(Path(a.plot).read_text()), Path(a.plot).with_suffix(".png")))
        return None
    modes = a.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise SystemExit(f"unknown mode(s) {unknown}: choose from {', '.join(MODES)}")
    contexts, gens = [int(x) for x in a.contexts.split(",")], [int(x) for x in a.gens.split(",")]
    t_start = time.time()
    left = lambda: a.deadline - (time.time() - t_start)  # noqa: E731
    root = Path(a.work)
    root.mkdir(parents=True, exist_ok=True)
    max_len = max(contexts) + max(gens) + 64
    shape_name, shape = SHAPES[a.shape]
    model_dir, calib_dir = make_model(root, shape, max_len)
    report = {"provenance": provenance(a.git_sha), "model": {"shape": f"{shape_name}, random weights", **shape},
              "settings": {"gpu_memory_utilization": a.util, "contexts": contexts, "gens": gens,
                           "max_num_batched_tokens": a.max_batched_tokens or max_len, "prefix_caching": False,
                           "model_runner": a.model_runner},
              "runs": {}, "logs": {}}
    common = {"model": str(model_dir), "util": a.util, "max_model_len": max_len, "contexts": contexts, "gens": gens,
              "max_batched_tokens": a.max_batched_tokens or max_len, "budget_s": a.mode_budget,
              "calibration": str(calib_dir), "profile_prefill": a.profile_prefill}
    for name in modes:
        if left() < 60:
            report["runs"][name] = {"skipped": "deadline"}
            continue
        spec = {**common, "mode": name, "max_num_seqs": 48 if MODES[name].get("oscar") else 64}
        if MODES[name].get("oscar"):  # every OSCAR engine's logits are checked
            spec.update(logits_prompts=[1200, 700], logits_out=str(root / f"{name}_logits.pt"))
        res, log = run_child(spec, min(left() - 30, 2 * a.mode_budget), a.model_runner)
        report["runs"][name] = res or {"failed": log[-3000:]}
        report["logs"][name] = log[-6000:]
        print(name, json.dumps({k: v for k, v in (res or {}).items() if k != "cells"}), flush=True)
    report["vs_bf16"] = ratios(report["runs"])
    refused = {}
    for name in [m for m in modes if MODES[m].get("oscar")]:
        try:
            check = logits_check(model_dir, calib_dir, root / f"{name}_logits.pt")
        except Exception as e:  # noqa: BLE001 - recorded, and it withholds the speeds below
            check = {"error": repr(e)[:2000]}
        report.setdefault("logits_check", {})[name] = check
        kls = check.get("kl_ref_vs_vllm_mean")
        if not (kls and max(kls) <= a.max_kl):  # no speed for an engine whose outputs do not match the reference
            refused[name] = f"logits check failed or missing: {check}"
            report["vs_bf16"].pop(name, None)
            for c in (report["runs"].get(name) or {}).get("cells", []):
                for key in [k for k in c if k not in ("num_seqs", "context", "gen")]:
                    del c[key]
    if refused:
        report["refused"] = refused
    report["wall_s"] = time.time() - t_start
    Path(a.out).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k not in ("logs", "runs")}, indent=1))
    if refused:
        raise SystemExit(f"no speed reported: {refused}")


if __name__ == "__main__":
    main()
