"""Aggregate result JSONL files into markdown tables and PNG plots."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable

from .metrics import perplexity
from .store import ResultStore, safe_name

Group = tuple[str, str, str, str, Any]  # model, data, task, method, context


def aggregate(records: Iterable[dict]) -> dict[Group, dict]:
    """Mean metrics per (model, data, task, method, context)."""
    groups: dict[Group, list[dict]] = defaultdict(list)
    for r in records:
        groups[(r["model"], r["data"], r["task"], r["method"], r["context"])].append(r)
    return {g: _summarise(g[2], rs) for g, rs in groups.items()}


def _mean(rs: list[dict], key: str) -> float:
    vals = [float(r[key]) for r in rs if r.get(key) is not None]
    return sum(vals) / len(vals) if vals else float("nan")


def _summarise(task: str, rs: list[dict]) -> dict:
    out: dict[str, Any] = {"units": len(rs)}
    if task == "lm":
        n = sum(int(r["n"]) for r in rs)
        out.update(kld=sum(r["kld"] * r["n"] for r in rs) / max(n, 1),
                   top1=sum(r["top1"] * r["n"] for r in rs) / max(n, 1),
                   ppl=perplexity(sum(r["nll"] * r["n"] for r in rs), n),
                   ppl_ref=perplexity(sum(r["nll_ref"] * r["n"] for r in rs), n), tokens=n,
                   logit_rel_err=_mean(rs, "logit_rel_err"), kld_max=max(r["kld_max"] for r in rs),
                   paths=sorted({r.get("path", "simulate") for r in rs}))
    elif task == "niah":
        out["acc"] = _mean(rs, "correct")
        cells: dict[tuple[float, str], list[int]] = defaultdict(list)
        for r in rs:
            cells[(float(r["depth"]), r["variant"])].append(int(r["correct"]))
        out["by_depth"] = {d: sum(v for (dd, _), vs in cells.items() if dd == d for v in vs)
                           / sum(len(vs) for (dd, _), vs in cells.items() if dd == d)
                           for d in sorted({k[0] for k in cells})}
        out["by_variant"] = {var: _mean([r for r in rs if r["variant"] == var], "correct")
                             for var in sorted({r["variant"] for r in rs})}
        out["by_cell"] = {var: {d: _mean([r for r in rs if r["variant"] == var and float(r["depth"]) == d], "correct")
                                for d in sorted({float(r["depth"]) for r in rs if r["variant"] == var})}
                          for var in out["by_variant"]}
        out["paths"] = sorted({r.get("path", "-") for r in rs})
        out["bits_physical"] = _mean(rs, "bits_physical")
        out["bits_quantized_tier"] = _mean(rs, "bits_quantized_tier")
    elif task == "greedy":
        out.update(first_div=_mean(rs, "first_div"), exact=_mean(rs, "exact"), agree=_mean(rs, "agree"))
    elif task == "fidelity":
        layers = [r["attn_rel_err"] for r in rs]
        out["attn_rel_err"] = [sum(col) / len(col) for col in zip(*layers)]
        out["logit_rel_err"] = _mean(rs, "logit_rel_err")
    return out


# ------------------------------------------------------------------------------------------------ tables
def _fmt(x: float, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if isinstance(x, float) and (abs(x) >= 1000 or (0 < abs(x) < 10 ** -digits)):
        return f"{x:.2e}"
    return f"{x:.{digits}f}"


def _order(methods: Iterable[str], preferred: list[str] | None) -> list[str]:
    ms = sorted(set(methods))
    pref = preferred or []
    return [m for m in pref if m in ms] + [m for m in ms if m not in pref]


def markdown_tables(agg: dict[Group, dict], methods_info: dict[str, dict] | None = None,
                    order: list[str] | None = None) -> str:
    """One section per (model, data) and task."""
    info = methods_info or {}
    out = []
    for model, data in sorted({(g[0], g[1]) for g in agg}):
        sub = {g: v for g, v in agg.items() if g[0] == model and g[1] == data}
        for task, render in (("lm", _lm_table), ("niah", _niah_table), ("greedy", _greedy_table),
                             ("fidelity", _fidelity_table)):
            part = {g: v for g, v in sub.items() if g[2] == task}
            if part:
                out.append(f"### {model} on {data}: {task}\n\n" + render(part, info.get(model, {}), order) + "\n")
    return "\n".join(out)


def _bits(info: dict, m: str) -> str:
    b = info.get(m, {}).get("bits")
    return _fmt(b, 2) if isinstance(b, (int, float)) else "-"


def _lm_table(part: dict[Group, dict], info: dict, order: list[str] | None) -> str:
    """KLD, top-1 and PPL per context; each row's reference PPL (in parentheses) and window count are its own,
    since methods may have been run on different numbers of windows."""
    ctxs = sorted({g[4] for g in part})
    cols = " | ".join(f"KLD@{c} | top-1@{c} | PPL@{c} (ref) | win@{c}" for c in ctxs)
    head = f"| method | bits/elem | {cols} | path |"
    rows = [head, "|" + "---|" * (3 + 4 * len(ctxs))]
    for m in _order((g[3] for g in part), order):
        cells = []
        for c in ctxs:
            v = next((v for g, v in part.items() if g[3] == m and g[4] == c), None)
            cells += ([_fmt(v["kld"], 4), _fmt(v["top1"], 3), f"{_fmt(v['ppl'], 2)} ({_fmt(v['ppl_ref'], 2)})",
                       str(v["units"])] if v else ["-"] * 4)
        used = sorted({p for g, v in part.items() if g[3] == m for p in v.get("paths", [])})
        rows.append(f"| {m} | {_bits(info, m)} | " + " | ".join(cells) + f" | {', '.join(used) or '-'} |")
    return "\n".join(rows) + ("\n\n(KLD: mean KL(reference || method) in nats over scored positions; top-1: argmax "
                              "agreement; PPL over the same positions, the reference's on the same windows in "
                              "parentheses; win: windows evaluated)\n")


def _niah_table(part: dict[Group, dict], info: dict, order: list[str] | None) -> str:
    ctxs = sorted({g[4] for g in part})
    rows = ["| method | bits/elem nominal | " + " | ".join(f"NIAH@{c}" for c in ctxs)
            + f" | physical bits@{ctxs[-1]} (quantized tier) | path |", "|" + "---|" * (4 + len(ctxs))]
    for m in _order((g[3] for g in part), order):
        cells = []
        for c in ctxs:
            v = next((v for g, v in part.items() if g[3] == m and g[4] == c), None)
            cells.append(f"{_fmt(v['acc'], 2)} ({v['units']})" if v else "-")
        last = next((v for g, v in part.items() if g[3] == m and g[4] == ctxs[-1]), None)
        phys = f"{_fmt(last['bits_physical'], 2)} ({_fmt(last['bits_quantized_tier'], 2)})" if last else "-"
        used = sorted({p for g, v in part.items() if g[3] == m for p in v.get("paths", [])})
        rows.append(f"| {m} | {_bits(info, m)} | " + " | ".join(cells) + f" | {phys} | {', '.join(used) or '-'} |")
    text = "\n".join(rows) + ("\n\n(accuracy over samples, sample count in parentheses; physical bits = bytes held "
                              "by the cache's tensors after the prompt and answer, per K/V element)\n")
    variants = sorted({var for v in part.values() for var in v.get("by_variant", {})})
    if len(variants) > 1:
        rows = ["| method | context | " + " | ".join(variants) + " |", "|" + "---|" * (2 + len(variants))]
        for m in _order((g[3] for g in part), order):
            for g, v in sorted(((g, v) for g, v in part.items() if g[3] == m), key=lambda t: t[0][4]):
                rows.append(f"| {m} | {g[4]} | " + " | ".join(_fmt(v["by_variant"].get(var), 2) for var in variants)
                            + " |")
        text += "\nBy variant (accuracy):\n\n" + "\n".join(rows) + "\n"
    return text


def _greedy_table(part: dict[Group, dict], info: dict, order: list[str] | None) -> str:
    ctxs = sorted({g[4] for g in part})
    rows = ["| method | " + " | ".join(f"exact@{c} | first-div@{c}" for c in ctxs) + " |",
            "|" + "---|" * (1 + 2 * len(ctxs))]
    for m in _order((g[3] for g in part), order):
        cells = []
        for c in ctxs:
            v = next((v for g, v in part.items() if g[3] == m and g[4] == c), None)
            cells += [_fmt(v["exact"], 2), _fmt(v["first_div"], 1)] if v else ["-", "-"]
        rows.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


def _fidelity_table(part: dict[Group, dict], info: dict, order: list[str] | None) -> str:
    rows = ["| method | context | logit rel. err | mean attn rel. err | worst layer (err) |", "|---|---|---|---|---|"]
    for m in _order((g[3] for g in part), order):
        for g, v in sorted(((g, v) for g, v in part.items() if g[3] == m), key=lambda t: t[0][4]):
            errs = v["attn_rel_err"]
            worst = max(range(len(errs)), key=errs.__getitem__)
            rows.append(f"| {m} | {g[4]} | {_fmt(v['logit_rel_err'])} | {_fmt(sum(errs) / len(errs))} | "
                        f"{worst} ({_fmt(errs[worst])}) |")
    return "\n".join(rows) + "\n"


# ------------------------------------------------------------------------------------------------- plots
def plots(agg: dict[Group, dict], folder: str | Path, order: list[str] | None = None) -> list[Path]:
    """KLD vs context, NIAH depth x length heat maps and per-layer fidelity curves, one PNG per model/data."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for model, data in sorted({(g[0], g[1]) for g in agg}):
        sub = {g: v for g, v in agg.items() if g[0] == model and g[1] == data}
        stem = f"{safe_name(model)}_{safe_name(data)}"
        lm = {g: v for g, v in sub.items() if g[2] == "lm"}
        if lm:
            fig, ax = plt.subplots(figsize=(6, 4))
            for m in _order((g[3] for g in lm), order):
                pts = sorted((g[4], v["kld"]) for g, v in lm.items() if g[3] == m and v["kld"] > 0)
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=m)
            ax.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="mean KL vs BF16 (nats)",
                   title=f"{model} on {data}")
            ax.legend(fontsize=7)
            written.append(_save(fig, folder / f"{stem}_kld.png"))
        niah = {g: v for g, v in sub.items() if g[2] == "niah"}
        if niah:
            written.append(_niah_heatmaps(plt, niah, folder / f"{stem}_niah.png", f"{model} on {data}", order))
        fid = {g: v for g, v in sub.items() if g[2] == "fidelity"}
        if fid:
            fig, ax = plt.subplots(figsize=(6, 4))
            for g, v in sorted(fid.items(), key=lambda t: (t[0][3], t[0][4])):
                ax.plot(v["attn_rel_err"], label=f"{g[3]} @{g[4]}")
            ax.set(yscale="log", xlabel="layer", ylabel="attention-output rel. error", title=f"{model} on {data}")
            ax.legend(fontsize=7)
            written.append(_save(fig, folder / f"{stem}_fidelity.png"))
    return written


def _niah_heatmaps(plt: Any, niah: dict, path: Path, title: str, order: list[str] | None) -> Path:
    """One row of heat maps per NIAH variant, one column per method: accuracy by needle depth x context length
    (all variants pooled when there is one)."""
    methods = _order((g[3] for g in niah), order)
    ctxs = sorted({g[4] for g in niah})
    depths = sorted({d for v in niah.values() for d in v["by_depth"]})
    variants = sorted({var for v in niah.values() for var in v.get("by_cell", {})}) or ["all"]
    fig, axes = plt.subplots(len(variants), len(methods), figsize=(2.2 * len(methods) + 1, 2.4 * len(variants) + 0.4),
                             squeeze=False)
    first = next(iter(niah))[:3]
    im = None
    for row, var in enumerate(variants):
        for ax, m in zip(axes[row], methods):
            def acc(c: int, d: float) -> float:
                v = niah.get((*first, m, c), {})
                if var == "all":
                    return v.get("by_depth", {}).get(d, float("nan"))
                return v.get("by_cell", {}).get(var, {}).get(d, float("nan"))

            grid = [[acc(c, d) for c in ctxs] for d in depths]
            im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
            ax.set_xticks(range(len(ctxs)), [str(c) for c in ctxs], fontsize=6)
            ax.set_yticks(range(len(depths)), [f"{d:.2f}" for d in depths], fontsize=6)
            ax.set_title(m if var == "all" else f"{m}\n{var}", fontsize=7)
        axes[row][0].set_ylabel("needle depth")
    fig.suptitle(title + " - NIAH accuracy (length x depth)", fontsize=9)
    fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.8)
    return _save(fig, path)


def _save(fig: Any, path: Path) -> Path:
    fig.savefig(path, dpi=110, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def write_report(out: str | Path, order: list[str] | None = None, title: str = "oscarkv eval") -> Path:
    """Aggregate everything under ``out`` into ``out/summary.md``, ``out/summary.json`` and PNG plots (tables
    and plots of the position curves, next-line accuracy and long generation from :mod:`oscarkv.eval.curves`)."""
    out = Path(out)
    agg = aggregate(r for r in ResultStore(out).records() if r.get("task") in ("lm", "niah", "greedy", "fidelity"))
    info, numerics = {}, []
    for p in sorted(out.glob("*/methods.json")):
        meta = json.loads(p.read_text())
        info[meta.get("model", p.parent.name)] = meta.get("methods", {})
        if meta.get("numerics"):
            n = meta["numerics"]
            numerics.append(f"* {meta.get('model', p.parent.name)} (latest run): "
                            + ", ".join(f"{k} {v}" for k, v in n.items()))
    from .curves import curve_plots, curve_tables, curves, line_tables, longgen_summary, longgen_tables, overall_lines

    records = list(ResultStore(out).records())
    cv, lines, lg = curves(records), overall_lines(records), longgen_summary(records)
    pngs = plots(agg, out / "plots", order) + curve_plots(cv, lg, out / "plots", order or [])
    md = f"# {title}\n\n" + ("\n".join(numerics) + "\n\n" if numerics else "") + markdown_tables(agg, info, order)
    for part in (curve_tables(cv, order or []), line_tables(lines, cv, order or []), longgen_tables(lg, order or [])):
        if part:
            md += "\n" + part
    md += "\n" + "\n".join(f"![{p.stem}](plots/{p.name})" for p in pngs) + "\n"
    (out / "summary.md").write_text(md)
    summary = {"|".join(map(str, g)): v for g, v in agg.items()}
    summary.update({"curve|" + "|".join(map(str, k)): v for k, v in cv.items()})
    summary.update({"lines|" + "|".join(map(str, k)): v for k, v in lines.items()})
    summary.update({"longgen|" + "|".join(map(str, k)): v for k, v in lg.items()})
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    return out / "summary.md"


def portable(obj: Any, roots: list[tuple[str, str]] | None = None) -> Any:
    """``obj`` (nested dicts, lists, strings) with this machine's paths written portably, wherever they occur in a
    string: installed packages as ``<site-packages>``, the interpreter's own library as ``<python>``, the working
    directory as ``.``, the home directory as ``~``. A result of record names no machine's paths."""
    if roots is None:
        import site
        import sys
        import sysconfig

        found = {p: "<site-packages>" for p in [*site.getsitepackages(), sysconfig.get_paths()["purelib"]]}
        found[sysconfig.get_paths()["stdlib"]] = "<python>"
        found[str(Path.cwd())] = "."
        found[str(Path.home())] = "~"
        found.setdefault(sys.base_prefix, "<python>")
        roots = sorted(((k, v) for k, v in found.items() if k and k != "/"), key=lambda kv: -len(kv[0]))
    if isinstance(obj, str):
        for prefix, name in roots:
            obj = obj.replace(prefix, name)
        return obj
    if isinstance(obj, dict):
        return {k: portable(v, roots) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [portable(v, roots) for v in obj]
    return obj


def export(out: str | Path, dest: str | Path, topic: str) -> Path:
    """Write the results of ``out`` as a result of record: ``dest/<topic>_<date>_<commit>.json`` (the summary,
    every model's ``methods.json`` with its commands, texts and calibration provenance, and the versions and
    commit it was made with) and the plots beside it as ``<topic>_<date>_<commit>_<plot>.png``. Run
    :func:`write_report` first."""
    import datetime
    import platform
    import shutil
    import subprocess

    import torch

    from .. import __version__

    out, dest = Path(out), Path(dest)
    summary = out / "summary.json"
    if not summary.is_file():
        raise FileNotFoundError(f"{summary} is missing: rebuild the report first (oscarkv eval --report-only)")
    try:
        commit = subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], capture_output=True, text=True,
                                check=True, cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "nocommit"
    date = datetime.date.today().isoformat()
    stem = f"{topic}_{date}_{commit}"
    dest.mkdir(parents=True, exist_ok=True)
    import transformers

    record = {"topic": topic, "date": date, "commit": commit, "oscarkv": __version__, "torch": torch.__version__,
              "transformers": transformers.__version__, "python": platform.python_version(),
              "machine": platform.machine(), "models": {}, "summary": json.loads(summary.read_text())}
    for p in sorted(out.glob("*/methods.json")):
        meta = json.loads(p.read_text())
        record["models"][meta.get("model", p.parent.name)] = meta
    path = dest / f"{stem}.json"
    path.write_text(json.dumps(portable(record), indent=1, default=str) + "\n")
    for png in sorted((out / "plots").glob("*.png")):
        shutil.copy(png, dest / f"{stem}_{png.name}")
    return path


__all__ = ["aggregate", "markdown_tables", "plots", "write_report", "export", "portable"]
