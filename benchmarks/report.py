"""Write ``report.md`` (tables a person reads), ``report.json`` (everything measured) and the
plots of sections (1) and (2) from the results of one run.

The section tables are in :mod:`benchmarks.report_md`, the notes on where we win and lose in
:mod:`benchmarks.verdicts`, the plots in :mod:`benchmarks.plots`."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from benchmarks._format import fixed, pct, table
from benchmarks.plots import plot_activation_bytes, plot_layer_time
from benchmarks.report_md import bytes_md, flops_md, layer_md, meta_md, throughput_md
from benchmarks.verdicts import notes

SUMMARY_LABELS = {
    "bytes_sp_selective_t2_ours_sbh": "bytes/layer, TP+SP+selective t=2, ours (sbh)",
    "bytes_sp_selective_t2_dtensor_sbh": "bytes/layer, TP+SP+selective t=2, DTensor (sbh)",
    "bytes_sp_selective_t4_ours_sbh": "bytes/layer, TP+SP+selective t=4, ours (sbh)",
    "bytes_sp_selective_t4_dtensor_sbh": "bytes/layer, TP+SP+selective t=4, DTensor (sbh)",
    "bytes_sp_selective_t2_dtensor_over_ours": "bytes, DTensor / ours, TP+SP+selective t=2",
    "bytes_sp_selective_t4_dtensor_over_ours": "bytes, DTensor / ours, TP+SP+selective t=4",
    "time_ours_sp_selective_over_baseline": "layer time, ours SP+selective / no-recompute no-SP",
    "time_ours_sp_full_over_baseline": "layer time, ours SP+full / no-recompute no-SP",
    "time_ours_selective_over_none": "layer time, ours selective / none (no SP)",
    "time_ours_full_over_none": "layer time, ours full / none (no SP)",
    "time_dtensor_sp_selective_over_baseline": "layer time, DTensor SP+selective / its baseline",
    "time_dtensor_over_ours_sp_selective": "layer time, DTensor / ours, SP+selective",
    "time_dtensor_over_ours_sp_none": "layer time, DTensor / ours, SP, no recompute",
    "time_dtensor_over_ours_nosp_none": "layer time, DTensor / ours, no SP, no recompute",
    "flops_selective_recompute_over_forward": "FLOPs, selective recompute / forward (counted)",
    "flops_paper_selective_fraction": "FLOPs, s/(6h+s) (paper)",
    "throughput_tokens_per_second_ratio": "throughput, ours / Lightning ModelParallel (tokens/s)",
    "throughput_mfu_ours": "MFU, ours",
    "throughput_mfu_lightning": "MFU, Lightning ModelParallel + DTensor",
    "throughput_peak_rss_ratio": "peak RSS per rank, ours / Lightning",
    "throughput_training_rss_ratio": "RSS growth during fit, ours / Lightning",
    "throughput_live_peak_rss_ratio": "peak RSS per rank, large allocs mmapped, ours / Lightning",
    "throughput_live_training_rss_ratio": "RSS growth, large allocs mmapped, ours / Lightning",
}
"""The key ratios, compared across runs (reproducibility) and shown at the top of the report."""


def summarize(results: dict[str, Any]) -> dict[str, float]:
    """The key ratios of one run (the keys of :data:`SUMMARY_LABELS` that were measured)."""
    out: dict[str, float] = {}
    if "activation_bytes" in results:
        for row in results["activation_bytes"]["rows"]:
            if row["sequence_parallel"] and row["recompute"] == "selective":
                t = row["t"]
                out[f"bytes_sp_selective_t{t}_ours_sbh"] = row["ours_sbh"]
                out[f"bytes_sp_selective_t{t}_dtensor_sbh"] = row["dtensor_sbh"]
                out[f"bytes_sp_selective_t{t}_dtensor_over_ours"] = row["dtensor_vs_ours"]
    if "layer_time" in results:
        rows = {
            (r["implementation"], r["sequence_parallel"], r["recompute"]): r
            for r in results["layer_time"]["rows"]
        }

        def ratio(impl: str, sp: bool, policy: str, name: str) -> float:
            return rows[(impl, sp, policy)][name][0]  # [median, low, high]

        out["time_ours_sp_selective_over_baseline"] = ratio(
            "ours", True, "selective", "overhead_vs_baseline"
        )
        out["time_ours_sp_full_over_baseline"] = ratio("ours", True, "full", "overhead_vs_baseline")
        out["time_ours_selective_over_none"] = ratio("ours", False, "selective", "overhead_vs_none")
        out["time_ours_full_over_none"] = ratio("ours", False, "full", "overhead_vs_none")
        out["time_dtensor_sp_selective_over_baseline"] = ratio(
            "dtensor", True, "selective", "overhead_vs_baseline"
        )
        out["time_dtensor_over_ours_sp_selective"] = ratio(
            "ours", True, "selective", "dtensor_over_ours"
        )
        out["time_dtensor_over_ours_sp_none"] = ratio("ours", True, "none", "dtensor_over_ours")
        out["time_dtensor_over_ours_nosp_none"] = ratio("ours", False, "none", "dtensor_over_ours")
    if "flops" in results:
        flops = results["flops"]
        row = next(r for r in flops["layer"] if r["t"] == 1 and r["recompute"] == "selective")
        out["flops_selective_recompute_over_forward"] = row["recompute_over_forward"]
        out["flops_paper_selective_fraction"] = flops["paper_selective_fraction"]
    if "throughput" in results:
        tp = results["throughput"]
        out["throughput_tokens_per_second_ratio"] = tp["tokens_per_second_ratio"]
        out["throughput_mfu_ours"] = tp["runs"]["ours"]["mfu"]
        out["throughput_mfu_lightning"] = tp["runs"]["lightning_model_parallel"]["mfu"]
        out["throughput_peak_rss_ratio"] = tp["peak_rss_ratio"]
        out["throughput_training_rss_ratio"] = tp["training_rss_ratio"]
        out["throughput_live_peak_rss_ratio"] = tp["live_peak_rss_ratio"]
        out["throughput_live_training_rss_ratio"] = tp["live_training_rss_ratio"]
    return out


def compare(previous: dict[str, float], current: dict[str, float]) -> dict[str, dict[str, float]]:
    """``{key: {previous, current, relative_change}}`` for the keys both runs have."""
    out = {}
    for key, now in current.items():
        if key in previous:
            before = previous[key]
            change = (now - before) / before if before else math.nan
            out[key] = {"previous": before, "current": now, "relative_change": change}
    return out


# -- markdown ----------------------------------------------------------------------------------


def _summary_md(summary: dict[str, float]) -> str:
    rows = [[SUMMARY_LABELS[k], fixed(v, 4)] for k, v in summary.items() if k in SUMMARY_LABELS]
    return table(["key ratio", "value"], rows)


def _comparison_md(comparison: dict[str, dict[str, float]]) -> str:
    rows = [
        [
            SUMMARY_LABELS.get(k, k),
            fixed(v["previous"], 4),
            fixed(v["current"], 4),
            pct(v["relative_change"], 2),
        ]
        for k, v in comparison.items()
    ]
    return table(["key ratio", "previous run", "this run", "change"], rows)


def markdown(report: dict[str, Any], notes: str = "") -> str:
    """The human-readable report."""
    parts = [
        "# lightning-sp benchmarks: vs PyTorch DTensor tensor/sequence parallelism",
        "",
        meta_md(report["meta"]),
        "",
        "## Key ratios",
        "",
        _summary_md(report["summary"]),
    ]
    if notes:
        parts += ["", "## Where we win and where we lose", "", notes.strip()]
    sections = (
        ("activation_bytes", "1. Activation bytes per layer per rank", bytes_md),
        ("layer_time", "2. Time per layer, forward and backward (Table 4 analogue)", layer_md),
        ("flops", "3. FLOPs: forward, backward, recomputation", flops_md),
        ("throughput", "4. Training throughput, MFU and memory under Lightning", throughput_md),
    )
    for key, title, render in sections:
        if key in report:
            parts += ["", f"## {title}", "", render(report[key])]
    if report.get("previous_run"):
        parts += [
            "",
            "## Against the previous run in this directory (reproducibility)",
            "",
            _comparison_md(report["previous_run"]),
        ]
    plots = [p for p in ("activation_bytes.png", "layer_time.png") if p in report["meta"]["plots"]]
    if plots:
        parts += ["", "## Plots", ""] + [f"![{p}]({p})" for p in plots]
    return "\n".join(parts) + "\n"


def write(report: dict[str, Any], out_dir: Path, notes: str = "") -> None:
    """Write the plots, ``report.json`` and ``report.md`` into ``out_dir``.

    ``python -m benchmarks.report DIR`` renders them again from ``DIR/report.json``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = []
    if "activation_bytes" in report:
        plot_activation_bytes(report["activation_bytes"], out_dir / "activation_bytes.png")
        plots.append("activation_bytes.png")
    if "layer_time" in report:
        plot_layer_time(report["layer_time"], out_dir / "layer_time.png")
        plots.append("layer_time.png")
    report["meta"]["plots"] = plots
    (out_dir / "report.json").write_text(json.dumps(report, indent=1, allow_nan=False) + "\n")
    (out_dir / "report.md").write_text(markdown(report, notes))


def main(argv: list[str] | None = None) -> None:
    """Render ``report.md`` and the plots again from a ``report.json`` (no measuring)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m benchmarks.report", description=main.__doc__)
    parser.add_argument("out", type=Path, help="directory holding report.json")
    out_dir = parser.parse_args(argv).out
    report = json.loads((out_dir / "report.json").read_text())
    sections = ("activation_bytes", "layer_time", "flops", "throughput")
    write(report, out_dir, notes({k: report[k] for k in sections if k in report}))


if __name__ == "__main__":
    main()
