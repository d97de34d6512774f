"""Plots of an ``oscarkv bench`` result file: batch-1 decode step against context (with the physical floors),
decode throughput against batch under the KV budget, and KV bytes per token. ``series`` extracts what is drawn
(pure, tested); ``plot_results`` draws it with matplotlib (the ``eval`` extra), one PNG per figure.

    oscarkv bench --plot docs/results/e2e_h200_2026-12-01_e990e9a.json    # no GPU needed: redraws from the JSON

Rows carry ``step_ms`` and ``pdl``; results of the earlier benchmark (such as the run at commit e990e9a) carry
``graph_ms`` (a CUDA-graph replay) and ``variant`` instead, and are drawn the same way.
"""

from __future__ import annotations

from pathlib import Path

KVS = ("bf16", "oscar", "oscar-mix")  # drawn where a result has rows of them; bf16 and oscar are the pair compared
COLORS = {"bf16": "tab:gray", "oscar": "tab:blue", "oscar-mix": "tab:orange"}
LABELS = {"bf16": "BF16 cache", "oscar": "OSCAR 2-bit cache", "oscar-mix": "OSCAR per-layer format mix"}


def _ms(row: dict) -> float | None:
    return row.get("step_ms", row.get("graph_ms"))


def _setting(row: dict) -> str:
    """The row's pdl setting ("on" / "off"; older results: the variant's name)."""
    if "pdl" in row and "variant" not in row:
        return "on" if row["pdl"] else "off"
    return row.get("variant", "off")


def _drawn(rows: list[dict]) -> str | None:
    """The setting drawn when a run timed several: "on" if present, else the first."""
    names = list(dict.fromkeys(_setting(r) for r in rows))
    return "on" if "on" in names else (names[0] if names else None)


def series(res: dict) -> dict:
    """``{model: {"latency": {kv: [(context, ms, floor_ms)]}, "throughput": {kv: [(batch, tok_s)]},
    "throughput_context": int | None, "memory": {kv: (paged B/token, B/token with windows)} | None}}``, sorted,
    errored rows left out."""
    out = {}
    for name, entry in res.get("models", {}).items():
        lat = [r for r in entry.get("latency", []) if isinstance(r, dict) and _ms(r) is not None]
        thr = [r for r in entry.get("throughput", []) if isinstance(r, dict) and _ms(r) is not None]
        lv, tv = _drawn(lat), _drawn(thr)
        s = {"latency": {kv: sorted((r["context"], _ms(r), r["floor_ms"]) for r in lat
                                    if r["kv"] == kv and _setting(r) == lv) for kv in KVS},
             "throughput": {kv: sorted((r["batch"], r["tokens_per_s"]) for r in thr
                                       if r["kv"] == kv and _setting(r) == tv) for kv in KVS},
             "throughput_context": thr[0]["context"] if thr else None, "memory": None}
        mem = entry.get("memory")
        if isinstance(mem, dict) and all(kv in mem for kv in KVS[:2]):
            s["memory"] = {kv: (mem[kv]["paged_bytes_per_token"], mem[kv]["bytes_per_token_at_ctx"])
                           for kv in KVS if kv in mem}
        out[name] = s
    return out


def plot_results(res: dict, folder: str | Path, prefix: str = "e2e") -> list[Path]:
    """Write ``{prefix}_latency.png``, ``{prefix}_throughput.png`` and ``{prefix}_memory.png`` (those with data)
    into ``folder``; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = series(res)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    sha = res.get("provenance", {}).get("git_sha", "?")
    gpu = res.get("provenance", {}).get("gpu", "?")
    written = []

    models = [m for m, s in data.items() if any(s["latency"][kv] for kv in KVS)]
    if models:
        fig, axes = plt.subplots(1, len(models), figsize=(5.2 * len(models), 4), squeeze=False)
        for ax, m in zip(axes[0], models):
            for kv in KVS:
                pts = data[m]["latency"][kv]
                if not pts:
                    continue
                ctx = [p[0] / 1024 for p in pts]
                ax.plot(ctx, [p[1] for p in pts], marker="o", color=COLORS[kv], label=f"{LABELS[kv]}: step")
                ax.plot(ctx, [p[2] for p in pts], ls="--", color=COLORS[kv], label=f"{LABELS[kv]}: floor")
                for c, (_, ms, fl) in zip(ctx, pts):
                    ax.annotate(f"{ms / fl:.2f}x", (c, ms), textcoords="offset points", xytext=(0, 6),
                                ha="center", fontsize=7, color=COLORS[kv])
            ax.set(xlabel="context (K tokens)", ylabel="decode step, batch 1 (ms)", title=f"{m} (random weights)")
            ax.set_ylim(bottom=0)
            ax.legend(fontsize=7, loc="upper left")
        fig.suptitle(f"Batch-1 decode step vs its floor (weights + KV bytes / 4.7 TB/s); {gpu}, {sha}", fontsize=9)
        written.append(_save(plt, fig, folder / f"{prefix}_latency.png"))

    models = [m for m, s in data.items() if any(s["throughput"][kv] for kv in KVS)]
    if models:
        fig, axes = plt.subplots(1, len(models), figsize=(5.2 * len(models), 4), squeeze=False)
        for ax, m in zip(axes[0], models):
            for kv in KVS:
                pts = data[m]["throughput"][kv]
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=COLORS[kv], label=LABELS[kv])
                    b, t = pts[-1]
                    ax.annotate(f"{t:.0f} tok/s at {b}", (b, t), textcoords="offset points", xytext=(-6, -3),
                                ha="right", va="top", fontsize=7, color=COLORS[kv])
            ctx = data[m]["throughput_context"]
            tops = [data[m]["throughput"][kv][-1][1] if data[m]["throughput"][kv] else 0.0 for kv in KVS[:2]]
            ratio = f": {tops[1] / tops[0]:.2f}x" if all(tops) else ""
            ax.set(xscale="log", xlabel="sequences decoding (batch)", ylabel="generated tokens / s",
                   title=f"{m}, {ctx // 1024 if ctx else '?'}K context{ratio}")
            ax.set_ylim(bottom=0)
            ax.legend(fontsize=7, loc="upper left")
        fig.suptitle(f"Decode throughput under one KV memory budget (the largest batch is what fits); {gpu}, {sha}",
                     fontsize=9)
        written.append(_save(plt, fig, folder / f"{prefix}_throughput.png"))

    models = [m for m, s in data.items() if s["memory"]]
    if models:
        fig, axes = plt.subplots(1, len(models), figsize=(4.2 * len(models), 3.6), squeeze=False)
        for ax, m in zip(axes[0], models):
            mem = data[m]["memory"]
            x, kvs = range(2), [kv for kv in KVS if kv in mem]
            w = 0.76 / len(kvs)
            for i, kv in enumerate(kvs):
                vals = [mem[kv][0] / 1024, mem[kv][1] / 1024]
                bars = ax.bar([j + w * (i - (len(kvs) - 1) / 2) for j in x], vals, width=w, color=COLORS[kv],
                              label=LABELS[kv])
                for bar, v in zip(bars, vals):
                    ax.annotate(f"{v:.1f}", (bar.get_x() + bar.get_width() / 2, v), textcoords="offset points",
                                xytext=(0, 2), ha="center", fontsize=7)
            ax.set_xticks(list(x), ["paged tier", "per sequence\n(with 16-bit tiers)"])
            ax.set(ylabel="KV KiB per token", title=f"{m}: 1/{mem['bf16'][0] / mem['oscar'][0]:.2f} of BF16")
            ax.legend(fontsize=7)
        written.append(_save(plt, fig, folder / f"{prefix}_memory.png"))
    return written


def _save(plt, fig, path: Path) -> Path:
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


__all__ = ["series", "plot_results"]
