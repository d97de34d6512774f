"""Needle in a haystack, RULER style (task ``niah``).

A sample hides one or more needles ("The special magic number for <key> is: <value>.") in a haystack of
held-out essays or of RULER's noise sentences, at a relative depth, and asks for one key's value. The prompt
ends with the needle's own lead-in ("... The special magic number for <key> is:"), so a model answers by
continuing it; the sample is correct when the decoded answer contains the value. Variants:

* kind ``single`` (one needle) or ``multikey`` (the asked needle plus ``distractors`` with other keys);
* value ``number`` (7 digits) or ``word`` (a noun);
* haystack ``essay`` or ``noise``.

Generation is deterministic in ``(variant, length, depth, seed)`` and the tokenizer. The prompt goes through the
method's cache by chunked prefill (each chunk attends to earlier chunks as stored), then the answer is decoded
greedily through the cache.
"""

from __future__ import annotations

import random
import re
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import Tensor
from tqdm.auto import tqdm

from .backend import greedy_generate_batch
from .metrics import peak_memory
from .paths import path_summary, quantized_layer_count, record_kernel_paths
from .context import EvalContext
from .texts import bos_id

TASK = "niah"
KINDS = ("single", "multikey")
VALUES = ("number", "word")
HAYSTACKS = ("essay", "noise")
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
INTRO = ("Some special magic {plural} are hidden within the following text. Make sure to memorize them. "
         "I will quiz you about the {plural} afterwards.\n")
NEEDLE = "The special magic {what} for {key} is: {value}."
QUESTION = "\nQuestion: What is the special magic {what} for {key}?\nAnswer: The special magic {what} for {key} is:"
_FALLBACK_WORDS = (
    "apple anchor badger banjo candle canyon dolphin dragon engine falcon garden glacier harbor helmet island "
    "jacket kettle lantern magnet meadow needle orchard pepper pigeon quartz rabbit saddle signal tablet tiger "
    "tunnel violin walnut window yogurt zebra blanket cactus feather hammer ladder marble pillow rocket sponge"
).split()


@dataclass(frozen=True)
class Variant:
    kind: str = "single"
    value: str = "number"
    haystack: str = "essay"
    distractors: int = 3

    def __post_init__(self) -> None:
        for name, ok in (("kind", KINDS), ("value", VALUES), ("haystack", HAYSTACKS)):
            if getattr(self, name) not in ok:
                raise ValueError(f"NIAH {name} must be one of {list(ok)}, got {getattr(self, name)!r}")

    @property
    def name(self) -> str:
        return f"{self.kind}-{self.value}-{self.haystack}"

    @classmethod
    def parse(cls, text: str) -> "Variant":
        """``kind-value-haystack``, e.g. ``single-number-essay`` or ``multikey-word-noise``."""
        parts = text.strip().split("-")
        if len(parts) != 3:
            raise ValueError(f"NIAH variant {text!r} must be kind-value-haystack with kind in {list(KINDS)}, "
                             f"value in {list(VALUES)}, haystack in {list(HAYSTACKS)}")
        return cls(*parts)


@dataclass
class Sample:
    """One NIAH prompt. ``input_ids`` int64 ``[T]`` (BOS included where the model uses one)."""

    input_ids: Tensor
    answer: str
    key: str
    needles: list[tuple[str, str]]
    depth: float
    needle_token: int

    def correct(self, output: str) -> bool:
        return self.answer.lower() in output.lower()


@lru_cache(maxsize=4)
def _words() -> tuple[str, ...]:
    try:
        import importlib.util

        spec = importlib.util.find_spec("wonderwords")
        folder = Path(list(spec.submodule_search_locations)[0]) / "assets"
        words = [w.strip() for w in (folder / "nounlist.txt").read_text().split() if w.strip().isalpha()]
        return tuple(w for w in words if 3 <= len(w) <= 9) or tuple(_FALLBACK_WORDS)
    except Exception:  # noqa: BLE001 - a missing or unreadable word list: the built-in words serve
        return tuple(_FALLBACK_WORDS)


def _sentences(text: str) -> list[str]:
    return [s.strip() for s in re.split(r"(?<=[.!?])\s+", text) if s.strip()]


class NiahGenerator:
    """Builds samples for one tokenizer; ``essay_text`` is the held-out haystack text (ignored for noise)."""

    def __init__(self, tokenizer: Any, essay_text: str = ""):
        self.tok = tokenizer
        self.bos = bos_id(tokenizer)
        self._hay: dict[str, tuple[list[str], list[int]]] = {}
        self.essay_text = essay_text

    def _count(self, text: str) -> int:
        return len(self.tok(text, add_special_tokens=False)["input_ids"])

    def _haystack(self, kind: str) -> tuple[list[str], list[int]]:
        if kind not in self._hay:
            sents = _sentences(self.essay_text) if kind == "essay" else _sentences(NOISE)
            if not sents:
                raise ValueError("the essay haystack is empty: pass the held-out essays as essay_text")
            enc = self.tok([" " + s for s in sents], add_special_tokens=False)["input_ids"]
            self._hay[kind] = (sents, [len(e) for e in enc])
        return self._hay[kind]

    def sample(self, variant: Variant, length: int, depth: float, seed: int) -> Sample:
        """A prompt of at most ``length`` tokens with the asked needle at relative ``depth`` in [0, 1]."""
        if not 0.0 <= depth <= 1.0:
            raise ValueError(f"needle depth must be in [0, 1], got {depth}")
        rng = random.Random(f"{variant.name}|{length}|{depth:.4f}|{seed}")
        words = _words()
        n_needles = 1 + (variant.distractors if variant.kind == "multikey" else 0)
        keys = rng.sample(words, n_needles)
        keys = [f"{k}-{rng.choice(words)}" for k in keys]
        if variant.value == "number":
            values = [str(rng.randint(1_000_000, 9_999_999)) for _ in keys]
        else:
            values = rng.sample(words, n_needles)
        what = "number" if variant.value == "number" else "word"
        needles = [NEEDLE.format(what=what, key=k, value=v) for k, v in zip(keys, values)]
        intro = INTRO.format(plural=what + "s")
        question = QUESTION.format(what=what, key=keys[0])
        fixed = self._count(intro) + self._count(question) + sum(self._count(" " + n) for n in needles)
        budget = int((length - fixed - (self.bos is not None)) * 0.97) - 8
        if budget < 16:
            raise ValueError(f"context length {length} is too short for a NIAH prompt (needs about {fixed + 24})")
        hay = self._take(variant.haystack, budget, rng)
        cum = [0]
        for _, n in hay:
            cum.append(cum[-1] + n)
        spots = [min(range(len(cum)), key=lambda j: abs(cum[j] - depth * cum[-1]))]
        for _ in needles[1:]:
            spots.append(rng.randrange(len(cum)))
        parts: list[str] = []
        for j in range(len(hay) + 1):
            parts += [needles[i] for i, s in enumerate(spots) if s == j]
            if j < len(hay):
                parts.append(hay[j][0])
        text = intro + " ".join(parts) + question
        ids = self.tok(text, add_special_tokens=False)["input_ids"]
        if self.bos is not None:
            ids = [self.bos] + ids
        if len(ids) > length:
            raise ValueError(f"NIAH prompt came out at {len(ids)} > {length} tokens; report this as a bug")
        before = intro + " ".join(parts[: parts.index(needles[0])])
        needle_tok = len(self.tok(before, add_special_tokens=False)["input_ids"])
        return Sample(torch.tensor(ids, dtype=torch.long), values[0], keys[0], list(zip(keys, values)), depth,
                      needle_tok + (self.bos is not None))

    def _take(self, kind: str, budget: int, rng: random.Random) -> list[tuple[str, int]]:
        sents, counts = self._haystack(kind)
        i = rng.randrange(len(sents)) if kind == "essay" else 0
        out, used = [], 0
        while used + max(counts[i], 1) <= budget:
            out.append((sents[i], counts[i]))
            used += max(counts[i], 1)
            i = (i + 1) % len(sents)
        return out


def run_niah(
    s: EvalContext, methods: list[str], lengths: Sequence[int], depths: Sequence[float], variants: Sequence[Variant],
    samples: int, *, chunk: int = 256, haystack: tuple[str, str] | None = None, batch: int = 1,
    deadline: float | None = None,
) -> list[dict]:
    """Evaluate every method on every (variant, length, depth, seed) sample; resumable per sample. ``batch``
    samples of one length go through one cache together (left-padded, :func:`greedy_generate_batch`);
    ``deadline`` (``time.monotonic()``): start no new batch after it (a batch started is finished).
    ``haystack``: ``(name, text)`` of the prose for ``essay`` haystacks (default: the evaluation text)."""
    hay_name, hay_text = haystack or (s.text.name, s.text.text)
    gen = NiahGenerator(s.tokenizer, hay_text)
    hay = {} if hay_name == "essays" else {"haystack": hay_name}  # the essays: fingerprints as before
    pad = getattr(s.tokenizer, "pad_token_id", None) or getattr(s.tokenizer, "eos_token_id", None) or 0
    new = []
    for length in lengths:
        units = [(v, d, k) for v in variants for d in depths for k in range(samples)]
        protocol = {"chunk": chunk, "chunks_from": "end", "variants": sorted(v.name for v in variants),
                    **s.cache_protocol(), **hay}
        for m in methods:
            run = s.run_id(TASK, m, length, chunk=chunk, chunks_from="end", **s.cache_protocol(), **hay)
            path = s.store.path(s.model_name, s.text.name, m, TASK, length)
            done = s.store.done(path, run)
            todo = [u for u in units if _key(*u) not in done]
            if not todo:
                continue
            with s.cache(m) as new_cache:
                for j in tqdm(range(0, len(todo), batch), desc=f"{s.model_name} niah@{length} {m}",
                              disable=not s.progress):
                    if deadline is not None and time.monotonic() > deadline:
                        return new
                    group = todo[j: j + batch]
                    smps = [gen.sample(v, length, d, k) for v, d, k in group]
                    n_ans = max(len(s.tokenizer(" " + x.answer, add_special_tokens=False)["input_ids"]) for x in smps)
                    cache = new_cache()
                    t0 = time.perf_counter()
                    with peak_memory(s.model) as mem, record_kernel_paths() as counts:
                        outs = greedy_generate_batch(s.model, [x.input_ids for x in smps], cache, n_ans + 4,
                                                     chunk=chunk, pad_id=int(pad))
                    sec = time.perf_counter() - t0
                    steps = -(-max(x.input_ids.numel() for x in smps) // chunk) + n_ans + 3
                    route = path_summary(counts, steps * quantized_layer_count(cache))
                    bits = physical_bits(cache)
                    for (v, d, k), smp, out in zip(group, smps, outs):
                        text = s.tokenizer.decode(out, skip_special_tokens=True)
                        rec = s.base_record(TASK, m, length, run, _key(v, d, k))
                        rec.update(variant=v.name, depth=d, seed=k, tokens=int(smp.input_ids.numel()),
                                   needle_token=smp.needle_token, answer=smp.answer, output=text,
                                   correct=int(smp.correct(text)), protocol=protocol,
                                   seconds=round(sec / len(group), 2),
                                   batch=len(group), path=route["path"], paths=route, **mem, **bits)
                        s.store.append(path, rec)
                        new.append(rec)
    return new


def physical_bits(cache: Any) -> dict:
    """Bits per stored K/V element read from the cache's own tensors: overall (16-bit tiers included) and of the
    quantized tier alone; empty for caches that do not report their bytes."""
    nbytes = getattr(cache, "nbytes", None)
    if not callable(nbytes):
        return {}
    b = nbytes()
    per_token = b.elements / b.tokens if b.tokens else 0
    q_el = b.quantized_tokens * per_token
    return {"bits_physical": b.bits_per_element, "bits_quantized_tier": 8 * b.used_quantized / q_el if q_el else None,
            "cached_tokens": b.tokens}


def _key(v: Variant, depth: float, seed: int) -> str:
    return f"{v.name}:d{depth:.3f}:s{seed}"


__all__ = ["Variant", "Sample", "NiahGenerator", "run_niah", "TASK"]
