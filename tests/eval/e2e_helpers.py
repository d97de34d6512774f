"""End-to-end runs of ``oscarkv eval`` (the command line, all five tasks) on a tiny random Llama saved to disk,
shared by the CPU tests (test_cli_eval.py) and the GPU tests (test_cuda.py)."""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from eval_standins import random_text, tiny_calibration, tiny_model_folder

METHODS = ["bf16", "naive-int2", "quarot-int2", "kivi-2", "int4-hadamard", "oscar", "oscar-auto"]
TASKS = ["kld", "ppl", "niah", "greedy", "fidelity"]
CONTEXT = 192
VARIANTS = ["single-number-noise", "multikey-word-essay"]


@dataclass
class Tiny:
    """A tiny model folder, its calibration artifact (per-layer formats: oscar and oscar-auto) and a text file."""

    model_dir: Path
    calib_dir: Path
    text_file: Path


def make_tiny(root: Path) -> Tiny:
    root.mkdir(parents=True, exist_ok=True)
    text = random_text(6000)
    text_file = root / "text.txt"
    text_file.write_text(text)
    model, tok = tiny_model_folder(root / "model", text)
    ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        calib = tiny_calibration(model, ids, bit_budget=3.0)  # layer 0: 2-bit keys, 4-bit values; layer 1: 2/2
    calib.save(root / "calib")
    return Tiny(root / "model", root / "calib", text_file)


def run_eval(tiny: Tiny, out: Path, *extra: str, methods=METHODS, tasks=TASKS, device: str = "cpu") -> int:
    """``oscarkv eval`` on the tiny model: every task, 2 windows / prompts of CONTEXT tokens, 2 NIAH variants x
    2 depths."""
    from oscarkv.cli import main

    argv = ["eval", "--model", str(tiny.model_dir), "--calibration", str(tiny.calib_dir), "--data",
            str(tiny.text_file), "--methods", ",".join(methods), "--tasks", ",".join(tasks), "--context", str(CONTEXT),
            "--windows", "2", "--greedy-prompts", "2", "--greedy-tokens", "12", "--niah-depths", "0.2,0.8",
            "--niah-variants", ",".join(VARIANTS), "--prefill-chunk", "64", "--out", str(out), "--device", device,
            "--quiet", *extra]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return main(argv)


def summary(out: Path) -> dict[tuple[str, str, int], dict]:
    """``summary.json`` keyed by (task, method, context)."""
    raw = json.loads((out / "summary.json").read_text())
    res = {}
    for key, v in raw.items():
        if key.split("|")[0] in ("curve", "lines", "longgen"):
            continue
        _model, _data, task, method, ctx = key.split("|")
        res[(task, method, int(ctx))] = v
    return res


def records(out: Path, task: str) -> dict[tuple[str, str], dict]:
    """Every JSONL record of ``task`` keyed by (method, unit key)."""
    res = {}
    for p in sorted(out.rglob(f"{task}_*.jsonl")):
        for line in p.read_text().splitlines():
            r = json.loads(line)
            res[(r["method"], r["key"])] = r
    return res


def check_properties(s: dict, methods=METHODS) -> None:
    """What must hold on any device and dtype: the reference against itself is exact, everything is finite,
    quantization costs something, and the per-layer and greedy tables are complete."""
    c = CONTEXT
    assert s[("lm", "bf16", c)]["kld"] == 0.0 and s[("lm", "bf16", c)]["top1"] == 1.0
    assert s[("lm", "bf16", c)]["ppl"] == s[("lm", "bf16", c)]["ppl_ref"]
    for m in methods:
        lm = s[("lm", m, c)]
        assert lm["units"] == 2 and all(math.isfinite(lm[k]) for k in ("kld", "ppl", "ppl_ref", "logit_rel_err"))
        fid = s[("fidelity", m, c)]
        assert len(fid["attn_rel_err"]) == 2 and all(math.isfinite(e) for e in fid["attn_rel_err"])
        assert 0.0 <= s[("greedy", m, c)]["agree"] <= 1.0
        niah = s[("niah", m, c)]
        assert niah["units"] == 4 and 0.0 <= niah["acc"] <= 1.0
        if m != "bf16":
            assert lm["kld"] > 0.0 and fid["logit_rel_err"] > 0.0
    assert s[("fidelity", "bf16", c)]["logit_rel_err"] == 0.0
    assert s[("lm", "naive-int2", c)]["kld"] > s[("lm", "int4-hadamard", c)]["kld"]
    assert s[("niah", "oscar", c)]["bits_physical"] < s[("niah", "bf16", c)]["bits_physical"] == 16.0
