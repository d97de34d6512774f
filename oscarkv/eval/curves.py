"""Error versus context: per-position-bucket KLD, PPL and next-line accuracy with bootstrap intervals over windows,
long-generation summaries, their tables and plots.

A *curve* belongs to (model, data, method, window length): the LM records of its windows, each with per-bucket
sums (:meth:`oscarkv.eval.metrics.PositionStats.buckets`). A bucket's mean is the ratio of sums over windows; its
95% interval is the percentile interval of that ratio over ``reps`` bootstrap resamples of the windows (the
windows are the independent units; positions within a window are not). Gaps to the reference (next-line accuracy
in points) are paired: each resample takes the same windows for both.
"""

from __future__ import annotations

import math
import random
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable

Key = tuple[str, str, str, int]  # model, data, method, window length
REPS = 1000


def bootstrap(units: list[tuple[float, float]], reps: int = REPS, seed: int = 0) -> tuple[float, float, float]:
    """``(estimate, low, high)`` of ``sum(num) / sum(den)`` over ``units`` = ``[(num, den), ...]`` with a 95%
    percentile interval from ``reps`` resamples of the units (``nan`` interval for a single unit)."""
    num, den = sum(u[0] for u in units), sum(u[1] for u in units)
    est = num / den if den else float("nan")
    if len(units) < 2:
        return est, float("nan"), float("nan")
    rng = random.Random(seed)
    vals = []
    for _ in range(reps):
        pick = [units[rng.randrange(len(units))] for _ in units]
        d = sum(u[1] for u in pick)
        if d:
            vals.append(sum(u[0] for u in pick) / d)
    vals.sort()
    return est, vals[int(0.025 * (len(vals) - 1))], vals[int(0.975 * (len(vals) - 1))]


def curves(records: Iterable[dict], reps: int = REPS) -> dict[Key, list[dict]]:
    """Per curve, one row per bucket: ``end`` (context length at the bucket's end), ``n`` (scored positions),
    ``windows``, ``kld`` with ``kld_lo``/``kld_hi``, ``ppl``, ``ppl_ref``, ``top1``, ``bits`` (physical bits per
    element at the bucket's end, mean over windows), and where lines were scored ``lines`` (count),
    ``acc``/``acc_ref`` (next-line exact match) and ``gap`` (points, method minus reference) with its interval."""
    groups: dict[Key, list[dict]] = defaultdict(list)
    for r in records:
        if r.get("task") == "lm" and r.get("buckets"):
            groups[(r["model"], r["data"], r["method"], int(r["context"]))].append(r)
    out = {}
    for key, rs in groups.items():
        size = rs[0]["buckets"]["size"]
        nb = max(len(r["buckets"]["n"]) for r in rs)
        rows = []
        for b in range(nb):
            per = [r for r in rs if b < len(r["buckets"]["n"]) and r["buckets"]["n"][b]]
            if not per:
                continue
            bk = [r["buckets"] for r in per]
            kld, lo, hi = bootstrap([(x["kl"][b], x["n"][b]) for x in bk], reps)
            n = sum(x["n"][b] for x in bk)
            row = {"end": min((b + 1) * size, max(int(r["tokens"]) for r in per)), "n": n, "windows": len(per),
                   "kld": kld, "kld_lo": lo, "kld_hi": hi,
                   "ppl": math.exp(sum(x["nll"][b] for x in bk) / n),
                   "ppl_ref": math.exp(sum(x["nll_ref"][b] for x in bk) / n),
                   "top1": sum(x["top1"][b] for x in bk) / n}
            bits = [r["bits_physical_at"][b] for r in per if r.get("bits_physical_at")]
            row["bits"] = sum(bits) / len(bits) if bits else None
            lines = [r["lines"] for r in per if r.get("lines") and b < len(r["lines"]["n"])]
            if lines and sum(x["n"][b] for x in lines):
                row.update(_line_row([(x["hit"][b], x["hit_ref"][b], x["n"][b]) for x in lines], reps))
            rows.append(row)
        out[key] = rows
    return out


def _line_row(units: list[tuple[int, int, int]], reps: int) -> dict:
    n = sum(u[2] for u in units)
    acc = sum(u[0] for u in units) / n
    acc_ref = sum(u[1] for u in units) / n
    gap, lo, hi = bootstrap([(100.0 * (u[0] - u[1]), u[2]) for u in units], reps)
    return {"lines": n, "acc": acc, "acc_ref": acc_ref, "gap": gap, "gap_lo": lo, "gap_hi": hi}


def overall_lines(records: Iterable[dict], reps: int = REPS) -> dict[Key, dict]:
    """Next-line exact match per curve over all its lines (every bucket): as :func:`curves`' line fields."""
    units: dict[Key, list] = defaultdict(list)
    for r in records:
        if r.get("task") == "lm" and r.get("lines"):
            ln = r["lines"]
            units[(r["model"], r["data"], r["method"], int(r["context"]))].append(
                (sum(ln["hit"]), sum(ln["hit_ref"]), sum(ln["n"])))
    return {k: _line_row(v, reps) for k, v in units.items() if sum(u[2] for u in v)}


def longgen_summary(records: Iterable[dict], reps: int = REPS) -> dict[Key, dict]:
    """Per (model, data, method, prompt length): prompts, generated tokens, median and minimum first divergence,
    the reference's own first divergence (the floor), mean KL over the trajectory with its interval, top-1, and
    the KL per generated-token bucket."""
    groups: dict[Key, list[dict]] = defaultdict(list)
    for r in records:
        if r.get("task") == "longgen":
            groups[(r["model"], r["data"], r["method"], int(r["context"]))].append(r)
    out = {}
    for key, rs in groups.items():
        divs = sorted(int(r["first_div"]) for r in rs)
        kld, lo, hi = bootstrap([(r["kld"] * r["n"], r["n"]) for r in rs], reps)
        size = rs[0]["buckets"]["size"]
        nb = max(len(r["buckets"]["n"]) for r in rs)
        by = []
        for b in range(nb):
            parts = [(r["buckets"]["kl"][b], r["buckets"]["n"][b]) for r in rs if b < len(r["buckets"]["n"])]
            n = sum(p[1] for p in parts)
            if n:
                by.append({"end": (b + 1) * size, "kld": sum(p[0] for p in parts) / n})
        out[key] = {"prompts": len(rs), "new_tokens": max(int(r["new_tokens"]) for r in rs),
                    "first_div_median": divs[len(divs) // 2], "first_div_min": divs[0],
                    "ref_first_div_min": min(int(r["ref_first_div"]) for r in rs),
                    "kld": kld, "kld_lo": lo, "kld_hi": hi,
                    "top1": sum(r["top1"] * r["n"] for r in rs) / sum(r["n"] for r in rs), "by_bucket": by,
                    "path": sorted({r.get("path", "-") for r in rs})}
    return out


# ---------------------------------------------------------------------------------------------------- tables
def _f(x: Any, digits: int = 4) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.{digits}f}"


def _pick_rows(rows: list[dict], marks: list[int] | None) -> list[dict]:
    """The buckets ending at powers of two of 1K and at the last position (all when few)."""
    if len(rows) <= 8:
        return rows
    ends = {r["end"] for r in rows}
    want = set(marks or []) or {e for e in ends if e & (e - 1) == 0} | {max(ends)}
    return [r for r in rows if r["end"] in want]


def curve_tables(cv: dict[Key, list[dict]], order: list[str], baseline: str = "kivi-2",
                 marks: list[int] | None = None) -> str:
    """One markdown table per (model, data, window length): methods x selected buckets, cells
    ``KLD [95% CI] (bits)``, plus each method's KLD as a fraction of ``baseline``'s."""
    out = []
    for model, data, length in sorted({(k[0], k[1], k[3]) for k in cv}):
        ms = [m for m in order if (model, data, m, length) in cv] + sorted(
            m for (mo, da, m, le) in cv if (mo, da, le) == (model, data, length) and m not in order)
        ends = [r["end"] for r in _pick_rows(cv[(model, data, ms[0], length)], marks)]
        out.append(f"### {model} on {data}, windows of {length} tokens: KLD by position\n")
        out.append("| method | " + " | ".join(f"<= {e}" for e in ends) + " |")
        out.append("|---|" + "---|" * len(ends))
        base = {r["end"]: r for r in cv.get((model, data, baseline, length), [])}
        for m in ms:
            rows = {r["end"]: r for r in cv[(model, data, m, length)]}
            cells = []
            for e in ends:
                r = rows.get(e)
                if r is None:
                    cells.append("-")
                    continue
                ratio = (f", {r['kld'] / base[e]['kld']:.2f}x {baseline}"
                         if e in base and base[e]["kld"] > 0 and r["kld"] > 0 and m != baseline else "")
                bits = f"; {r['bits']:.2f} b" if r.get("bits") is not None else ""
                cells.append(f"{_f(r['kld'])} [{_f(r['kld_lo'])}, {_f(r['kld_hi'])}]{bits}{ratio}")
            out.append(f"| {m} | " + " | ".join(cells) + " |")
        first = cv[(model, data, ms[0], length)]
        out.append(f"\n(windows per bucket: {min(r['windows'] for r in first)}-{max(r['windows'] for r in first)}; "
                   "bucket <= E holds positions E-size .. E-1; b = physical bits per stored K/V element at E tokens, "
                   "16-bit tiers included)\n")
    return "\n".join(out)


def line_tables(lines: dict[Key, dict], cv: dict[Key, list[dict]], order: list[str]) -> str:
    """Next-line exact match per method: overall and the gap to the reference in points with its interval."""
    out = []
    for model, data, length in sorted({(k[0], k[1], k[3]) for k in lines}):
        out.append(f"### {model} on {data}, windows of {length} tokens: next-line exact match\n")
        out.append("| method | lines | accuracy | reference | gap (points) [95% CI] |")
        out.append("|---|---|---|---|---|")
        for m in [m for m in order if (model, data, m, length) in lines] + sorted(
                m for (mo, da, m, le) in lines if (mo, da, le) == (model, data, length) and m not in order):
            v = lines[(model, data, m, length)]
            out.append(f"| {m} | {v['lines']} | {v['acc']:.4f} | {v['acc_ref']:.4f} | {v['gap']:+.2f} "
                       f"[{_f(v['gap_lo'], 2)}, {_f(v['gap_hi'], 2)}] |")
        out.append("")
    return "\n".join(out)


def longgen_tables(lg: dict[Key, dict], order: list[str]) -> str:
    out = []
    for model, data, length in sorted({(k[0], k[1], k[3]) for k in lg}):
        out.append(f"### {model} on {data}: long generation after {length}-token prompts\n")
        out.append("| method | prompts | tokens | first divergence (median, min) | reference floor (min) | "
                   "KL along the trajectory [95% CI] | top-1 | path |")
        out.append("|---|---|---|---|---|---|---|---|")
        for m in [m for m in order if (model, data, m, length) in lg] + sorted(
                m for (mo, da, m, le) in lg if (mo, da, le) == (model, data, length) and m not in order):
            v = lg[(model, data, m, length)]
            out.append(f"| {m} | {v['prompts']} | {v['new_tokens']} | {v['first_div_median']}, {v['first_div_min']} | "
                       f"{v['ref_first_div_min']} | {_f(v['kld'])} [{_f(v['kld_lo'])}, {_f(v['kld_hi'])}] | "
                       f"{v['top1']:.3f} | {', '.join(v['path'])} |")
        out.append("")
    return "\n".join(out)


# ----------------------------------------------------------------------------------------------------- plots
def curve_plots(cv: dict[Key, list[dict]], lg: dict[Key, dict], folder: str | Path, order: list[str]) -> list[Path]:
    """Per (model, data, window length): KLD vs position with 95% bands, PPL vs position, next-line accuracy vs
    position where scored; per (model, data, prompt length): KL along the generated trajectory."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for model, data, length in sorted({(k[0], k[1], k[3]) for k in cv}):
        ms = [m for m in order if (model, data, m, length) in cv] + sorted(
            m for (mo, da, m, le) in cv if (mo, da, le) == (model, data, length) and m not in order)
        has_lines = any("acc" in r for m in ms for r in cv[(model, data, m, length)])
        fig, axes = plt.subplots(1, 3 if has_lines else 2, figsize=(15 if has_lines else 10, 4))
        for m in ms:
            rows = cv[(model, data, m, length)]
            x = [r["end"] for r in rows]
            if any(r["kld"] > 0 for r in rows):
                line, = axes[0].plot(x, [r["kld"] for r in rows], marker=".", label=m)
                lo = [r["kld_lo"] for r in rows]
                if not any(math.isnan(v) for v in lo):
                    axes[0].fill_between(x, lo, [r["kld_hi"] for r in rows], color=line.get_color(), alpha=0.2)
            axes[1].plot(x, [r["ppl"] for r in rows], marker=".", label=m)
            if has_lines:
                pts = [(r["end"], 100 * r["acc"]) for r in rows if "acc" in r]
                if pts:
                    axes[2].plot(*zip(*pts), marker=".", label=m)
        axes[0].set(xscale="log", yscale="log", xlabel="position (tokens of context)", ylabel="KL vs BF16 (nats)",
                    title="KLD by position (95% CI)")
        axes[1].set(xscale="log", yscale="log", xlabel="position (tokens of context)", ylabel="perplexity",
                    title="PPL by position")
        if has_lines:
            axes[2].set(xscale="log", xlabel="prefix length (tokens)", ylabel="next-line exact match (%)",
                        title="code completion")
        axes[0].legend(fontsize=7)
        fig.suptitle(f"{model} on {data}, windows of {length} tokens", fontsize=9)
        written.append(_save(plt, fig, folder / f"{_stem(model, data)}_curve_{length}.png"))
    for model, data, length in sorted({(k[0], k[1], k[3]) for k in lg}):
        fig, ax = plt.subplots(figsize=(6, 4))
        for m in [m for m in order if (model, data, m, length) in lg] + sorted(
                m for (mo, da, m, le) in lg if (mo, da, le) == (model, data, length) and m not in order):
            by = lg[(model, data, m, length)]["by_bucket"]
            if by and any(b["kld"] > 0 for b in by):
                ax.plot([b["end"] for b in by], [b["kld"] for b in by], marker=".", label=m)
        ax.set(yscale="log", xlabel="generated tokens", ylabel="KL vs BF16 (nats)",
               title=f"{model}: KL along BF16's trajectory ({length}-token prompts)")
        ax.legend(fontsize=7)
        written.append(_save(plt, fig, folder / f"{_stem(model, data)}_longgen_{length}.png"))
    return written


def _stem(model: str, data: str) -> str:
    from .store import safe_name

    return f"{safe_name(model)}_{safe_name(data)}"


def _save(plt: Any, fig: Any, path: Path) -> Path:
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


__all__ = ["bootstrap", "curves", "overall_lines", "longgen_summary", "curve_tables", "line_tables",
           "longgen_tables", "curve_plots"]
