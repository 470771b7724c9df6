"""Published training runs with their layouts stated, and what the planner predicts for each.

Each :class:`PublishedRun` is one measured row of a public source (repository and path, or
the paper): the model, the layout, the hardware (a preset of
:mod:`lightning_sp.planner.presets`), what the run overlapped (an
:class:`~lightning_sp.planner.execution.Execution`, as the source states it) and the
published figure (an iteration time, model TFLOP/s per GPU or MFU, in the source's FLOP
convention). :func:`predict` prices the layout on a preset with the run's execution;
:meth:`PublishedRun.published_seconds` turns the figure into an iteration time with the same
FLOP count, so the two compare directly. ``docs/planner.md`` tables them, and
``tests/test_published.py`` pins every prediction.

``role`` keeps the rows used to fit anything apart from those only checked: ``fit`` rows
took part in fitting a constant of some preset (``selene``'s GEMM efficiency is fitted to
the paper's Table 4, the measured layer of the 22B rows); ``check`` rows took part in none.
No constant of any preset is fitted to a ``check`` row.

Where a source leaves a field unstated, the row says what it assumes (``assumed``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from lightning_sp.memory.flops import (
    causal_half_model_flops_per_iteration,
    model_flops_per_iteration,
)
from lightning_sp.model.config import GPTConfig
from lightning_sp.model.moe.config import MoEConfig
from lightning_sp.model.recompute import NO_RECOMPUTE, RecomputePolicy
from lightning_sp.planner.execution import MEGATRON_CORE_OVERLAPS, Execution
from lightning_sp.planner.layout import Layout
from lightning_sp.planner.presets import PRESETS
from lightning_sp.planner.steptime import StepTime, step_time

MEGATRON_LM_H100 = (
    "NVIDIA/Megatron-LM README.md, 'Performance Benchmarking', table images/model_table.png "
    "(commit f2e5db402c, 2024-07-15, Megatron-Core r0.8.0)"
)
MEGATRON_CORE_MOE = (
    "NVIDIA/Megatron-LM megatron/core/transformer/moe/README.md (commit d392f9cac7, "
    "2024-11-23): 468 TFLOPS (MCore v0.9) and its 'Reference Best Parallel Mapping'; "
    "yanring/Megatron-MoE-ModelZoo runtime_configs/benchmarking/runtime.conf (VPP 8)"
)
PAPER = "Korthikanti et al., MLSys 2023 (arXiv 2205.05198), Tables 3 and 5"

PREVIOUS = {
    "megatron-h100-1.7B": 0.5237,
    "megatron-h100-7.1B": 1.0278,
    "megatron-h100-16B": 1.1861,
    "megatron-h100-32B": 1.2469,
    "megatron-h100-70B": 2.3617,
    "megatron-h100-119B": 3.6841,
    "megatron-h100-177B": 5.1499,
    "megatron-h100-314B": 8.4008,
    "megatron-h100-462B": 12.1753,
    "mcore-mixtral-8x7b": 2.5057,
    "paper-22B-full": 1.3828,
    "paper-22B-sp-selective": 1.0403,
    "paper-175B-full": 18.5222,
    "paper-175B-sp-selective": 13.6699,
    "paper-530B-full": 52.0284,
    "paper-530B-full-d=8": 52.6282,
    "paper-530B-sp-selective": 39.0075,
    "paper-530B-sp-selective-d=8": 39.6488,
    "paper-1T-full": 103.3039,
    "paper-1T-sp-selective": 77.7249,
}
"""Each row's predicted iteration (seconds) before issue 42
(:attr:`PublishedRun.previous_seconds`)."""


@dataclass(frozen=True)
class PublishedRun:
    """One published, measured training run and its stated layout."""

    name: str
    """A short name for tables and test ids."""
    group: str
    """The published table it belongs to."""
    source: str
    """Where it is published (repository + path + commit, or the paper)."""
    preset: str
    """The hardware: a preset of :data:`~lightning_sp.planner.presets.PRESETS`."""
    layout: Layout
    """Model, layout and batch, as the source states them (the model's ``sequence_parallel``
    and ``recompute`` are the row's)."""
    execution: Execution
    """What the run overlapped, as the source states it."""
    role: str
    """``fit`` (a preset constant was fitted to it) or ``check``."""
    seconds: float | None = None
    """The published iteration time, if that is what is published."""
    tflops_per_gpu: float | None = None
    """The published model TFLOP/s per GPU, if that is what is published."""
    mfu: float | None = None
    """The published MFU (of the preset's dense peak), if that is what is published."""
    causal_half: bool = False
    """Whether the source counts causal attention's FLOPs at half (Megatron-LM since 2025,
    MaxText); ``False``: whole, as this project (and Megatron-Core until 2025) counts."""
    assumed: str = ""
    """What the row assumes where the source is silent."""
    previous_seconds: float | None = None
    """The iteration the planner predicted on the row's preset before issue 42 (this
    project's execution, a data-parallel ring through one adapter per node, the cross entropy
    at 32 bytes a logit), for the docs' before / after columns."""

    @property
    def pipelined(self) -> bool:
        return self.layout.pipeline_parallel_size > 1

    @property
    def moe(self) -> bool:
        return self.layout.config.moe is not None

    def model_flops(self) -> float:
        """Model FLOPs of one iteration in the source's convention (this project's count,
        causal attention halved where the source halves it)."""
        config, batch = self.layout.config, self.layout.global_batch_size
        if self.causal_half:
            return causal_half_model_flops_per_iteration(config, batch)
        return model_flops_per_iteration(config, batch)

    def published_seconds(self) -> float:
        """The published figure as an iteration time: the time itself, or the source's
        FLOPs over its TFLOP/s (or MFU x the preset's peak) times the GPUs."""
        if self.seconds is not None:
            return self.seconds
        gpus = self.layout.world_size
        if self.tflops_per_gpu is not None:
            return self.model_flops() / (self.tflops_per_gpu * 1e12 * gpus)
        assert self.mfu is not None, f"{self.name}: no published figure"
        return self.model_flops() / (self.mfu * PRESETS[self.preset].peak_flops * gpus)


def predict(run: PublishedRun, preset: str | None = None) -> StepTime:
    """The predicted iteration of ``run`` on ``preset`` (default the run's) with the run's
    execution."""
    cluster = dataclasses.replace(PRESETS[preset or run.preset], execution=run.execution)
    return step_time(run.layout, cluster, run.layout.config)


def deviation(run: PublishedRun, preset: str | None = None) -> float:
    """Predicted over published iteration time, minus 1 (negative: predicted faster)."""
    return predict(run, preset).iteration_seconds / run.published_seconds() - 1


def _gpt(h: int, a: int, layers: int, t: int, **kw: object) -> GPTConfig:
    """Megatron-LM's GPT of the H100 table: LayerNorm, GeLU MLP of 4h, learned positions,
    vocabulary 131072, s = 4096, untied embeddings (the table's parameter counts are those of
    untied input and output embeddings: 1.7B = 12·L·h² + 2·v·h), flash attention, no
    recomputation, sequence parallelism at t > 1 (``--tp-comm-overlap`` needs it), attention
    and hidden dropout 0.1 (the README sets neither flag: Megatron's defaults at the table's
    commit, as in its GPT example script, ``examples/gpt3/train_gpt3_175b_distributed.sh``)."""
    fields: dict[str, object] = dict(
        vocab_size=131072, seq_length=4096, hidden_size=h, num_layers=layers, num_heads=a,
        tie_embeddings=False, hidden_dropout=0.1, attention_dropout=0.1, attention="sdpa",
        recompute=NO_RECOMPUTE, sequence_parallel=t > 1,
    )  # fmt: skip
    return GPTConfig(**{**fields, **kw})  # type: ignore[arg-type]


def _megatron_h100(
    name: str, h: int, a: int, layers: int, t: int, p: int, tflops: float
) -> PublishedRun:
    """One row of Megatron-LM's H100 weak-scaling table: d = 48, global batch 192·p (the
    table's "Batch size" column: 192 for the four p = 1 rows, then 384, 768, 1152, 1536,
    3072; 4·p sequences per replica), micro-batch 1 (not stated: with it the pipelined rows have
    the 4·p micro-batches their batch implies, and Megatron's GPT example script at that
    commit runs ``--micro-batch-size 1``), the distributed optimizer
    (``--overlap-param-gather`` requires it), gradient reduce, parameter gather and TP
    communication overlapped, as the README states."""
    d, batch = 48, 4 * p  # per replica
    layout = Layout(
        config=_gpt(h, a, layers, t), tensor_parallel_size=t, pipeline_parallel_size=p,
        data_parallel_size=d, micro_batch_size=1, distributed_optimizer=True,
        num_microbatches=batch if p > 1 else 1, accumulate_grad_batches=1 if p > 1 else batch,
        source=f"Megatron-LM H100 {name}",
    )  # fmt: skip
    return PublishedRun(
        name=f"megatron-h100-{name}", group="Megatron-LM H100 weak scaling",
        source=MEGATRON_LM_H100, preset="h100-80gb", layout=layout,
        execution=MEGATRON_CORE_OVERLAPS, role="check", tflops_per_gpu=tflops,
        assumed="micro-batch 1; Megatron's defaults: dropout 0.1, no recomputation",
    )  # fmt: skip


MEGATRON_H100_ROWS = (  # name, h, a, L, t, p, TFLOP/s per GPU (whole attention, Megatron r0.8)
    ("1.7B", 2048, 16, 24, 1, 1, 408.8),
    ("7.1B", 4096, 32, 30, 2, 1, 465.9),
    ("16B", 6144, 48, 32, 4, 1, 489.1),
    ("32B", 7168, 56, 48, 8, 1, 459.6),
    ("70B", 8192, 64, 84, 8, 2, 419.7),
    ("119B", 10240, 80, 92, 8, 4, 420.5),
    ("177B", 12288, 96, 96, 8, 6, 432.8),
    ("314B", 16384, 128, 96, 8, 8, 474.4),
    ("462B", 18432, 144, 112, 8, 16, 459.9),
)
"""The table's rows: model size, hidden size, heads, layers, TP, PP and per-GPU TFLOP/s."""


def _mixtral() -> PublishedRun:
    """Megatron-Core's Mixtral 8x7B: 64 H100s, dropless all-to-all, BF16, s = 4096, TP 1,
    EP 8, PP 4, VP 8 (virtual stages of one layer: the Model Zoo's ``VPP=8`` with
    ``--num-layers-per-virtual-pipeline-stage`` = 32/4/8), MBS 1, GBS 256 (d = 16), no
    recomputation flag, the distributed optimizer with gradient reduce and parameter gather
    overlapped (the README's example script)."""
    config = GPTConfig.of(
        "mistral", vocab_size=32000, seq_length=4096, hidden_size=4096, num_layers=32,
        num_heads=32, num_query_groups=8, rope_theta=1e6, feed_forward="moe",
        moe=MoEConfig(num_experts=8, top_k=2, expert_ffn_size=14336),
        sequence_parallel=False, attention="sdpa", recompute=NO_RECOMPUTE,
    )  # fmt: skip
    layout = Layout(
        config=config, pipeline_parallel_size=4, virtual_pipeline_size=8,
        expert_parallel_size=8, data_parallel_size=16, num_microbatches=16,
        distributed_optimizer=True, source="Megatron-Core Mixtral 8x7B",
    )  # fmt: skip
    return PublishedRun(
        name="mcore-mixtral-8x7b", group="Megatron-Core MoE", source=MEGATRON_CORE_MOE,
        preset="h100-80gb", layout=layout, execution=MEGATRON_CORE_OVERLAPS, role="check",
        tflops_per_gpu=468.0, assumed="balanced routing (the run is dropless, aux loss 1e-2)",
    )  # fmt: skip


PAPER_MODELS = {  # h, a, L, t, p, m, micro-batch, global batch (Table 3; configs/gpt*.yaml)
    "22B": (6144, 64, 48, 8, 1, 1, 4, 4),
    "175B": (12288, 96, 96, 8, 8, 3, 1, 64),
    "530B": (20480, 128, 105, 8, 35, 3, 1, 280),
    "1T": (25600, 160, 128, 8, 64, 1, 1, 512),
}
TABLE5 = {"22B": (1.42, 1.10), "175B": (18.13, 13.75), "530B": (49.05, 37.83), "1T": (94.42, 71.49)}
"""Iteration seconds: full recompute without SP, SP + selective (the paper's Table 5)."""


def _paper(name: str, selective: bool, d: int = 1, mfu: float | None = None) -> PublishedRun:
    """A Table 5 row on Selene (DGX A100): the Table 3 layout, math attention, dropout 0.1,
    the replicated optimizer, nothing overlapped beyond Megatron's backward placement."""
    h, a, layers, t, p, m, b, batch = PAPER_MODELS[name]
    config = GPTConfig(
        vocab_size=51200, seq_length=2048, hidden_size=h, num_layers=layers, num_heads=a,
        attention="math", sequence_parallel=selective,
        recompute=RecomputePolicy.parse("selective" if selective else "full"),
    )  # fmt: skip
    layout = Layout(
        config=config, tensor_parallel_size=t, pipeline_parallel_size=p,
        virtual_pipeline_size=m, num_microbatches=batch // b, micro_batch_size=b,
        data_parallel_size=d, source=f"paper {name}",
    )  # fmt: skip
    tag = "" if d == 1 else f" d={d}"
    table = TABLE5[name][1 if selective else 0]
    return PublishedRun(
        name=f"paper-{name}-{'sp-selective' if selective else 'full'}{tag.replace(' ', '-')}",
        group="paper Table 5" + (f" ({name} on {t * p * d} GPUs)" if d > 1 else ""),
        source=PAPER, preset="selene", layout=layout, execution=Execution(),
        role="fit" if name == "22B" else "check", seconds=None if mfu else table, mfu=mfu,
        assumed="" if name != "22B" else "Table 4, to which selene is fitted, is this layer",
    )  # fmt: skip


def published_runs() -> tuple[PublishedRun, ...]:
    """Every published row, in table order."""
    rows = [_megatron_h100(*row) for row in MEGATRON_H100_ROWS]
    rows.append(_mixtral())
    for name in PAPER_MODELS:
        rows += [_paper(name, selective=False), _paper(name, selective=True)]
    rows += [  # 530B on 2240 GPUs: the paper's MFU, 42.1% full recompute, 54.2% SP + selective
        _paper("530B", selective=False, d=8, mfu=0.421),
        _paper("530B", selective=True, d=8, mfu=0.542),
    ]
    return tuple(dataclasses.replace(r, previous_seconds=PREVIOUS.get(r.name)) for r in rows)


OTHER_PRESET = {"h100-80gb": "h100-realised", "selene": "a100-80gb"}
"""For each row's preset, the other preset of the same hardware shown beside it."""


def _layout_text(layout: Layout) -> str:
    x, parts = layout, []
    for key, value in (
        ("t", x.tensor_parallel_size), ("p", x.pipeline_parallel_size),
        ("m", x.virtual_pipeline_size), ("e", x.expert_parallel_size),
        ("d", x.data_parallel_size), ("b", x.micro_batch_size),
        ("n", x.microbatches_per_step),
    ):  # fmt: skip
        if value > 1 or key in ("t", "p", "d"):
            parts.append(f"{key}={value}")
    return " ".join(parts) + (" SP" if x.config.sequence_parallel else "")


def markdown_table(runs: tuple[PublishedRun, ...] | None = None) -> str:
    """The rows as docs/planner.md tables them: published and predicted iteration, the
    deviation on the row's preset and on the other preset of its hardware, before issue 42,
    and the role."""
    lines = [
        "| row | layout | GPUs | published | preset: predicted (dev.) | other preset (dev.) "
        "| before (dev.) | role |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for run in runs or published_runs():
        published = run.published_seconds()
        own = predict(run).iteration_seconds
        other = OTHER_PRESET[run.preset]
        alt = predict(run, other).iteration_seconds
        before = (
            f"{run.previous_seconds:.3f} s ({run.previous_seconds / published - 1:+.1%})"
            if run.previous_seconds
            else "-"
        )
        figure = (
            f"{run.tflops_per_gpu:g} TFLOP/s = {published:.3f} s"
            if run.tflops_per_gpu
            else f"MFU {run.mfu:.1%} = {published:.2f} s"
            if run.mfu
            else f"{published:.2f} s"
        )
        lines.append(
            f"| {run.name} | {_layout_text(run.layout)} | {run.layout.world_size} | {figure} "
            f"| {run.preset}: {own:.3f} s ({own / published - 1:+.1%}) "
            f"| {other}: {alt:.3f} s ({alt / published - 1:+.1%}) | {before} | {run.role} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":  # python -m lightning_sp.planner.published
    print(markdown_table())
