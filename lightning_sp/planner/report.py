"""What ``estimate`` prints and draws: the table, the JSON rows and the memory ladder
(Figure 7).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

from lightning_sp.errors import ConfigError
from lightning_sp.memory.formulas import FIGURE7_ROWS, TABLE2_SETTINGS, layers_in_flight
from lightning_sp.memory.model_state import (
    MIXED_PRECISION_ADAM,
    model_active_parameter_count,
    model_state_bytes,
)
from lightning_sp.model.fp8 import fp8_recipe
from lightning_sp.parallel.fp8 import KEEPS_FLOAT8_INPUT
from lightning_sp.planner.estimate import no_gain_notes
from lightning_sp.planner.records import Estimate, EstimateRow, gigabytes

JSON_KEYS = (
    "sequence_parallel",
    "recompute",
    "activation_bytes_per_layer",
    "formula_bytes_per_layer",
    "first_stage_activation_bytes",
    "model_state_bytes",
    "total_bytes",
    "device_bytes",
    "fits",
    "iteration_seconds",
    "tokens_per_second",
    "model_tflops_per_gpu",
    "mfu",
    "hfu",
    "model_tflops_per_gpu_causal_half",
    "mfu_causal_half",
)
"""The keys every ``--format json`` row has first. Two FLOP conventions: ``model_tflops_per_gpu``
and ``mfu`` count attention whole (the paper's Appendix A, torchtitan, Megatron-Core until
2025); the ``_causal_half`` pair count causal attention's cores at half (Megatron-LM since
2025, MaxText). ``hfu`` counts whole, recomputation included."""


def to_json(row: EstimateRow) -> dict[str, Any]:
    """The ``--format json`` object of one row: :data:`JSON_KEYS`, then the other fields."""
    out = {key: getattr(row, key) for key in JSON_KEYS}
    out["formula_first_stage_activation_bytes"] = row.formula_first_stage_activation_bytes
    out["recompute_num_layers"] = row.recompute_num_layers
    out["recompute_rest"] = row.recompute_rest
    out["selected"] = row.selected
    return out


def _candidate_json(candidate: Any) -> dict[str, Any]:
    """One ``--search --format json`` object: the layout's sizes, then its row.
    ``num_microbatches`` is the micro-batches of one step on a rank (``b·n·d`` is the global
    batch): the strategy's ``num_microbatches`` at p > 1; at p = 1 they are Lightning's
    accumulation, ``accumulate_grad_batches`` beside it (the strategy's is then 1). A mixture
    of experts' layouts differ by ``expert_parallel_size`` and ``expert_tensor_parallel_size``
    too (1 for a dense model)."""
    lay = candidate.layout
    out = {
        "tensor_parallel_size": lay.tensor_parallel_size,
        "pipeline_parallel_size": lay.pipeline_parallel_size,
        "virtual_pipeline_size": lay.virtual_pipeline_size,
        "context_parallel_size": candidate.context_parallel_size,
        "data_parallel_size": lay.data_parallel_size,
        "micro_batch_size": lay.micro_batch_size,
        "num_microbatches": lay.microbatches_per_step,
        "accumulate_grad_batches": lay.accumulate_grad_batches,
        "distributed_optimizer": lay.distributed_optimizer,
        "expert_parallel_size": lay.expert_parallel_size,
        "expert_tensor_parallel_size": lay.expert_tensor_parallel_size,
    }
    return out | to_json(candidate.row)


def _model_state_line(result: Estimate) -> str:
    """Model-state bytes per rank: the paper's replicated Adam (18 B per parameter) beside
    the distributed optimizer's ``2 + 4 + 12/d``; the one the run uses is marked."""
    layout = result.layout
    n, d = result.parameters_per_rank, layout.data_parallel_size * layout.context_parallel_size
    zero = model_state_bytes(n, MIXED_PRECISION_ADAM, d, distributed_optimizer=True)
    used = "distributed optimizer" if result.layout.distributed_optimizer else "replicated"
    return (
        f"model state per rank: {n / 1e9:.3f}B parameters x "
        f"{MIXED_PRECISION_ADAM.bytes_per_parameter:g} B (bf16 weight 2 + fp32 grad 4 + "
        f"fp32 master 4 + Adam m,v 8) = {gigabytes(model_state_bytes(n))} replicated (paper); "
        f"distributed optimizer over d·c={d}: 2 + 4 + 12/{d} = {6 + 12 / d:g} B = "
        f"{gigabytes(zero)}; this run: {used}"
    )


def _active_parameters(result: Estimate) -> str:
    """`` (12.9B active per token)`` for a model whose tokens use fewer parameters than it has
    (a mixture of experts: :func:`~lightning_sp.memory.model_state.model_active_parameter_count`),
    else nothing."""
    active = model_active_parameter_count(result.layout.config)
    if active >= result.model_parameters:
        return ""
    return f" in all, {active / 1e9:.1f}B active per token"


def _fp8_line(result: Estimate) -> list[str]:
    """With ``fp8``: what the rows price in float8 (:mod:`lightning_sp.planner.fp8`)."""
    recipe = fp8_recipe(result.layout.config)
    if recipe is None:
        return []
    kept = "float8 (1 byte + a 4-byte scale)" if KEEPS_FLOAT8_INPUT[recipe] else "as bf16"
    peak = result.fp8_peak_flops or 0.0
    return [
        f"FP8 {recipe}: the layers' linear GEMMs at {peak / 1e12:.0f} TFLOP/s dense FP8 peak "
        "x the BF16 best-shape fraction, plus their operands' casts (5 B/element); the "
        f"attention core, the router and the head in BF16; the linears' saved inputs in {kept}"
    ]


def format_table(result: Estimate) -> str:
    """The human-readable report: the layout, the rows, Figure 7 and the verdict."""
    layout, cfg = result.layout, result.layout.config
    t, p, m = (
        layout.tensor_parallel_size,
        layout.pipeline_parallel_size,
        layout.virtual_pipeline_size,
    )
    n, c = layout.num_microbatches, layout.context_parallel_size
    lif = layers_in_flight(cfg.num_layers, p, m, n)
    mb = 1e6
    lines = [
        f"{layout.source}: GPT {result.model_parameters / 1e9:.1f}B parameters"
        + _active_parameters(result)
        + " "
        f"(s={cfg.seq_length} h={cfg.hidden_size} a={cfg.num_heads} L={cfg.num_layers} "
        f"v={cfg.vocab_size}, padded {cfg.padded_vocab_size(t)}), "
        f"dropout {cfg.hidden_dropout}/{cfg.attention_dropout}",
        f"layout: t={t} p={p} m={m}"
        + (f" c={c}" if c > 1 else "")
        + f" d={layout.data_parallel_size} on {layout.world_size} GPUs; "
        f"micro-batch b={layout.micro_batch_size} x {n} micro-batches"
        + (
            f" x {layout.accumulate_grad_batches} accumulated (trainer.accumulate_grad_batches; "
            "one gradient reduction per step)"
            if layout.accumulate_grad_batches > 1
            else ""
        )
        + f" (global batch {layout.global_batch_size})",
        f"first stage: {cfg.num_layers // p} layers ({m} chunk(s) of {layout.layers_per_chunk}), "
        f"holds {lif:g} layers' worth = L x {lif / cfg.num_layers:.4f}"
        + (" (1 + (p-1)/(p*m))" if m > 1 else " (eq. 5)"),
        _model_state_line(result),
        *_fp8_line(result),
    ]
    if result.measurements:
        any_m = next(iter(result.measurements.values()))
        lines.append(
            f"measured: {len(any_m.per_layer_bytes)} layer(s) of rank 0's shard per row under "
            f"FakeTensorMode + a fake {layout.world_size}-rank process group, "
            f"{result.seconds:.1f} s"
        )
    else:
        lines.append("not measured: formulas only")
    columns = (  # title, unit, width
        ("SP", "", -4), ("recompute", "", -24), ("per layer", "(MB)", 10),
        ("formula", "(MB)", 10), ("diff", "", 8), ("1st stage act", "(GB)", 13),
        ("model state", "(GB)", 11), ("total", "(GB)", 8), ("device", "(GB)", 8), ("fits", "", -4),
        ("step", "(s)", 8), ("tokens/s", "", 9), ("TFLOP/s", "/GPU", 7), ("MFU", "", 6),
        ("HFU", "", 6), ("TFLOP/s", "½causal", 8), ("MFU", "½causal", 8),
    )  # fmt: skip

    def render(cells: Sequence[str]) -> str:
        return " ".join(
            f"{c:<{-w}}" if w < 0 else f"{c:>{w}}"
            for c, (_, _, w) in zip(cells, columns, strict=True)
        ).rstrip()

    lines += ["", render([c[0] for c in columns]), render([c[1] for c in columns])]
    for r in result.rows:
        policy = r.recompute
        if r.recompute_num_layers is not None:
            k, rest = r.recompute_num_layers, r.recompute_rest
            policy = f"{policy} {k}/{layout.layers_per_chunk} + {rest}"
        lines.append(
            render(
                [
                    "on" if r.sequence_parallel else "off",
                    policy + (" *" if r.selected else ""),
                    f"{r.activation_bytes_per_layer / mb:.2f}",
                    f"{r.formula_bytes_per_layer / mb:.2f}",
                    f"{r.activation_bytes_per_layer / r.formula_bytes_per_layer - 1:+.3%}",
                    f"{r.first_stage_activation_bytes / 1e9:.2f}",
                    f"{r.model_state_bytes / 1e9:.2f}",
                    f"{r.total_bytes / 1e9:.2f}",
                    f"{r.device_bytes / 1e9:.2f}",
                    "yes" if r.fits else "no",
                    f"{r.iteration_seconds:.3f}",
                    f"{r.tokens_per_second:.0f}",
                    f"{r.model_tflops_per_gpu:.1f}",
                    f"{r.mfu:.1%}",
                    f"{r.hfu:.1%}",
                    f"{r.model_tflops_per_gpu_causal_half:.1f}",
                    f"{r.mfu_causal_half:.1%}",
                ]
            )
        )
    lines.append(
        "(* the configured combination, or auto's choice; MB = 10^6 B, GB = 10^9 B; step: "
        f"predicted iteration on {result.cluster}, MFU/HFU of its dense BF16 peak; TFLOP/s, "
        "MFU and HFU count attention whole (the paper, torchtitan, Megatron-Core until 2025), "
        "the ½causal pair counts causal attention's cores at half (Megatron-LM since 2025, "
        "MaxText))"
    )
    lines += no_gain_notes(result)
    try:
        measured, formula = result.figure7(True), result.figure7(False)
    except KeyError:
        pass
    else:
        names = {
            "tensor_sequence_parallel": "SP",
            "tensor_parallel_selective": "selective",
            "tensor_sequence_parallel_selective": "SP+selective",
            "full_recompute": "full",
        }
        lines.append(
            "Figure 7, % of the TP-only baseline per layer (measured / formula): "
            + ", ".join(f"{names[k]} {measured[k]:.2f} / {formula[k]:.2f}" for k in FIGURE7_ROWS)
        )
    sp_sel = next(
        (r for r in result.rows if r.sequence_parallel and r.recompute == "selective"), None
    )
    if sp_sel is not None:
        paper = 34 * cfg.seq_length * layout.micro_batch_size * cfg.hidden_size / (t * c)
        how = "measured" if result.measurements else "by formula"
        unit = "34sbh/t" if c == 1 else "34sbh/(t*c)"
        lines.append(
            f"SP + selective per layer: {sp_sel.activation_bytes_per_layer:,} B {how} vs "
            f"{unit} = {paper:,.0f} B ({sp_sel.activation_bytes_per_layer / paper - 1:+.4%})"
        )
    unsplit = bool(cfg.sequence_parallel) and not layout.splits_sequence()
    if unsplit:
        need = math.lcm(2 * c, c * t)
        lines.append(
            f"sequence parallelism does not split the sequence here: each rank's s/c = "
            f"{cfg.seq_length // c} tokens are not divisible by t={t}, so the configured layout "
            f"is shown SP off (*); fit refuses SP on: model.config.seq_length must be a "
            f"multiple of {need} (e.g. {cfg.seq_length // need * need or need} or "
            f"{(cfg.seq_length // need + 1) * need}), or set sequence_parallel: false"
        )
    if result.choice is not None:
        lines.append(result.choice.describe())
    else:
        selected = next((r for r in result.rows if r.selected), None)
        if selected is not None:
            lines.append(
                f"configured: {selected.label}"
                + (" (SP does not split the sequence)" if unsplit else "")
                + f": {gigabytes(selected.total_bytes)} of "
                f"{gigabytes(selected.device_bytes)}, {'fits' if selected.fits else 'does NOT fit'}"
            )
    return "\n".join(lines)


def check_plot_path(path: str) -> None:
    """:class:`ConfigError` (one line naming ``--plot``, the value and what is valid) unless
    ``path`` names a file, not a directory, in an existing writable directory, with an
    extension matplotlib writes: checked before the estimate runs."""
    from matplotlib.backend_bases import FigureCanvasBase

    formats = sorted(FigureCanvasBase.get_supported_filetypes())
    if os.path.isdir(path):
        raise ConfigError(
            f"--plot={path!r} is a directory; give a file name in it, e.g. "
            f"{os.path.join(path, 'memory.png')!r}"
        )
    directory = os.path.dirname(path) or "."
    if not os.path.isdir(directory):
        raise ConfigError(f"--plot={path!r}: directory {directory!r} does not exist")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ConfigError(f"--plot={path!r}: directory {directory!r} is not writable")
    extension = os.path.splitext(path)[1].lstrip(".").lower()
    if extension not in formats:
        raise ConfigError(
            f"--plot={path!r}: unknown image format {extension or '(no extension)'!r}; end "
            f"the name in one of .{', .'.join(formats)}"
        )


def plot_ladder(result: Estimate, path: str) -> None:
    """Draw the memory ladder: left, per-layer activations as a percentage of the TP-only
    baseline (the paper's Figure 7), measured bars with formula markers; right, each row's
    model state + first-stage activations against the device memory."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layout = result.layout
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    short = {
        "tensor_parallel": "TP baseline",
        "tensor_sequence_parallel": "SP",
        "tensor_parallel_selective": "selective",
        "tensor_sequence_parallel_selective": "SP+selective",
        "full_recompute": "full",
    }
    colors = dict(zip(short, ["#888", "#4c72b0", "#dd8452", "#55a868", "#c44e52"], strict=True))
    base_row = result.row(False, "none")
    labels, values, formulas, bar_colors = [], [], [], []
    for name, label in short.items():
        try:
            row = result.row(*TABLE2_SETTINGS[name])
        except KeyError:  # sequence parallelism impossible for this s and t
            continue
        labels.append(label)
        bar_colors.append(colors[name])
        values.append(100 * row.activation_bytes_per_layer / base_row.activation_bytes_per_layer)
        formulas.append(100 * row.formula_bytes_per_layer / base_row.formula_bytes_per_layer)
    bars = left.bar(labels, values, color=bar_colors)
    left.scatter(
        labels, formulas, marker="_", s=900, color="k", label="formula (Table 2)", zorder=3
    )
    for bar, value in zip(bars, values, strict=True):
        left.annotate(f"{value:.1f}%", (bar.get_x() + bar.get_width() / 2, value),
                      ha="center", va="bottom", fontsize=9)  # fmt: skip
    left.set_ylabel("activation memory per layer, % of TP baseline")
    how = "measured" if result.measurements else "formula"
    left.set_title(f"Per-layer activations (t={layout.tensor_parallel_size}), {how}")
    left.set_ylim(0, 115)
    left.legend(loc="upper right")
    row_labels = [
        f"{'SP' if r.sequence_parallel else 'TP'}\n"
        + (
            r.recompute
            if r.recompute_num_layers is None
            else f"{r.recompute} {r.recompute_num_layers}/chunk + {r.recompute_rest}"
        )
        for r in result.rows
    ]
    state = [r.model_state_bytes / 1e9 for r in result.rows]
    acts = [r.first_stage_activation_bytes / 1e9 for r in result.rows]
    right.bar(row_labels, state, label="params + grads + Adam", color="#8172b3")
    right.bar(row_labels, acts, bottom=state, label="first-stage activations", color="#64b5cd",
              hatch=[("//" if r.selected else "") for r in result.rows])  # fmt: skip
    right.axhline(result.device_bytes / 1e9, color="r", ls="--", label="device memory")
    right.set_ylabel("GB per GPU")
    right.set_title(f"{os.path.basename(layout.source)}: memory of the most loaded rank")
    right.tick_params(axis="x", labelsize=8)
    right.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
