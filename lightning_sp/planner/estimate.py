"""The memory estimate of one :class:`~lightning_sp.planner.layout.Layout`: pure, no I/O.

For each ``(sequence_parallel, recompute)`` combination it takes the activation bytes of one
micro-batch on rank 0 — measured on one rank's shard of the real model under fake tensors and
a fake process group of the full world size (:func:`lightning_sp.memory.fake.
measure_activations`), and by the paper's formulas — and sets them against the device memory:

* per transformer layer;
* the first pipeline stage's activations: per layer × the layers in flight (eq. 5, ×
  ``1 + (p-1)/(p·m)`` interleaved) + the §4.5 extras (embedding dropout masks; with ``p = 1``
  also the final LayerNorm, output layer and loss);
* parameters + gradients + optimizer state per rank (18 bytes per parameter, see
  :class:`lightning_sp.memory.model_state.ModelStatePrecision`).

Context parallelism (``layout.context_parallel_size = c``): the activations are those of the
rank's ``s/c`` tokens (the formulas divide every term by ``c`` and drop the core's ``s x s``
scores and logsumexp, which the CP core does not keep; the fake trace runs CP rank 0's shard
with its CP core). CP shards no parameter; the distributed optimizer shards its state over
the ``d·c`` ranks of dp x cp (:func:`~lightning_sp.planner.rows.optimizer_shards`).

``total = model state + first-stage activations``; it leaves out the CUDA context, library
workspaces, allocator fragmentation and transient buffers (all-gathered inputs, gradients in
flight), so give it the memory you can actually allocate.

Each row also carries the predicted iteration time, throughput, MFU and HFU on a
:class:`~lightning_sp.planner.cluster.Cluster` (:mod:`lightning_sp.planner.steptime`).

``recompute: auto`` picks the fastest recomputation that fits: among the policies of
:data:`LADDER` and, for each policy below ``full``, ``full`` on just enough layers of each
model chunk with that policy on the others, the one with the shortest predicted iteration
whose memory fits (on a tie, the earlier: less recomputation); if none fits, ``full`` on every
layer. The records
(:class:`Estimate`, its rows, :class:`RecomputeChoice`, :data:`LADDER`) are in
:mod:`lightning_sp.planner.records`.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from lightning_sp.memory.fake import ActivationMeasurement
from lightning_sp.memory.model_state import (
    MIXED_PRECISION_ADAM,
    ModelStatePrecision,
    expert_parameters_per_rank,
    model_parameter_count,
    model_state_bytes,
    parameters_per_rank,
)
from lightning_sp.model.config import GPTConfig
from lightning_sp.model.fp8 import fp8_recipe
from lightning_sp.model.recompute import AUTO, RecomputePolicy, policy_name
from lightning_sp.parallel.config import ParallelConfig
from lightning_sp.planner.cluster import Cluster
from lightning_sp.planner.fp8 import check_fp8_cluster
from lightning_sp.planner.layout import DEFAULT_DEVICE_BYTES, Layout, runs
from lightning_sp.planner.presets import load_cluster
from lightning_sp.planner.records import (
    COMBINATIONS,
    LADDER,
    Activations,
    Estimate,
    RecomputeChoice,
)
from lightning_sp.planner.rows import (
    document_mask_bytes_per_layer,
    estimate_row,
    formula_activations,
    measure_combination,
    optimizer_shards,
)

# -- the estimate ------------------------------------------------------------------------------


def estimate(
    layout: Layout,
    device_bytes: float = DEFAULT_DEVICE_BYTES,
    *,
    layers: int = 1,
    measure: bool = True,
    precision: ModelStatePrecision = MIXED_PRECISION_ADAM,
    cluster: Cluster | str | None = None,
) -> Estimate:
    """Per-rank memory and predicted step time on ``cluster`` (default: the paper's A100
    cluster) for each of :data:`COMBINATIONS` of ``layout``, and the resolution of
    ``recompute: auto`` if ``layout`` has it.

    ``measure``: trace ``layers`` layers of rank 0's shard under fake tensors (needs
    ``torch.distributed`` uninitialised in this process); otherwise the formulas only.
    Combinations that cannot run (sequence parallelism with ``s/c`` not divisible by t) are
    left out.
    """
    layout.validate()
    hardware = load_cluster(cluster)
    cfg, t = layout.config, layout.tensor_parallel_size
    check_fp8_cluster(hardware, fp8_recipe(cfg))  # before any work
    e = layout.expert_parallel_size
    n_params = parameters_per_rank(cfg, layout)
    experts = expert_parameters_per_rank(cfg, layout)  # sharded over d·c/e, the rest d·c
    shards, zero = optimizer_shards(layout), layout.distributed_optimizer
    state_bytes = round(
        model_state_bytes(n_params - experts, precision, shards, zero)
        + model_state_bytes(experts, precision, shards // e, zero)
    )
    device = round(device_bytes)
    start = time.perf_counter()
    measurements: dict[tuple[bool, str], ActivationMeasurement] = {}
    acts: dict[bool, dict[str, tuple[Activations, Activations]]] = {False: {}, True: {}}
    local = cfg.seq_length // layout.context_parallel_size  # each rank's tokens per sequence
    for sp, rc in _combinations(layout):
        if sp and local % t:
            continue
        combo = layout.with_policy(sp, rc)
        if not runs(combo, layout):  # a combination the model cannot run (MoE at t > 1, no SP)
            continue
        formula = formula_activations(layout, combo)
        got = formula
        if measure:
            m = measurements[(sp, rc)] = measure_combination(layout, combo, layers)
            got = Activations(
                m.bytes_per_layer + document_mask_bytes_per_layer(layout, combo),
                m.embedding_bytes,
                m.head_bytes or 0,
                formula.ids,
                formula.tables,
            )
        acts[sp][rc] = (got, formula)
    rows = [
        estimate_row(layout, sp, rc, acts[sp], state_bytes, device, hardware)
        for sp in acts
        for rc in acts[sp]
    ]
    k, sp = _configured_split(layout), configured_sp(layout)
    if k is not None and policy_name(cfg.recompute) in acts[sp]:
        policy = policy_name(cfg.recompute)
        rows.append(estimate_row(layout, sp, policy, acts[sp], state_bytes, device, hardware, k))
    result = Estimate(
        layout=layout,
        device_bytes=device,
        rows=rows,
        measurements=measurements,
        parameters_per_rank=n_params,
        model_parameters=model_parameter_count(cfg),
        seconds=time.perf_counter() - start,
        cluster=hardware.name,
        fp8_peak_flops=hardware.fp8_peak_flops,
    )
    if layout.recompute.auto:
        result.choice = _choose(result, acts[configured_sp(layout)], state_bytes, hardware)
    _mark_selected(result)
    return result


def _choose(
    result: Estimate,
    by_policy: dict[str, tuple[Activations, Activations]],
    state_bytes: int,
    cluster: Cluster,
) -> RecomputeChoice:
    """The fastest recomputation that fits, for the model's sequence-parallel setting: each
    policy of :data:`LADDER`, and for each policy below ``full`` the split with ``full`` on
    the fewest layers of a chunk that fits; the row of a chosen split is appended to
    ``result.rows``. Nothing fits: ``full`` on every layer."""
    layout, sp, measured = result.layout, configured_sp(result.layout), bool(result.measurements)
    device, last = result.device_bytes, LADDER[-1]
    candidates = [result.row(sp, policy) for policy in LADDER]
    for rest in LADDER[:-1]:
        for k in range(1, layout.layers_per_chunk):
            row = estimate_row(layout, sp, last, by_policy, state_bytes, device, cluster, k, rest)
            if row.fits:
                candidates.append(row)
                break
    fitting = [row for row in candidates if row.fits]
    best = min(fitting, key=lambda r: r.iteration_seconds) if fitting else result.row(sp, last)
    if best.recompute_num_layers is not None:
        result.rows.append(best)
    return RecomputeChoice(
        best.recompute,
        best.recompute_num_layers,
        best.total_bytes,
        device,
        measured,
        recompute_rest=best.recompute_rest,
        iteration_seconds=best.iteration_seconds,
    )


def _combinations(layout: Layout) -> tuple[tuple[bool, str], ...]:
    """:data:`COMBINATIONS`, plus the configured module set if it is no named policy (that of
    the layers beyond ``recompute_num_layers`` included)."""
    if layout.recompute.auto:
        return COMBINATIONS
    config = layout.config
    names = {config.layer_recompute(i).name for i in range(layout.layers_per_chunk)}
    extra = sorted(names - set(LADDER))
    return (*COMBINATIONS, *((sp, name) for sp in (False, True) for name in extra))


def no_gain_notes(result: Estimate) -> list[str]:
    """A line for each sequence-parallel setting where ``selective`` stores no less than
    ``none`` (``attention: sdpa`` keeps no s x s tensor): it would recompute for no gain."""
    notes = []
    for sp in (False, True):
        try:
            none, selective = result.row(sp, "none"), result.row(sp, "selective")
        except KeyError:
            continue
        if selective.formula_bytes_per_layer >= none.formula_bytes_per_layer:
            notes.append(
                f"SP {'on' if sp else 'off'}: selective (core_attn) stores what none stores "
                f"with attention={result.layout.config.attention} (no s x s tensor to drop): "
                "it buys nothing, so the model does not recompute and auto prefers none"
            )
    return notes


def configured_sp(layout: Layout) -> bool:
    """The sequence-parallel setting of the configured rows: the model config's, except that
    where SP cannot split each rank's ``s/c`` tokens over t (``fit`` refuses that layout:
    :meth:`Layout.splits_sequence`) the configured layout is shown without SP, marked so
    by the report."""
    return bool(layout.config.sequence_parallel) and layout.splits_sequence()


def _configured_split(layout: Layout) -> int | None:
    """The configured ``recompute_num_layers`` if it splits a chunk's layers between two
    policies, else ``None``."""
    config, k = layout.config, layout.config.recompute_num_layers
    if k is None or not 0 < k < layout.layers_per_chunk:
        return None
    return k if config.layer_recompute(k) != config.layer_recompute(0) else None


def _mark_selected(result: Estimate) -> None:
    layout, choice = result.layout, result.choice
    if choice is None:
        key = (configured_sp(layout), policy_name(layout.recompute), _configured_split(layout))
    else:
        key = (configured_sp(layout), choice.recompute, choice.recompute_num_layers)
    for row in result.rows:
        row.selected = (row.sequence_parallel, row.recompute, row.recompute_num_layers) == key


def resolve_recompute(
    config: GPTConfig,
    parallel: ParallelConfig | None = None,
    *,
    micro_batch_size: int = 1,
    device_bytes: float = DEFAULT_DEVICE_BYTES,
    layers: int = 1,
    measure: bool | None = None,
    cluster: Cluster | str | None = None,
) -> RecomputeChoice:
    """Resolve ``recompute: auto`` for a running layout (``parallel``; default: one process):
    the recomputation with the shortest predicted iteration on ``cluster`` (default: the A100
    preset; the ranking of policies hardly depends on it) with which the most loaded rank's
    model state + first-stage activations fit ``device_bytes`` (see :func:`estimate`;
    ``fits`` is False when even full recompute of every layer does not).

    ``config.recompute`` is ignored; sequence parallelism is ``config.sequence_parallel``
    (the one place it is set). ``measure``: trace under fake
    tensors (``None``: when ``torch.distributed`` is not yet initialised in this process,
    since the fake world cannot coexist with a real one; otherwise the formulas, which the
    measurement matches within 0.01%). Deterministic, so every rank resolves the same choice.
    """
    import torch.distributed as dist

    if measure is None:
        measure = not (dist.is_available() and dist.is_initialized())
    layout = Layout(
        **dataclasses.asdict(parallel or ParallelConfig()),
        config=dataclasses.replace(config, recompute=AUTO, recompute_num_layers=None),
        micro_batch_size=micro_batch_size,
        source="the running layout",
    )
    choice = estimate(layout, device_bytes, layers=layers, measure=measure, cluster=cluster).choice
    assert choice is not None
    return choice


def auto_recompute_config(
    config: GPTConfig, parallel: ParallelConfig, micro_batch_size: int, device: torch.device
) -> tuple[GPTConfig, RecomputeChoice]:
    """``config`` with ``recompute: auto`` resolved for a running layout on ``device`` (its
    memory on CUDA, else :data:`DEFAULT_DEVICE_BYTES`), and the choice
    (:func:`resolve_recompute`)."""
    device_bytes = (
        torch.cuda.get_device_properties(device).total_memory
        if device.type == "cuda"
        else DEFAULT_DEVICE_BYTES
    )
    choice = resolve_recompute(
        config, parallel, micro_batch_size=micro_batch_size, device_bytes=device_bytes
    )
    resolved = dataclasses.replace(
        config,
        recompute=RecomputePolicy.parse(choice.recompute),  # a policy of the planner's ladder
        recompute_num_layers=choice.recompute_num_layers,
        recompute_rest=RecomputePolicy.parse(choice.recompute_rest or config.recompute_rest),
    )
    return resolved, choice
