"""Shared state of one evaluation run: model, tokenizer, backend, held-out text, result store, reference cache."""

from __future__ import annotations

import contextlib
import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import Tensor

from .backend import Backend, final_hidden
from .store import ResultStore, calibration_tag, fingerprint, safe_name
from .texts import EvalText, bos_id, tokenize, windows


FP32 = "fp32"
# the unmodified model with transformers' own cache, in the model's dtype (on a bfloat16 model: BF16 as users
# run it, with the model's attention kernels; on a float32 model the same as fp32)
NATIVE = "native"
PSEUDO = (FP32, NATIVE)


@dataclass
class EvalContext:
    """Everything the task runners share. ``score_from``: first scored position of teacher-forced metrics
    (``sink + window`` of the calibration's spec unless given). ``reference``: the method every other one is
    compared with ("bf16": K/V held in the 16-bit cache; "fp32": the unmodified model, a pseudo-method that
    bypasses the backend). ``ref_dir``: where reference final hidden states are cached across runs (None:
    recompute every time)."""

    model: Any
    tokenizer: Any
    model_name: str
    backend: Backend
    store: ResultStore
    text: EvalText
    calibration: Any = None
    score_from: int = 320
    reference: str = "bf16"
    ref_dir: Path | None = None
    progress: bool = True
    log: Any = print
    _tokens: Tensor | None = field(default=None, repr=False)
    _tokens_all: bool = field(default=False, repr=False)
    _lines: Any = field(default=None, repr=False)
    _calib_tag: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if FP32 == self.reference and self.numerics.get("dtype", "float32") != "float32":
            raise ValueError(f"--reference fp32 is the unmodified model in float32, but the model is "
                             f"{self.numerics['dtype']}: load it with --dtype float32")

    # ------------------------------------------------------------------------------------------ numerics
    @property
    def numerics(self) -> dict:
        """Device type and dtype of the model's parameters (``{}`` for a model without parameters)."""
        p = next(iter(self.model.parameters()), None) if hasattr(self.model, "parameters") else None
        if p is None:
            return {}
        return {"device": p.device.type, "dtype": str(p.dtype).removeprefix("torch.")}

    def numerics_tag(self) -> dict:
        """What :meth:`run_id` adds for the model's numerics: nothing for the CPU float32 protocol (so its
        fingerprints, and the results on file, stay as they were), else ``{"numerics": {device, dtype}}``: a
        CUDA or 16-bit run never resumes from, or mixes with, CPU float32 units (and vice versa)."""
        n = self.numerics
        return {} if n in ({}, {"device": "cpu", "dtype": "float32"}) else {"numerics": n}

    # ------------------------------------------------------------------------------------------ text
    def tokens(self, needed: int | None = None) -> Tensor:
        """Token ids of the text, at least the first ``needed`` of them (all for ``None``). A long text (the
        standard library's sources are ~2M tokens) is tokenized only as far as needed: a prefix of the text,
        cut at a line break and grown until it yields ``needed`` tokens plus a margin; the tokens before the
        cut are the whole text's (tokenizers split at whitespace first)."""
        text = self.text.text
        if self._tokens is not None and (needed is None or self._tokens.numel() >= needed or self._tokens_all):
            return self._tokens
        chars = len(text) if needed is None else min(len(text), 8 * needed + 4096)
        while True:
            cut = len(text) if chars >= len(text) else text.rfind("\n", 0, chars) + 1 or chars
            ids = tokenize(self.tokenizer, text[:cut])
            if cut >= len(text):
                self._tokens, self._tokens_all = ids, True
                return ids
            if needed is not None and ids.numel() >= needed + 64:
                self._tokens, self._tokens_all = ids[: ids.numel() - 64], False  # drop tokens near the cut
                return self._tokens
            chars *= 2

    def windows(self, length: int, count: int) -> list[Tensor]:
        return windows(self.tokens(length * count), length, count, bos_id(self.tokenizer))

    def line_table(self) -> Any:
        """The next-line table of the tokenizer (:class:`oscarkv.eval.lines.LineTable`), built once."""
        if self._lines is None:
            from .lines import LineTable

            vocab = self.model.get_output_embeddings().weight.shape[0]
            self._lines = LineTable(self.tokenizer, vocab)
        return self._lines

    @property
    def calib_tag(self) -> str:
        if self._calib_tag is None:
            self._calib_tag = calibration_tag(self.calibration)
        return self._calib_tag

    def method_calibration(self, method: str) -> str:
        """Tag of the calibration ``method`` runs with ("-" for the unquantized reference)."""
        if method in ("bf16", *PSEUDO):
            return "-"
        tag = getattr(self.backend, "calibration_tag", None)
        return tag(method) if callable(tag) else self.calib_tag

    # ------------------------------------------------------------------------------------ bookkeeping
    def run_id(self, task: str, method: str, length: int | str, **protocol: Any) -> str:
        """Fingerprint of everything that determines a unit's result (not the code version)."""
        return fingerprint({
            "task": task, "method": method, "reference": self.reference, "context": length, "model": self.model_name,
            "text": self.text.sha256, "calibration": self.method_calibration(method), **protocol,
            **self.numerics_tag(),
        })

    def base_record(self, task: str, method: str, length: int | str, run: str, key: str) -> dict:
        return {
            "key": key, "run": run, "task": task, "method": method, "context": length, "model": self.model_name,
            "data": self.text.name, "calibration": self.method_calibration(method),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
            **self.numerics,
        }

    def cache_protocol(self, force: bool = False) -> dict:
        """Protocol keys of the tasks that decode through a cache: the backend's kernel choice, where it is not
        the default (``"auto"``) or the model runs on CUDA (the only device where the choice changes numerics),
        or always with ``force`` (tasks new enough to have no results on file without it)."""
        kernels = getattr(self.backend, "kernels", "auto")
        return {"kernels": kernels} if force or kernels != "auto" or self.numerics.get("device") == "cuda" else {}

    def physical_bits(self, method: str, tokens: list[int]) -> list[float] | None:
        """Bits per stored K/V element of ``method``'s cache holding each of ``tokens`` tokens (16-bit tiers
        counted; :func:`oscarkv.eval.paths.physical_bits`), or None where the backend cannot tell."""
        if method in PSEUDO:
            return [8.0 * self._element_size()] * len(tokens)
        fn = getattr(self.backend, "physical_bits", None)
        return fn(self.model, method, tokens) if callable(fn) else None

    # ------------------------------------------------------------------------------------ methods
    def simulate(self, method: str, **kwargs: Any) -> Any:
        """Context for one teacher-forced pass under ``method`` (``fp32``, ``native``: the unmodified model)."""
        if method in PSEUDO:
            return contextlib.nullcontext()
        return self.backend.simulate(self.model, method, **kwargs)

    @contextlib.contextmanager
    def cache(self, method: str) -> Iterator[Callable[[], Any]]:
        """Context yielding a factory of fresh caches for ``method`` (``fp32``, ``native``: transformers'
        DynamicCache in the model's dtype)."""
        if method in PSEUDO:
            from transformers import DynamicCache

            yield lambda: DynamicCache(config=self.model.config)
            return
        with self.backend.cache(self.model, method) as factory:
            yield factory

    def describe(self, method: str) -> dict:
        if method == FP32:
            if self.numerics.get("dtype", "float32") != "float32":
                raise ValueError(f"the 'fp32' pseudo-method is the unmodified model in float32, but the model is "
                                 f"{self.numerics['dtype']}: load it with --dtype float32")
            return {"method": FP32, "bits": 32.0, "description": "unmodified model, K/V in float32"}
        if method == NATIVE:
            return {"method": NATIVE, "bits": 8.0 * self._element_size(),
                    "description": f"unmodified model and its own cache in {self.numerics.get('dtype', '-')}"}
        return self.backend.describe(self.model, method)

    def _element_size(self) -> int:
        p = next(iter(self.model.parameters()), None) if hasattr(self.model, "parameters") else None
        return p.element_size() if p is not None else 4

    # ------------------------------------------------------------------------------------ reference
    def reference_hidden(self, ids: Tensor, label: str, prompt_len: int = 0) -> Tensor:
        """Final hidden states ``[T, D]`` of the reference method on ``ids`` (its first ``prompt_len`` tokens
        prefilled in one pass, the rest token by token), cached on disk under ``ref_dir`` (keyed by the model
        name, the reference, ``prompt_len`` and a hash of the tokens)."""
        digest = hashlib.sha256(ids.numpy().tobytes()).hexdigest()[:16]
        path = None
        if self.ref_dir is not None:
            tag = self.numerics_tag().get("numerics")
            numerics = f"_{tag['device']}-{tag['dtype']}" if tag else ""  # CPU float32: the name as before
            prompt = f"_p{prompt_len}" if prompt_len else ""
            name = f"{safe_name(label)}_{safe_name(self.reference)}{numerics}{prompt}_{digest}.pt"
            path = Path(self.ref_dir) / safe_name(self.model_name) / name
            if path.is_file():
                h = torch.load(path, map_location="cpu", weights_only=True)
                return h.to(next(self.model.parameters()).device)
        with self.simulate(self.reference, **({"prompt_len": prompt_len} if prompt_len else {})):
            h = final_hidden(self.model, ids)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            torch.save(h.cpu(), tmp)
            tmp.replace(path)
        return h


__all__ = ["EvalContext", "calibration_tag", "FP32", "NATIVE"]
