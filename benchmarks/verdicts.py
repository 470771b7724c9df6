"""Where we win and where we lose, and why: the verdicts and notes the benchmark report
computes from one run's numbers (:func:`notes`; rendered by :mod:`benchmarks.report`)."""

from __future__ import annotations

from typing import Any

from benchmarks._format import ci, config_name, pct, pct_ci

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
        by_verdict[_memory_verdict(r["dtensor_vs_ours"])].append(f"t={r['t']} {config_name(r)}")
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
        f"{config_name(worst)})."
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
        return ", ".join(f"{config_name(r)} ({ci(r['dtensor_over_ours'])})" for r in items)

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
        f"- **Recompute overheads vs the paper's Table 4**: selective {pct_ci(sel)} "
        f"(paper +7%), selective + SP {pct_ci(sel_sp)} vs the no-SP baseline (paper +4%), "
        f"full {pct_ci(full)} (paper +39%). Selective recomputation redoes "
        f"{pct(fraction)} of the forward FLOPs, {pct(fraction / 3)} of forward + backward"
        + (
            f"; at least {pct(beyond_flops)} more is the softmax, masking and dropout over "
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
            f"- **Sequence parallelism changes our layer time by {pct_ci(sp_cost)}** (paper "
            "−3%, from running LayerNorm and dropout on 1/t of the sequence). Its collectives "
            "per layer, forward and backward, measured on gloo over loopback: "
            f"{1e3 * sp_comm:.1f} ms for ours (6 all-gathers, 2 of them the backward "
            f"re-gathers, and 4 reduce-scatters) vs {1e3 * tp_comm:.1f} ms for the 4 "
            f"all-reduces without SP, {'+' if extra >= 0 else '−'}{1e3 * abs(extra):.1f} ms = "
            f"{pct(extra / base)} of our SP layer's forward + backward. On NVLink an "
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
