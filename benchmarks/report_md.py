"""The per-section markdown tables of the benchmark report (sections 1-4 and the run's
metadata); :func:`benchmarks.report.markdown` puts them together."""

from __future__ import annotations

from typing import Any

from benchmarks._format import ci, fixed, gb, pct, pct_ci, table

PAPER_TABLE4 = (  # 22B model, one layer, A100 (paper Table 4): forward, backward, combined ms
    ("no recompute", 7.7, 11.9, 19.6),
    ("sequence parallel", 7.2, 11.8, 19.0),
    ("full recompute", 7.7, 19.5, 27.2),
    ("selective recompute", 7.7, 13.2, 20.9),
    ("selective + sequence parallel", 7.2, 13.1, 20.3),
)


def meta_md(meta: dict[str, Any]) -> str:
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


def bytes_md(section: dict[str, Any]) -> str:
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
            fixed(r["paper_sbh"]),
            fixed(r["ours_sbh"], 4),
            fixed(r["ours_vs_paper"], 4),
            fixed(r["dtensor_sbh"], 4),
            fixed(r["dtensor_native_dropout_sbh"], 4),
            fixed(r["dtensor_vs_ours"], 3),
        ]
        for r in section["rows"]
    ]
    out.append(table(header, rows))
    return "\n".join(out)


def layer_md(section: dict[str, Any]) -> str:
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
        f"{pct(section['selective_forward_flops_fraction'])} "
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
                fixed(1e3 * r["forward_seconds"], 0),
                fixed(1e3 * r["backward_seconds"], 0),
                fixed(1e3 * r["total_seconds"], 0),
                pct_ci(r["overhead_vs_baseline"]),
                pct_ci(r["overhead_vs_none"]),
                ci(r["dtensor_over_ours"]) if "dtensor_over_ours" in r else "",
            ]
        )
    out.append(table(header, rows))
    if "lean_over_selective_sp" in section:
        out += [
            "",
            f"Ours, SP: lean / selective fwd+bwd {ci(section['lean_over_selective_sp'])} "
            f"(s={shape['s']}, dropout 0.1); sdpa / math attention, no recompute, "
            f"{ci(section['sdpa_over_math_sp_none'])} (s={shape['attention_s']}, no attention "
            "dropout; median [95% CI] of the per-round ratios).",
        ]
    out += [
        "",
        "The paper's Table 4 (22B, one layer, A100), for comparison:",
        "",
        table(
            ["experiment", "forward ms", "backward ms", "combined ms", "vs baseline"],
            [[n, f, b, c, pct(c / PAPER_TABLE4[0][3] - 1)] for n, f, b, c in PAPER_TABLE4],
        ),
    ]
    return "\n".join(out)


def flops_md(section: dict[str, Any]) -> str:
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
            fixed(r["forward_flops"] / 1e9, 2),
            fixed(r["backward_flops"] / 1e9, 2),
            fixed(r["recompute_flops"] / 1e9, 2),
            pct(r["recompute_over_forward"], 2),
            pct(r["paper_recompute_over_forward"], 2),
            "yes" if r["forward_flops"] == r["paper_forward_flops"] else "no",
        ]
        for r in section["layer"]
    ]
    out.append(table(header, rows))
    out += [
        "",
        f"One training iteration of the throughput model (s={ms['s']} b={ms['b']} h={ms['h']} "
        f"L={ms['layers']} v={ms['vocab']}, t=1), counted vs the paper's formulas "
        "(72BsLh²(1 + s/6h + v/12hL) model FLOPs; hardware FLOPs add the recomputation):",
        "",
        table(
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
                    fixed(r["counted_flops"] / 1e9, 1),
                    fixed(r["model_flops_formula"] / 1e9, 1),
                    fixed(r["hardware_flops_formula"] / 1e9, 1),
                    fixed(r["counted_over_hardware_formula"], 6),
                ]
                for r in section["iteration"]
            ],
        ),
    ]
    return "\n".join(out)


def throughput_md(section: dict[str, Any]) -> str:
    shape = section["shape"]
    runs = section["runs"]
    peaks = " + ".join(fixed(p / 1e9, 1) for p in section["peak_flops_per_rank"])
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
        f"{peaks} = {fixed(section['peak_flops'] / 1e9, 1)} GFLOP/s. Model FLOPs per step "
        f"{fixed(section['model_flops_per_step'] / 1e9, 1)} G (hardware, with recomputation, "
        f"{fixed(section['hardware_flops_per_step'] / 1e9, 1)} G). Memory per rank: peak RSS "
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
            names[key], fixed(run["median_step_seconds"], 3), fixed(run["tokens_per_second"], 0),
            fixed(run["model_flops_per_second"] / 1e9, 1), pct(run["mfu"]).lstrip("+"),
            pct(run["hfu"]).lstrip("+"), gb(run["peak_rss"]), gb(run["rss_growth"]),
            gb(live["peak_rss"]), gb(live["rss_growth"]),
            f"{run['losses'][0]:.3f} → {run['losses'][-1]:.3f}",
            f"{run['steps_used']}/{run['steps_run']} ({100 * run['others_max_share']:.0f}%)",
        ])  # fmt: skip
    out.append(table(header, rows))
    out += [
        "",
        f"Ours / Lightning: tokens/s **{fixed(section['tokens_per_second_ratio'], 3)}×** (95% CI "
        f"{fixed(section['tokens_per_second_ratio_ci'][0], 3)}–"
        f"{fixed(section['tokens_per_second_ratio_ci'][1], 3)}); peak RSS "
        f"{fixed(section['peak_rss_ratio'], 3)}× "
        f"(growth {fixed(section['training_rss_ratio'], 3)}×) "
        f"with the default malloc, {fixed(section['live_peak_rss_ratio'], 3)}× (growth "
        f"{fixed(section['live_training_rss_ratio'], 3)}×) live.",
    ]
    return "\n".join(out)
