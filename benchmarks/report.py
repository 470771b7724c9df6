"""Write ``report.md`` (tables a person reads), ``report.json`` (everything measured) and the
plots of sections (1) and (2) from the results of one run."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

PAPER_TABLE4 = (  # 22B model, one layer, A100 (paper Table 4): forward, backward, combined ms
    ("no recompute", 7.7, 11.9, 19.6),
    ("sequence parallel", 7.2, 11.8, 19.0),
    ("full recompute", 7.7, 19.5, 27.2),
    ("selective recompute", 7.7, 13.2, 20.9),
    ("selective + sequence parallel", 7.2, 13.1, 20.3),
)

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


# -- where we win and lose ---------------------------------------------------------------------

NOISE = 0.03
"""Memory ratios within this of 1 are called equal."""

TIME_NOISE = 0.05
"""A time ratio is a win or a loss only if its whole 95% confidence interval lies beyond
1 ± this: from run to run on this shared virtual machine, medians move by about 5% (process
placement, the host), more than the interval of one run shows."""


def _verdict(lo: float, hi: float) -> str:
    """``win`` / ``lose`` / ``tie`` for an ours-is-better-when-above-1 ratio's interval."""
    if lo > 1 + TIME_NOISE:
        return "win"
    if hi < 1 - TIME_NOISE:
        return "lose"
    return "tie"


def _ci(triplet: list[float], digits: int = 3) -> str:
    """``median [low, high]``."""
    median, lo, hi = triplet
    return f"{median:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"


def _pct_ci(triplet: list[float]) -> str:
    median, lo, hi = (x - 1 for x in triplet)
    return f"{_pct(median)} [{_pct(lo)}, {_pct(hi)}]"


def _config_name(r: dict[str, Any]) -> str:
    return f"{'SP' if r['sequence_parallel'] else 'TP'} + {r['recompute']}"


def _memory_verdict(theirs_over_ours: float) -> str:
    """``win`` / ``lose`` / ``tie`` for a memory ratio (ours is better when it is above 1)."""
    if theirs_over_ours > 1 + NOISE:
        return "win"
    if theirs_over_ours < 1 - NOISE:
        return "lose"
    return "tie"


_VERB = {"win": "we win", "lose": "we lose", "tie": "we tie"}


def _bytes_notes(section: dict[str, Any]) -> list[str]:
    rows = section["rows"]
    by_verdict: dict[str, list[str]] = {"win": [], "tie": [], "lose": []}
    for r in rows:
        by_verdict[_memory_verdict(r["dtensor_vs_ours"])].append(f"t={r['t']} {_config_name(r)}")
    headline = "; ".join(
        f"{_VERB[verdict]} at {', '.join(names)}" for verdict, names in by_verdict.items() if names
    )
    worst = max(rows, key=lambda r: abs(r["ours_vs_paper"] - 1))
    gap = abs(worst["ours_vs_paper"] - 1)
    paper = (
        f"Ours equals Table 2 in every row within {100 * gap:.2f}% (LayerNorm's per-row mean "
        "and rstd, which the paper leaves out)."
        if gap < 0.01
        else f"Ours differs from Table 2 by up to {100 * gap:.2f}% (t={worst['t']} "
        f"{_config_name(worst)})."
    )
    lines = [
        f"- **Bytes (DTensor / ours, a difference counts beyond ±{100 * NOISE:.0f}%): "
        f"{headline}.** {paper} DTensor's extra bytes under SP + selective, measured in two "
        "steps (with `torch.native_dropout`'s 1-byte masks, then with `F.dropout`):"
    ]
    for r in rows:
        if not (r["sequence_parallel"] and r["recompute"] == "selective"):
            continue
        t = r["t"]
        sp_leak = r["dtensor_native_dropout_sbh"] - r["ours_sbh"]
        mask_leak = r["dtensor_sbh"] - r["dtensor_native_dropout_sbh"]
        gathered, masks = 4 * (1 - 1 / t), 2 / t  # the two causes' predicted sbh
        text = (
            f"  - t={t}: DTensor {r['dtensor_sbh']:.2f} sbh vs ours {r['ours_sbh']:.2f} "
            f"({r['dtensor_vs_ours']:.3f}×) = {sp_leak:+.2f} sbh with 1-byte masks, "
            f"{mask_leak:+.2f} sbh more with `F.dropout`. "
        )
        if abs(sp_leak - gathered) < 0.05:
            text += (
                "The first is DTensor's `SequenceParallel` plan making `ColwiseParallel` save "
                f"the *all-gathered* input of QKV and fc1 (4sbh(1 − 1/t) = {gathered:.2f}; ours "
                "saves the local shard and all-gathers it again in backward). "
            )
        else:
            text += f"The first is not the all-gathered QKV/fc1 inputs' {gathered:.2f} sbh. "
        if abs(mask_leak - masks) < 0.05:
            text += (
                "The second is `F.dropout` on CPU saving a 2-byte noise tensor per element "
                f"instead of a 1-byte mask on the two residual dropouts (2sbh/t = {masks:.2f})."
            )
        else:
            text += f"The second is not the residual dropouts' 2-byte noise ({masks:.2f} sbh)."
        lines.append(text)
    return lines


def _time_notes(section: dict[str, Any]) -> list[str]:
    rows = section["rows"]
    ours = [r for r in rows if r["implementation"] == "ours"]
    by_key = {(r["implementation"], r["sequence_parallel"], r["recompute"]): r for r in rows}
    slower = [r for r in ours if _verdict(*r["dtensor_over_ours"][1:]) == "lose"]
    faster = [r for r in ours if _verdict(*r["dtensor_over_ours"][1:]) == "win"]
    tied = [r for r in ours if r not in slower and r not in faster]

    def listing(items: list[dict[str, Any]]) -> str:
        return ", ".join(f"{_config_name(r)} ({_ci(r['dtensor_over_ours'])})" for r in items)

    if slower:
        verdict = "Layer time: we lose in places"
    elif faster:
        verdict = "Layer time: we win in places and tie elsewhere"
    else:
        verdict = "Layer time: a tie"
    text = (
        f"- **{verdict}** (DTensor / ours, median [95% CI] of the per-round ratios; a "
        f"difference counts only if the whole interval is beyond ±{100 * TIME_NOISE:.0f}%). "
        + (f"DTensor is faster at {listing(slower)}. " if slower else "")
        + (f"Ours is faster at {listing(faster)}. " if faster else "")
        + (f"Equal within the noise at {listing(tied)}. " if tied else "")
        + "Both run the same matmuls (section 3); what differs is the memory-bound ops "
        "(dropout masks, DTensor's dispatch) and the communication."
    )
    gather = section["collective_seconds"].get("all_gather")
    base = by_key[("ours", True, "none")]["total_seconds"]
    if gather is not None:
        text += (
            " Under SP ours all-gathers the QKV and fc1 inputs a second time in backward "
            f"instead of keeping them: 2 all-gathers of {1e3 * gather:.1f} ms, "
            f"{100 * 2 * gather / base:.1f}% of our SP layer's forward + backward here "
            "(Megatron overlaps it with the input-gradient GEMM on GPUs; here it is not "
            "overlapped)."
        )
    lines = [text]
    sel = by_key[("ours", False, "selective")]["overhead_vs_none"]
    sel_sp = by_key[("ours", True, "selective")]["overhead_vs_baseline"]
    full = by_key[("ours", False, "full")]["overhead_vs_none"]
    fraction = section["selective_forward_flops_fraction"]
    beyond_flops = sel[1] - 1 - fraction / 3  # the interval's low end, over the FLOPs' share
    lines.append(
        f"- **Recompute overheads vs the paper's Table 4**: selective {_pct_ci(sel)} "
        f"(paper +7%), selective + SP {_pct_ci(sel_sp)} vs the no-SP baseline (paper +4%), "
        f"full {_pct_ci(full)} (paper +39%). Selective recomputation redoes "
        f"{_pct(fraction)} of the forward FLOPs, {_pct(fraction / 3)} of forward + backward"
        + (
            f"; at least {_pct(beyond_flops)} more is the softmax, masking and dropout over "
            "the a·s² scores, memory-bound work that costs more than its FLOPs suggest (on "
            "the A100 too: +7% for 1.8% of the FLOPs)."
            if beyond_flops > 0
            else "; the measured interval does not rule out that these FLOPs are all of it."
        )
    )
    sp_cost = by_key[("ours", True, "none")]["overhead_vs_baseline"]
    c = section["collective_seconds"]
    if {"all_gather", "reduce_scatter", "all_reduce"} <= set(c):
        sp_comm = 3 * c["all_gather"] * 2 + 2 * c["reduce_scatter"] * 2
        tp_comm = 4 * c["all_reduce"]
        extra = sp_comm - tp_comm
        lines.append(
            f"- **Sequence parallelism changes our layer time by {_pct_ci(sp_cost)}** (paper "
            "−3%, from running LayerNorm and dropout on 1/t of the sequence). Its collectives "
            "per layer, forward and backward, measured on gloo over loopback: "
            f"{1e3 * sp_comm:.1f} ms for ours (6 all-gathers, 2 of them the backward "
            f"re-gathers, and 4 reduce-scatters) vs {1e3 * tp_comm:.1f} ms for the 4 "
            f"all-reduces without SP, {'+' if extra >= 0 else '−'}{1e3 * abs(extra):.1f} ms = "
            f"{_pct(extra / base)} of our SP layer's forward + backward. On NVLink an "
            "all-gather plus a reduce-scatter costs what an all-reduce does."
        )
    return lines


def _throughput_notes(section: dict[str, Any]) -> list[str]:
    ratio = section["tokens_per_second_ratio"]
    lo, hi = section["tokens_per_second_ratio_ci"]
    word = {"win": "we win", "lose": "we lose", "tie": "a tie"}[_verdict(lo, hi)]
    ours, theirs = section["runs"]["ours"], section["runs"]["lightning_model_parallel"]
    return [
        f"- **Throughput: {word}, {ratio:.3f}× [{lo:.3f}, {hi:.3f}] the tokens/s** of "
        f"`ModelParallelStrategy` + DTensor, at MFU {100 * ours['mfu']:.1f}% vs "
        f"{100 * theirs['mfu']:.1f}% (HFU {100 * ours['hfu']:.1f}% vs "
        f"{100 * theirs['hfu']:.1f}%); both run the same matmuls (section 3).",
        _memory_note(section),
    ]


def _memory_note(section: dict[str, Any]) -> str:
    live, default = section["live_training_rss_ratio"], section["training_rss_ratio"]

    def word(ratio: float) -> str:
        return "win" if ratio < 1 - NOISE else "lose" if ratio > 1 + NOISE else "tie"

    text = (
        f"- **Memory: with the live tensors we {word(live)}** ({live:.3f}× the RSS growth "
        f"during fit, {section['live_peak_rss_ratio']:.3f}× the peak RSS); **with glibc's "
        f"default malloc we {word(default)}** ({default:.3f}×, "
        f"{section['peak_rss_ratio']:.3f}×)."
    )
    if default > live + NOISE:
        text += (
            " The gap is the heap's high-water mark, not tensors: glibc keeps freed blocks "
            "below its (dynamically raised) mmap threshold in the heap, and our sequence of "
            "allocations leaves more of it behind (which allocations, not pinned down yet). "
            "On GPUs the caching allocator holds the live bytes; "
            "on CPU `MALLOC_MMAP_THRESHOLD_=131072` (or jemalloc) gets the live figure."
        )
    return text


def notes(results: dict[str, Any]) -> str:
    """Where we win and where we lose, and why, from this run's numbers."""
    lines: list[str] = []
    if "activation_bytes" in results:
        lines += _bytes_notes(results["activation_bytes"])
    if "layer_time" in results:
        lines += _time_notes(results["layer_time"])
    if "throughput" in results:
        lines += _throughput_notes(results["throughput"])
    lines.append(
        "- **Lightning on CPU**: `ModelParallelStrategy` runs on CPU over gloo (its device mesh "
        'is built on "cpu"). It launches ranks only by re-running the script (`_SubprocessScript'
        "Launcher`), which from inside this benchmark would re-run the whole benchmark in rank "
        "1; so both strategies run here as externally launched ranks (a torchrun-style "
        "environment), each initialising its own process group with a timeout."
    )
    return "\n".join(lines)


# -- markdown ----------------------------------------------------------------------------------


def _table(header: list[str], rows: list[list[Any]]) -> str:
    def cell(v: Any) -> str:
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(header) + " |"]
    lines.append("| " + " | ".join("---" if i == 0 else "---:" for i in range(len(header))) + " |")
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _f(v: float, digits: int = 2) -> str:
    return f"{v:.{digits}f}"


def _pct(v: float, digits: int = 1) -> str:
    return f"{100 * v:+.{digits}f}%"


def _gb(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f}"


def _meta_md(meta: dict[str, Any]) -> str:
    m = meta["machine"]
    lines = [
        f"Produced by `{meta['command']}` on {meta['started']} in {meta['seconds']:.0f} s"
        + (
            " (**smoke mode**: tiny shapes, 1 repeat; the numbers mean nothing)"
            if meta["smoke"]
            else ""
        )
        + ".",
        "",
        f"- **Machine**: {m['cpu']}, {m['cores']} cores, {m['memory_gb']:.1f} GiB RAM, "
        f"{m['platform']}; load average at start {m['loadavg_start']}, at end {m['loadavg_end']}",
        f"- **Software**: torch {meta['torch']}, lightning {meta['lightning']}, "
        f"Python {meta['python']}",
        "- **Sections** (seconds): "
        + ", ".join(f"{k} {v:.0f}" for k, v in meta["section_seconds"].items()),
        "- **Other processes' share of the CPUs** during each section (timings are only "
        "comparable on an idle machine): "
        + ", ".join(
            f"{k} {100 * v:.1f}%" for k, v in meta.get("other_processes_cpu_share", {}).items()
        ),
        "- Every number below is measured in this run; every comparison is a ratio of two "
        "numbers measured in this run.",
    ]
    return "\n".join(lines)


def _summary_md(summary: dict[str, float]) -> str:
    rows = [[SUMMARY_LABELS[k], _f(v, 4)] for k, v in summary.items() if k in SUMMARY_LABELS]
    return _table(["key ratio", "value"], rows)


def _bytes_md(section: dict[str, Any]) -> str:
    shape = section["shape"]
    out = [
        f"bf16, s={shape['s']} b={shape['b']} h={shape['h']} a={shape['a']}, "
        f"{shape['layers']} layers, dropout 0.1; bytes one layer saves for backward on one "
        "rank (the largest over layers and ranks), in units of sbh "
        f"= {shape['s'] * shape['b'] * shape['h']} bytes per byte-per-element. "
        "*DTensor* is the same GPT in plain PyTorch (`nn.Linear`, `F.dropout`, "
        "`torch.utils.checkpoint`) parallelised with `ColwiseParallel` / `RowwiseParallel` / "
        "`SequenceParallel` / `PrepareModuleInput`; *DTensor + native_dropout* replaces "
        "`F.dropout` by `torch.native_dropout` (1-byte masks) to isolate what DTensor itself "
        "keeps.",
        "",
    ]
    header = [
        "t",
        "SP",
        "recompute",
        "paper (Table 2)",
        "ours",
        "ours / paper",
        "DTensor",
        "DTensor + native_dropout",
        "DTensor / ours",
    ]
    rows = [
        [
            r["t"],
            "on" if r["sequence_parallel"] else "off",
            r["recompute"],
            _f(r["paper_sbh"]),
            _f(r["ours_sbh"], 4),
            _f(r["ours_vs_paper"], 4),
            _f(r["dtensor_sbh"], 4),
            _f(r["dtensor_native_dropout_sbh"], 4),
            _f(r["dtensor_vs_ours"], 3),
        ]
        for r in section["rows"]
    ]
    out.append(_table(header, rows))
    return "\n".join(out)


def _layer_md(section: dict[str, Any]) -> str:
    shape = section["shape"]
    out = [
        f"fp32, one layer, s={shape['s']} b={shape['b']} h={shape['h']} a={shape['a']}, "
        f"t={shape['t']} "
        f"(2 ranks, 1 thread each), dropout 0.1. Warm-up rounds: {shape['warmup']}; then rounds "
        "run every layer once (ours and DTensor's back to back) until "
        f"{shape['repeats']} are clean (other processes under 10% of the machine): "
        f"{section['rounds_used']} of {section['rounds_run']} rounds used, others' load at "
        f"most {100 * section['others_max_share_in_used_rounds']:.0f}%. Times are medians over "
        "them, each phase on the slower rank; **ratios are medians of the ratios within a round** "
        "(the machine's speed drifts over tens of seconds even when idle), with 95% bootstrap "
        "confidence intervals; "
        "malloc keeps freed memory for reuse, as a GPU caching allocator does (no page faults "
        "after warm-up). "
        "*vs baseline*: forward + backward over the same implementation's no-recompute, "
        "no-SP layer (the paper's column); *vs none*: over no recompute with the same SP. "
        "Selective recomputation redoes s/(6h+s) = "
        f"{_pct(section['selective_forward_flops_fraction'])} "
        "of the forward FLOPs at this shape (the paper's 22B: 5.3%). Collectives on these "
        "fp32 activations, measured alongside (median): "
        + ", ".join(
            f"{name.replace('_', '-')} {1e3 * sec:.1f} ms"
            for name, sec in section["collective_seconds"].items()
        )
        + ".",
        "",
    ]
    header = [
        "implementation",
        "SP",
        "recompute",
        "forward ms",
        "backward ms",
        "fwd+bwd ms",
        "vs baseline",
        "vs none",
        "DTensor / ours",
    ]
    rows = []
    for r in section["rows"]:
        rows.append(
            [
                r["implementation"],
                "on" if r["sequence_parallel"] else "off",
                r["recompute"],
                _f(1e3 * r["forward_seconds"], 0),
                _f(1e3 * r["backward_seconds"], 0),
                _f(1e3 * r["total_seconds"], 0),
                _pct_ci(r["overhead_vs_baseline"]),
                _pct_ci(r["overhead_vs_none"]),
                _ci(r["dtensor_over_ours"]) if "dtensor_over_ours" in r else "",
            ]
        )
    out.append(_table(header, rows))
    if "lean_over_selective_sp" in section:
        out += [
            "",
            f"Ours, SP: lean / selective fwd+bwd {_ci(section['lean_over_selective_sp'])} "
            f"(s={shape['s']}, dropout 0.1); sdpa / math attention, no recompute, "
            f"{_ci(section['sdpa_over_math_sp_none'])} (s={shape['attention_s']}, no attention "
            "dropout; median [95% CI] of the per-round ratios).",
        ]
    out += [
        "",
        "The paper's Table 4 (22B, one layer, A100), for comparison:",
        "",
        _table(
            ["experiment", "forward ms", "backward ms", "combined ms", "vs baseline"],
            [[n, f, b, c, _pct(c / PAPER_TABLE4[0][3] - 1)] for n, f, b, c in PAPER_TABLE4],
        ),
    ]
    return "\n".join(out)


def _flops_md(section: dict[str, Any]) -> str:
    ls, ms = section["layer_shape"], section["model_shape"]
    out = [
        "`torch.utils.flop_counter.FlopCounterMode` on the real model under `FakeTensorMode` "
        f"(exact counts of the matmuls). One layer at s={ls['s']} b={ls['b']} h={ls['h']}: "
        "whole (t=1) and one rank's shard at t=2 with SP. *Recompute* is a policy's backward "
        "minus the backward without recomputation.",
        "",
    ]
    header = [
        "t",
        "recompute",
        "forward GFLOP",
        "backward GFLOP",
        "recompute GFLOP",
        "recompute / forward",
        "paper",
        "forward = paper",
    ]
    rows = [
        [
            r["t"],
            r["recompute"],
            _f(r["forward_flops"] / 1e9, 2),
            _f(r["backward_flops"] / 1e9, 2),
            _f(r["recompute_flops"] / 1e9, 2),
            _pct(r["recompute_over_forward"], 2),
            _pct(r["paper_recompute_over_forward"], 2),
            "yes" if r["forward_flops"] == r["paper_forward_flops"] else "no",
        ]
        for r in section["layer"]
    ]
    out.append(_table(header, rows))
    out += [
        "",
        f"One training iteration of the throughput model (s={ms['s']} b={ms['b']} h={ms['h']} "
        f"L={ms['layers']} v={ms['vocab']}, t=1), counted vs the paper's formulas "
        "(72BsLh²(1 + s/6h + v/12hL) model FLOPs; hardware FLOPs add the recomputation):",
        "",
        _table(
            [
                "recompute",
                "counted GFLOP",
                "model FLOPs formula",
                "hardware FLOPs formula",
                "counted / hardware formula",
            ],
            [
                [
                    r["recompute"],
                    _f(r["counted_flops"] / 1e9, 1),
                    _f(r["model_flops_formula"] / 1e9, 1),
                    _f(r["hardware_flops_formula"] / 1e9, 1),
                    _f(r["counted_over_hardware_formula"], 6),
                ]
                for r in section["iteration"]
            ],
        ),
    ]
    return "\n".join(out)


def _throughput_md(section: dict[str, Any]) -> str:
    shape = section["shape"]
    runs = section["runs"]
    peaks = " + ".join(_f(p / 1e9, 1) for p in section["peak_flops_per_rank"])
    out = [
        f"fp32, s={shape['s']} b={shape['b']} h={shape['h']} a={shape['a']} L={shape['layers']} "
        f"v={shape['vocab']}, t={shape['t']} with sequence parallelism, recompute "
        f"{shape['recompute']}, dropout 0.1; same seeded weights, same batches (byte-level "
        "standard-library text), same AdamW, same launch (two forked ranks with a "
        "torchrun-style environment). Each strategy trains twice in fresh processes, in the "
        "order ours, Lightning, Lightning, ours (a linear drift of the machine's speed hits "
        f"both alike); each run: {shape['warmup_steps']} warm-up steps, then steps until "
        f"{shape['steps']} are clean (other processes under 10% of the machine) or "
        f"{shape['max_tries']}× as many ran; the step time is the median over both runs' "
        "least disturbed steps (*steps*: used / run, others' largest load among them). "
        "Peak: the best of fp32 1024² GEMM rates measured before and after the runs, both "
        "ranks at once, one thread each: "
        f"{peaks} = {_f(section['peak_flops'] / 1e9, 1)} GFLOP/s. Model FLOPs per step "
        f"{_f(section['model_flops_per_step'] / 1e9, 1)} G (hardware, with recomputation, "
        f"{_f(section['hardware_flops_per_step'] / 1e9, 1)} G). Memory per rank: peak RSS "
        "(`ru_maxrss`) and its growth from before the model exists to the peak, with glibc's "
        "default malloc (the timed runs) and with every allocation ≥ 128 KiB `mmap`ed "
        "(*live*: short extra runs where RSS follows the live tensors, not the heap's "
        "high-water mark).",
        "",
    ]
    names = {
        "ours": "`MegatronSPStrategy` + `GPTModule`",
        "lightning_model_parallel": "`ModelParallelStrategy` + DTensor GPT",
    }
    header = [
        "strategy", "step s", "tokens/s", "model GFLOP/s", "MFU", "HFU", "peak RSS GiB",
        "growth GiB", "live peak GiB", "live growth GiB", "loss first → last", "steps",
    ]  # fmt: skip
    rows = []
    for key, run in runs.items():
        live = run["live_memory"]
        rows.append([
            names[key], _f(run["median_step_seconds"], 3), _f(run["tokens_per_second"], 0),
            _f(run["model_flops_per_second"] / 1e9, 1), _pct(run["mfu"]).lstrip("+"),
            _pct(run["hfu"]).lstrip("+"), _gb(run["peak_rss"]), _gb(run["rss_growth"]),
            _gb(live["peak_rss"]), _gb(live["rss_growth"]),
            f"{run['losses'][0]:.3f} → {run['losses'][-1]:.3f}",
            f"{run['steps_used']}/{run['steps_run']} ({100 * run['others_max_share']:.0f}%)",
        ])  # fmt: skip
    out.append(_table(header, rows))
    out += [
        "",
        f"Ours / Lightning: tokens/s **{_f(section['tokens_per_second_ratio'], 3)}×** (95% CI "
        f"{_f(section['tokens_per_second_ratio_ci'][0], 3)}–"
        f"{_f(section['tokens_per_second_ratio_ci'][1], 3)}); peak RSS "
        f"{_f(section['peak_rss_ratio'], 3)}× (growth {_f(section['training_rss_ratio'], 3)}×) "
        f"with the default malloc, {_f(section['live_peak_rss_ratio'], 3)}× (growth "
        f"{_f(section['live_training_rss_ratio'], 3)}×) live.",
    ]
    return "\n".join(out)


def _comparison_md(comparison: dict[str, dict[str, float]]) -> str:
    rows = [
        [
            SUMMARY_LABELS.get(k, k),
            _f(v["previous"], 4),
            _f(v["current"], 4),
            _pct(v["relative_change"], 2),
        ]
        for k, v in comparison.items()
    ]
    return _table(["key ratio", "previous run", "this run", "change"], rows)


def markdown(report: dict[str, Any], notes: str = "") -> str:
    """The human-readable report."""
    parts = [
        "# lightning-sp benchmarks: vs PyTorch DTensor tensor/sequence parallelism",
        "",
        _meta_md(report["meta"]),
        "",
        "## Key ratios",
        "",
        _summary_md(report["summary"]),
    ]
    if notes:
        parts += ["", "## Where we win and where we lose", "", notes.strip()]
    sections = (
        ("activation_bytes", "1. Activation bytes per layer per rank", _bytes_md),
        ("layer_time", "2. Time per layer, forward and backward (Table 4 analogue)", _layer_md),
        ("flops", "3. FLOPs: forward, backward, recomputation", _flops_md),
        ("throughput", "4. Training throughput, MFU and memory under Lightning", _throughput_md),
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


# -- plots -------------------------------------------------------------------------------------


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
