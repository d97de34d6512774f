"""Which layers' quantization makes multi-key NIAH prompts miss? (CPU, one thread.)

For NIAH prompts built exactly as ``oscarkv eval --tasks niah`` builds them (same generator, variant, length,
depth, seed, haystack), the prompt up to the question (``P0 = T - question tokens``) is prefilled ONCE with the
unquantized model; its per-layer K/V are then stored as the method stores them after ``P0`` tokens (16-bit sink
and recent window rounded to the 16-bit tier dtype, the band in between through the store's own quantized pages,
:func:`oscarkv.cache.paged.quantize_roundtrip`, in the layer's format, centered and rotated as the recipe says)
and the question plus the expected answer is teacher-forced over that cache. Score: sum log-prob of the answer
tokens and whether greedy decoding gives them (every teacher-forced argmax equals the answer token).

Cache variants per prompt: none quantized, all, all keys only, all values only, each layer alone, all but one
layer; then, for the layers that matter most, keys-only and values-only versions of both. Per head and layer, the
attention mass from the question's positions (and from the last prompt position) on the asked needle's tokens and
on the other needles' tokens, unquantized vs all layers quantized. This design equals
:func:`oscarkv.hf.simulate` with ``prompt_len = P0`` and one chunk for the rest (checked on a 2K prompt: logits
within 0.02).

Not what the eval does: the eval's prefill is chunked (chunks of 256 counted from the end of the left-padded
batch) and each chunk attends to the earlier chunks as stored, so the K/V of later tokens are computed from
hidden states that already saw quantized ones. ``--simulate`` measures that on chosen prompts with
:func:`oscarkv.hf.simulate` (one teacher-forced pass with the eval's chunk boundaries: the eval's numerics up to
decode-vs-teacher-forcing and the device). ``--fix-k4 L,...`` / ``--fix-v4 L,...`` add a recipe with those
layers' keys / values promoted to 4 bits (the 4-bit candidate with the least held-out error in the calibration's
selection record), ``--fix-k2 L,...`` demotes those layers' keys to their best 2-bit candidate to stay in the
budget; the fix is scored on every prompt (and simulated where ``--simulate`` is given). Partial results are
written after each prompt.

    OMP_NUM_THREADS=1 python scripts/experiments/niah_layer_diagnosis.py --threads 1 --context 8192 \
        --prompts 0.7:8,0.1:6,0.5:0 --simulate 0.7:8 --fix-v4 16 --fix-k2 5 --out results.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--calibration", default="calibrations/qwen2.5-coder-0.5b-default")
    p.add_argument("--method", default="oscar-auto")
    p.add_argument("--variant", default="multikey-word-essay")
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--prompts", required=True, help="depth:seed,depth:seed,... (the eval's NIAH sample keys)")
    p.add_argument(
        "--batch-depths",
        default="0.1,0.3,0.5,0.7,0.9",
        help="the eval's depths: the batch's longest prompt sets the chunk boundaries (left padding)",
    )
    p.add_argument("--batch-samples", type=int, default=10)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--top", type=int, default=4, help="layers given keys-only variants")
    p.add_argument("--no-layer-sweep", action="store_true", help="only none/all (and the fix), no per-layer runs")
    p.add_argument("--simulate", default="", help="depth:seed,... to run also through oscarkv.hf.simulate")
    p.add_argument("--fix-k4", default="", help="layers whose keys the fix promotes to 4 bits")
    p.add_argument("--fix-k2", default="", help="layers whose 4-bit keys the fix demotes to 2 bits (budget)")
    p.add_argument("--fix-v4", default="", help="layers whose values the fix promotes to 4 bits")
    p.add_argument(
        "--simulate-variants",
        default="all",
        help="for --simulate prompts: comma list of all, none, keys (only keys quantized), values, "
        "layers:A-B (only those layers), allbut:L, fix",
    )
    p.add_argument("--simulate-only", action="store_true", help="--simulate prompts: skip the stored-cache design")
    p.add_argument("--no-sweep", default="", help="depth:seed,... scored without the per-layer variants")
    p.add_argument("--out", required=True)
    p.add_argument("--time-budget", type=float, default=4200, help="seconds: start no new prompt after it")
    return p.parse_args(argv)


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def keys(text: str) -> list[tuple[float, int]]:
    out = []
    for part in text.split(","):
        if part.strip():
            d, s = part.split(":")
            out.append((float(d), int(s)))
    return out


# ------------------------------------------------------------------------------------------ the stored cache
class Store:
    """Per-layer K/V of the unquantized prefill of ``P0`` tokens, and their stored forms under a recipe."""

    def __init__(
        self,
        recipe,
        kv: list[tuple[torch.Tensor, torch.Tensor]],
        num_kv_heads: int,
        head_dim: int,
        dtype16: torch.dtype,
    ):
        from oscarkv.cache.build import geometry_for, policy_for

        self.recipe, self.kv, self.dtype16 = recipe, kv, dtype16
        self.geom = geometry_for(recipe, num_kv_heads, head_dim)
        self.policy = policy_for(recipe)
        n = kv[0][0].shape[2]
        self.sink = min(self.policy.sink, n)
        self.q = self.policy.quantized(n)
        self._cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def stored(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i``'s K and V ``[1, Hkv, n, d]`` in the model basis as the cache returns them."""
        if i in self._cache:
            return self._cache[i]
        from oscarkv.cache.paged import quantize_roundtrip

        lr = self.recipe.layers[i]
        fmt = lr.format
        pages = self.geom.page_formats(fmt)
        out = []
        for which, (x, r, mu) in enumerate(((self.kv[i][0], lr.r_k, lr.mu_k), (self.kv[i][1], lr.r_v, lr.mu_v))):
            y = x[0].to(torch.float64)  # [H, n, d]
            if mu is not None:
                y = y - mu.to(torch.float64)[:, None, :]
            if r is not None:
                y = torch.einsum("htd,hde->hte", y, r.to(torch.float64))
            y16 = y.to(torch.float32).to(self.dtype16).to(torch.float32)  # the 16-bit tiers (and the write input)
            S, q = self.sink, self.q
            if q:
                band = quantize_roundtrip(pages[which], fmt[which].clip, y16[:, S : S + q].transpose(0, 1))
                y16 = torch.cat([y16[:, :S], band.transpose(0, 1), y16[:, S + q :]], 1)
            z = y16.to(torch.float64)
            if r is not None:
                z = torch.einsum("hte,hde->htd", z, r.to(torch.float64))
            if mu is not None:
                z = z + mu.to(torch.float64)[:, None, :]
            out.append(z.to(x.dtype)[None])
        self._cache[i] = (out[0], out[1])
        return self._cache[i]


def build_cache(store: Store, k_layers: set[int], v_layers: set[int]):
    from transformers import DynamicCache

    cache = DynamicCache()
    for i, (k, v) in enumerate(store.kv):
        if i in k_layers or i in v_layers:
            kq, vq = store.stored(i)
            k = kq if i in k_layers else k
            v = vq if i in v_layers else v
        cache.update(k, v, i)
    return cache


# ------------------------------------------------------------------------------------------------- scoring
def needle_spans(tok, ids: list[int], needles: list[str]) -> list[list[int]] | None:
    """Token indices of each needle sentence in ``ids`` (None where the text does not round-trip)."""
    text = tok.decode(ids)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    if enc["input_ids"] != ids:
        return None
    spans = []
    for n in needles:
        a = text.find(n)
        if a < 0:
            return None
        b = a + len(n)
        spans.append([t for t, (s, e) in enumerate(enc["offset_mapping"]) if s < b and e > a])
    return spans


@torch.inference_mode()
def score(
    model, cache, suffix: torch.Tensor, P0: int, n_q: int, answer: list[int], tok, attentions: bool = False, spans=None
) -> dict:
    """Teacher-force ``suffix`` (question + answer[:-1]) after the stored prefix ``cache``."""
    pos = torch.arange(P0, P0 + suffix.numel())[None]
    out = model(
        input_ids=suffix[None], past_key_values=cache, position_ids=pos, use_cache=True, output_attentions=attentions
    )
    logits = out.logits[0, n_q - 1 : n_q - 1 + len(answer)].float()
    lp = torch.log_softmax(logits, -1)
    tgt = torch.tensor(answer)
    tok_lp = lp[torch.arange(len(answer)), tgt]
    top = lp.argmax(-1)
    first = lp[0].clone()
    first[answer[0]] = -float("inf")
    rec = {
        "logprob": round(float(tok_lp.sum()), 4),
        "greedy_correct": bool((top == tgt).all()),
        "first_margin": round(float(lp[0, answer[0]] - first.max()), 4),
        "first_argmax": tok.decode([int(top[0])]),
    }
    if attentions:
        rec["attn"] = attention_mass(out.attentions, spans, P0, n_q)
    return rec


def attention_mass(atts, spans, P0: int, n_q: int) -> dict:
    """Per layer and query head: attention mass on the asked needle (``spans[0]``) and on the other needles, mean
    over the question's query positions and at the last prompt position (the one that predicts the answer)."""
    asked = torch.tensor(spans[0])
    other = torch.tensor([t for s in spans[1:] for t in s]) if len(spans) > 1 else torch.tensor([], dtype=torch.long)
    res = {"question": {"asked": [], "other": []}, "last": {"asked": [], "other": []}}
    for a in atts:  # [1, Hq, Lsuf, P0 + Lsuf]
        a = a[0].float()
        q = a[:, :n_q]
        for name, rows in (("question", q.mean(1)), ("last", q[:, n_q - 1])):
            res[name]["asked"].append([round(float(x), 5) for x in rows[:, asked].sum(-1)])
            res[name]["other"].append(
                [round(float(x), 5) for x in rows[:, other].sum(-1)] if other.numel() else [0.0] * rows.shape[0]
            )
    return res


# ----------------------------------------------------------------------------------------------- the eval
def eval_chunk_start(T: int, T_max: int, chunk: int) -> int:
    """End of a prompt's first prefill chunk in its own coordinates: chunks of ``chunk`` counted from the end of
    the left-padded batch (``oscarkv.eval.backend.chunk_bounds``), padding not stored."""
    first = T_max % chunk or min(T_max, chunk)
    off = T_max - T
    b = first - off
    while b <= 0:
        b += chunk
    return b


class _Subset:
    """Inside the block, :func:`oscarkv.hf.simulate` quantizes only the (layer, "k"/"v") pairs in ``keep``; the
    others keep their 16-bit form (the quantized band's round trip is skipped). Batch 1 only: the simulation
    round-trips K, then V, once per layer and forward."""

    def __init__(self, keep: set[tuple[int, str]] | None):
        self.keep = keep

    def __enter__(self):
        from oscarkv.hf import attention, simulation

        self.att, self.sim = attention, simulation
        self.orig_attn, self.orig_rt = attention.simulate_attention, simulation.quantize_roundtrip
        state = {"layer": None, "calls": 0}
        keep = self.keep

        def attn(plan, *a, **kw):
            state["layer"], state["calls"] = plan.layer, 0
            return self.orig_attn(plan, *a, **kw)

        def rt(fmt, clip, rows):
            which = "kv"[state["calls"] % 2]
            state["calls"] += 1
            if keep is not None and (state["layer"], which) not in keep:
                return rows.to(torch.float32)
            return self.orig_rt(fmt, clip, rows)

        attention.simulate_attention, simulation.quantize_roundtrip = attn, rt
        return self

    def __exit__(self, *exc):
        self.att.simulate_attention, self.sim.quantize_roundtrip = self.orig_attn, self.orig_rt


def subset(spec: str, L: int) -> set[tuple[int, str]] | None:
    """The (layer, tensor) pairs a ``--simulate-variants`` entry quantizes (None: all)."""
    if spec in ("all", "fix"):
        return None
    if spec == "none":
        return set()
    if spec == "keys":
        return {(i, "k") for i in range(L)}
    if spec == "values":
        return {(i, "v") for i in range(L)}
    kind, _, arg = spec.partition(":")
    if kind == "layers":
        a, _, b = arg.partition("-")
        layers = set(range(int(a), int(b or a) + 1))
    elif kind == "allbut":
        layers = set(range(L)) - set(ints(arg))
    else:
        raise ValueError(f"unknown simulate variant {spec!r}")
    return {(i, w) for i in layers for w in "kv"}


@torch.inference_mode()
def simulate_eval(
    model,
    calib,
    method: str,
    ids: list[int],
    answer: list[int],
    p0: int,
    chunk: int,
    n_prompt: int,
    keep: set[tuple[int, str]] | None = None,
):
    from oscarkv.hf import simulate

    full = torch.tensor(ids + answer[:-1])[None]
    with simulate(model, calib, method, prompt_len=p0, chunk=chunk), _Subset(keep):
        logits = model(input_ids=full, use_cache=False).logits[0, n_prompt - 1 : n_prompt - 1 + len(answer)].float()
    lp = torch.log_softmax(logits, -1)
    tgt = torch.tensor(answer)
    return {
        "logprob": round(float(lp[torch.arange(len(answer)), tgt].sum()), 4),
        "greedy_correct": bool((lp.argmax(-1) == tgt).all()),
    }


def parse_label(label: str) -> dict:
    """``token2/hadamard@0.88`` -> a tensor-format dict (the selection record's candidate labels)."""
    head, _, clip = label.partition("@")
    layout_bits, rotation = head.split("/")
    layout = layout_bits.rstrip("24")
    return {
        "layout": layout,
        "bits": int(layout_bits[len(layout) :]),
        "rotation": rotation,
        "clip": float(clip) if clip else 0.0,
    }


def best_candidate(calib, layer: int, four: bool, which: str = "k") -> dict:
    """The key (``which="k"``) or value format with the least held-out error among the 4-bit (``four``) or 2-bit
    candidates the calibration's selection scored for ``layer`` (its record, ``provenance.format_selection``)."""
    sel = calib.provenance["format_selection"]
    t = [j for j, l in enumerate(sel["candidate_layers"]) if l == layer]["kv".index(which)]  # K, then V
    cands = [c for c in sel["candidates"][t] if (c["bits"] > 3) == four]
    best = min(cands, key=lambda c: c["error"])
    return {**parse_label(best["format"]), "error": best["error"]}


def fixed_calibration(calib, k4: list[int], k2: list[int], v4: list[int] = ()):
    """The calibration with layers ``k4``'s keys (``v4``'s values) promoted to their best 4-bit candidate and
    ``k2``'s keys demoted to their best 2-bit candidate (the selection's own held-out errors pick them)."""
    lf = json.loads(json.dumps(calib.layer_formats))
    changes = {}
    todo = [(i, True, "k") for i in k4] + [(i, False, "k") for i in k2] + [(i, True, "v") for i in v4]
    for i, four, which in todo:
        c = best_candidate(calib, i, four, which)
        to = {k: c[k] for k in ("layout", "bits", "rotation", "clip")}
        changes[f"{which}{i}"] = {
            "from": lf[i][which],
            "to": to,
            "calibration_error_from": lf[i].get(f"{which}_error"),
            "calibration_error_to": c["error"],
        }
        lf[i][which] = changes[f"{which}{i}"]["to"]
    return dataclasses.replace(calib, layer_formats=lf), changes


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from oscarkv import methods, models
    from oscarkv.artifact import Calibration
    from oscarkv.eval.niah import QUESTION, NEEDLE, NiahGenerator, Variant
    from oscarkv.eval.texts import load_eval_text
    from oscarkv.hf.prepare import default_window_dtype

    t_start = time.monotonic()
    model, tok = models.load(args.model, torch.float32)
    model.eval()
    calib = Calibration.load(args.calibration, model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        recipe = methods.resolve(args.method, calib)
    H, d, L = calib.model.num_kv_heads, calib.model.head_dim, calib.model.num_layers
    dtype16 = default_window_dtype(model)
    gen = NiahGenerator(tok, load_eval_text("essays").text)
    variant = Variant.parse(args.variant)
    T_max = max(
        gen.sample(variant, args.context, dd, k).input_ids.numel()
        for dd in map(float, args.batch_depths.split(","))
        for k in range(args.batch_samples)
    )
    fix = None
    if args.fix_k4 or args.fix_v4:
        fcal, changes = fixed_calibration(calib, ints(args.fix_k4), ints(args.fix_k2), ints(args.fix_v4))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            frecipe = methods.resolve(args.method, fcal)
        fix = {
            "k4": ints(args.fix_k4),
            "k2": ints(args.fix_k2),
            "v4": ints(args.fix_v4),
            "bits_per_element": frecipe.bits_per_element(d),
            "changes": changes,
        }
    sim_keys = set(keys(args.simulate))
    no_sweep = set(keys(args.no_sweep))
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = None
    import transformers

    record = {
        "what": "NIAH per-layer quantization diagnosis (unquantized prefill, stored cache, teacher-forced answer)",
        "command": "OMP_NUM_THREADS=1 python scripts/experiments/" + " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
        "commit": commit,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "settings": {
            "model": args.model,
            "calibration": args.calibration,
            "method": args.method,
            "variant": args.variant,
            "context": args.context,
            "dtype": "float32",
            "tier_dtype": str(dtype16).replace("torch.", ""),
            "threads": args.threads,
            "sink": recipe.sink,
            "window": recipe.window,
            "page_size": recipe.page_size,
            "chunk": args.chunk,
            "batch_longest_prompt": T_max,
            "bits_per_element": recipe.bits_per_element(d),
            "layer_formats": [f.label for f in recipe.formats],
        },
        "fix": fix,
        "prompts": [],
    }
    outp = Path(args.out)

    def flush():
        record["wall_s"] = round(time.monotonic() - t_start, 1)
        outp.write_text(json.dumps(record, indent=1))

    print(f"loaded in {time.monotonic() - t_start:.0f}s; longest batch prompt {T_max}", flush=True)
    for depth, seed in keys(args.prompts):
        if time.monotonic() - t_start > args.time_budget:
            print("time budget reached", flush=True)
            break
        t0 = time.monotonic()
        smp = gen.sample(variant, args.context, depth, seed)
        ids = smp.input_ids.tolist()
        T = len(ids)
        what = "number" if variant.value == "number" else "word"
        n_q = len(tok(QUESTION.format(what=what, key=smp.key), add_special_tokens=False)["input_ids"])
        P0 = T - n_q
        answer = tok(" " + smp.answer, add_special_tokens=False)["input_ids"]
        suffix = torch.tensor(ids[P0:] + answer[:-1])
        spans = needle_spans(tok, ids, [NEEDLE.format(what=what, key=k, value=v) for k, v in smp.needles])
        prec = {
            "depth": depth,
            "seed": seed,
            "tokens": T,
            "question_tokens": n_q,
            "answer": smp.answer,
            "answer_tokens": len(answer),
            "needles": smp.needles,
            "needle_token": smp.needle_token,
        }
        design = not (args.simulate_only and (depth, seed) in sim_keys)
        if design:
            model.set_attn_implementation("sdpa")
            with torch.inference_mode():
                from transformers import DynamicCache

                c = DynamicCache()
                model(input_ids=torch.tensor(ids[:P0])[None], past_key_values=c, use_cache=True)
                kv = [(c.layers[i].keys.clone(), c.layers[i].values.clone()) for i in range(L)]
                del c
            t_pre = time.monotonic() - t0
            store = Store(recipe, kv, H, d, dtype16)
            prec.update(
                {
                    "needle_spans": None if spans is None else [[s[0], s[-1]] for s in spans],
                    "stored_prefix": P0,
                    "quantized_band": [store.sink, store.sink + store.q],
                    "prefill_s": round(t_pre, 1),
                }
            )
            allq = set(range(L))

            def run(kl, vl, **kw):
                return score(model, build_cache(store, set(kl), set(vl)), suffix, P0, n_q, answer, tok, **kw)

            prec["none"] = run([], [])
            prec["all"] = run(allq, allq)
            prec["keys_only"] = run(allq, [])
            prec["values_only"] = run([], allq)
            print(f"d{depth} s{seed} T={T} prefill {t_pre:.0f}s none {prec['none']} all {prec['all']}", flush=True)
            sweep = not args.no_layer_sweep and (depth, seed) not in no_sweep
            if sweep:
                prec["single"] = [run([i], [i]) for i in range(L)]
                prec["all_but"] = [run(allq - {i}, allq - {i}) for i in range(L)]
                drop = sorted(range(L), key=lambda i: prec["single"][i]["logprob"])[: args.top]
                gain = sorted(range(L), key=lambda i: -prec["all_but"][i]["logprob"])[: args.top]
                top = sorted(set(drop) | set(gain))
                prec["keys_layers"] = top
                prec["single_keys"] = {i: run([i], []) for i in top}
                prec["all_but_keys"] = {i: run(allq - {i}, allq) for i in top}
                prec["single_values"] = {i: run([], [i]) for i in top}
                prec["all_but_values"] = {i: run(allq, allq - {i}) for i in top}
            if spans is not None:
                model.set_attn_implementation("eager")
                prec["attn_none"] = run([], [], attentions=True, spans=spans)["attn"]
                prec["attn_all"] = run(allq, allq, attentions=True, spans=spans)["attn"]
                model.set_attn_implementation("sdpa")
            if fix is not None:
                fstore = Store(frecipe, kv, H, d, dtype16)
                prec["fix_all"] = score(model, build_cache(fstore, allq, allq), suffix, P0, n_q, answer, tok)
        if (depth, seed) in sim_keys:
            p0 = eval_chunk_start(T, T_max, args.chunk)
            sim = prec.setdefault("simulate", {"first_chunk_end": p0})
            for v in args.simulate_variants.split(","):
                ts = time.monotonic()
                cal = fcal if v == "fix" else calib
                if v == "fix" and fix is None:
                    continue
                sim[v] = simulate_eval(model, cal, args.method, ids, answer, p0, args.chunk, T, subset(v, L))
                sim[v]["seconds"] = round(time.monotonic() - ts, 1)
                print(f"  simulate {v}: {sim[v]}", flush=True)
                record["prompts_partial"] = prec
                flush()
        prec["seconds"] = round(time.monotonic() - t0, 1)
        record.pop("prompts_partial", None)
        record["prompts"].append(prec)
        flush()
        if design and sweep:
            sl = {i: prec["single"][i]["logprob"] for i in prec["keys_layers"]}
            ab = {i: prec["all_but"][i]["logprob"] for i in prec["keys_layers"]}
            print(f"  single {sl} all_but {ab}", flush=True)
        print(f"  fix {prec.get('fix_all')} done in {prec['seconds']:.0f}s", flush=True)
    flush()


if __name__ == "__main__":
    main()
