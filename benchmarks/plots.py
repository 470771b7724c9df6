"""The plots of the benchmark report: sections (1) activation bytes and (2) layer time."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_activation_bytes(section: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({r["t"] for r in section["rows"]})
    fig, axes = plt.subplots(1, len(sizes), figsize=(6.5 * len(sizes), 4.2), squeeze=False)
    series = (
        ("paper_sbh", "paper (Table 2)", "#999999"),
        ("ours_sbh", "lightning-sp", "#1f77b4"),
        ("dtensor_native_dropout_sbh", "DTensor + native_dropout", "#ffbb78"),
        ("dtensor_sbh", "DTensor + F.dropout", "#ff7f0e"),
    )
    for ax, t in zip(axes[0], sizes, strict=True):
        rows = [r for r in section["rows"] if r["t"] == t]
        labels = [f"{'SP' if r['sequence_parallel'] else 'TP'}\n{r['recompute']}" for r in rows]
        width = 0.2
        for i, (key, name, color) in enumerate(series):
            xs = [j + (i - 1.5) * width for j in range(len(rows))]
            ax.bar(xs, [r[key] for r in rows], width, label=name, color=color)
        ax.set_xticks(range(len(rows)), labels)
        ax.set_ylabel("bytes per layer per rank / sbh")
        ax.set_title(f"activation memory per layer, t = {t} (bf16)")
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_layer_time(section: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = section["rows"]
    configs = [
        (r["sequence_parallel"], r["recompute"]) for r in rows if r["implementation"] == "ours"
    ]
    by_key = {(r["implementation"], r["sequence_parallel"], r["recompute"]): r for r in rows}
    fig, ax = plt.subplots(figsize=(9, 4.2))
    width = 0.38
    colors = {"ours": ("#1f77b4", "#aec7e8"), "dtensor": ("#ff7f0e", "#ffbb78")}
    for i, impl in enumerate(("ours", "dtensor")):
        xs = [j + (i - 0.5) * width for j in range(len(configs))]
        fwd = [1e3 * by_key[(impl, sp, p)]["forward_seconds"] for sp, p in configs]
        bwd = [1e3 * by_key[(impl, sp, p)]["backward_seconds"] for sp, p in configs]
        name = "lightning-sp" if impl == "ours" else "DTensor"
        ax.bar(xs, fwd, width, color=colors[impl][0], label=f"{name} forward")
        ax.bar(xs, bwd, width, bottom=fwd, color=colors[impl][1], label=f"{name} backward")
    ax.set_xticks(range(len(configs)), [f"{'SP' if sp else 'TP'}\n{p}" for sp, p in configs])
    ax.set_ylabel("ms per layer (median)")
    shape = section["shape"]
    ax.set_title(
        f"one layer, fp32, s={shape['s']} b={shape['b']} h={shape['h']}, t={shape['t']} (CPU)"
    )
    ax.legend(fontsize=8, ncol=2)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
