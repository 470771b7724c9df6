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
  :class:`lightning_sp.memory.formulas.ModelStatePrecision`).

``total = model state + first-stage activations``; it leaves out the CUDA context, library
workspaces, allocator fragmentation and transient buffers (all-gathered inputs, gradients in
flight), so give it the memory you can actually allocate.

``recompute: auto`` picks the least recomputation that fits: each policy of :data:`LADDER`
but the last in turn, else the last (``full``) on just enough layers of each model chunk (the
others on the policy below it that stores least, ``lean``, so that the fewest layers need
full recomputation), else the last on every layer. The records
(:class:`Estimate`, its rows, :class:`RecomputeChoice`, :data:`LADDER`) are in
:mod:`lightning_sp.planner.records`.
"""

from __future__ import annotations

import dataclasses
import time

from lightning_sp.memory.fake import ActivationMeasurement, measure_activations
from lightning_sp.memory.formulas import (
    MIXED_PRECISION_ADAM,
    ModelStatePrecision,
    activation_bytes_per_layer,
    chunk_forwards_in_flight,
    embedding_activation_bytes,
    model_parameter_count,
    model_state_bytes,
    output_activation_bytes,
    parameters_per_rank,
)
from lightning_sp.model.config import GPTConfig
from lightning_sp.model.recompute import AUTO, policy_name
from lightning_sp.model.shape import ActivationShape
from lightning_sp.parallel.config import ParallelConfig
from lightning_sp.planner.layout import DEFAULT_DEVICE_BYTES, Layout
from lightning_sp.planner.records import (
    COMBINATIONS,
    LADDER,
    Activations,
    Estimate,
    EstimateRow,
    RecomputeChoice,
)

# -- the estimate ------------------------------------------------------------------------------


def formula_activations(layout: Layout, config: GPTConfig) -> Activations:
    """The paper's bytes (Table 2 generalised, §4.5) for ``config`` laid out as ``layout``."""
    t = layout.tensor_parallel_size
    shape = ActivationShape.from_config(config, t, layout.micro_batch_size)
    return Activations(
        per_layer=activation_bytes_per_layer(shape, config.recompute),
        embedding=embedding_activation_bytes(shape),
        head=output_activation_bytes(shape, config.padded_vocab_size(t)),
    )


def _measure(layout: Layout, config: GPTConfig, layers: int) -> ActivationMeasurement:
    return measure_activations(
        config,
        tensor_parallel_size=layout.tensor_parallel_size,
        pipeline_parallel_size=layout.pipeline_parallel_size,
        data_parallel_size=layout.data_parallel_size,
        micro_batch_size=layout.micro_batch_size,
        layers=min(layers, config.num_layers),
        head=layout.pipeline_parallel_size == 1,
    )


def first_stage_bytes(layout: Layout, layer_bytes: list[float], acts: Activations) -> float:
    """Activation bytes of the first stage: ``layer_bytes`` (one model chunk's layers, in
    order) × the chunk forwards in flight (= per layer × eq. 5 × interleaving), the embedding
    per micro-batch in flight (§4.5), and the head if the first stage is also the last."""
    p, n = layout.pipeline_parallel_size, layout.num_microbatches
    in_flight = chunk_forwards_in_flight(p, layout.virtual_pipeline_size, n)
    total = sum(layer_bytes) * in_flight + acts.embedding * min(p, n)
    return total + (acts.head if p == 1 else 0.0)


def _row(
    layout: Layout,
    sequence_parallel: bool,
    recompute: str,
    by_policy: dict[str, tuple[Activations, Activations]],
    state_bytes: int,
    device_bytes: int,
    recompute_num_layers: int | None = None,
    recompute_rest: str | None = None,
) -> EstimateRow:
    """One row from ``by_policy[policy] = (got, formula)`` activations of this SP setting; the
    layers of a chunk run what :meth:`GPTConfig.layer_recompute` says they run (with
    ``recompute_num_layers``, the others run ``recompute_rest``; ``None``: as configured)."""
    config = layout.with_policy(sequence_parallel, recompute, recompute_num_layers, recompute_rest)
    policies = [config.layer_recompute(i) for i in range(layout.layers_per_chunk)]
    sums = []
    for which in (0, 1):  # got (measured, or the formula when not measured), formula
        layers = [by_policy[policy][which].per_layer for policy in policies]
        first = first_stage_bytes(layout, layers, by_policy[recompute][which])
        sums.append((sum(layers) / len(layers), first))
    (got, got_first), (formula, formula_first) = sums
    return EstimateRow(
        sequence_parallel=sequence_parallel,
        recompute=recompute,
        activation_bytes_per_layer=round(got),
        formula_bytes_per_layer=round(formula),
        first_stage_activation_bytes=round(got_first),
        formula_first_stage_activation_bytes=round(formula_first),
        model_state_bytes=state_bytes,
        total_bytes=round(got_first) + state_bytes,
        device_bytes=device_bytes,
        recompute_num_layers=recompute_num_layers,
        recompute_rest=None if recompute_num_layers is None else policies[-1],
    )


def estimate(
    layout: Layout,
    device_bytes: float = DEFAULT_DEVICE_BYTES,
    *,
    layers: int = 1,
    measure: bool = True,
    precision: ModelStatePrecision = MIXED_PRECISION_ADAM,
) -> Estimate:
    """Per-rank memory for each of :data:`COMBINATIONS` of ``layout``, and the resolution of
    ``recompute: auto`` if ``layout`` has it.

    ``measure``: trace ``layers`` layers of rank 0's shard under fake tensors (needs
    ``torch.distributed`` uninitialised in this process); otherwise the formulas only.
    Combinations that cannot run (sequence parallelism with ``s`` not divisible by t) are
    left out.
    """
    layout.validate()
    cfg, t = layout.config, layout.tensor_parallel_size
    n_params = parameters_per_rank(cfg, t, layout.pipeline_parallel_size)
    state_bytes = round(
        model_state_bytes(
            n_params, precision, layout.data_parallel_size, layout.distributed_optimizer
        )
    )
    device = round(device_bytes)
    start = time.perf_counter()
    measurements: dict[tuple[bool, str], ActivationMeasurement] = {}
    acts: dict[bool, dict[str, tuple[Activations, Activations]]] = {False: {}, True: {}}
    for sp, rc in _combinations(layout):
        if sp and cfg.seq_length % t:
            continue
        combo = layout.with_policy(sp, rc)
        formula = formula_activations(layout, combo)
        got = formula
        if measure:
            m = measurements[(sp, rc)] = _measure(layout, combo, layers)
            got = Activations(m.bytes_per_layer, m.embedding_bytes, m.head_bytes or 0)
        acts[sp][rc] = (got, formula)
    rows = [_row(layout, sp, rc, acts[sp], state_bytes, device) for sp in acts for rc in acts[sp]]
    k, sp = _configured_split(layout), layout.config.sequence_parallel
    if k is not None and policy_name(cfg.recompute) in acts[sp]:
        rows.append(_row(layout, sp, policy_name(cfg.recompute), acts[sp], state_bytes, device, k))
    result = Estimate(
        layout=layout,
        device_bytes=device,
        rows=rows,
        measurements=measurements,
        parameters_per_rank=n_params,
        model_parameters=model_parameter_count(cfg),
        seconds=time.perf_counter() - start,
    )
    if layout.recompute == "auto":
        result.choice = _choose(result, acts[layout.config.sequence_parallel], state_bytes)
    _mark_selected(result)
    return result


def _choose(
    result: Estimate, by_policy: dict[str, tuple[Activations, Activations]], state_bytes: int
) -> RecomputeChoice:
    """The least recomputation that fits, for the layout's sequence-parallel setting; a row for
    a partial choice of the last policy is appended to ``result.rows``."""
    layout, sp, measured = (
        result.layout,
        result.layout.config.sequence_parallel,
        bool(result.measurements),
    )
    previous: int | None = None
    rest = LADDER[0]  # the last rung that stored less than the one before it
    for policy in LADDER[:-1]:
        row = result.row(sp, policy)
        if previous is not None and row.formula_bytes_per_layer >= previous:
            continue  # recomputes for no gain (selective under sdpa)
        previous, rest = row.formula_bytes_per_layer, policy
        if row.fits:
            return RecomputeChoice(policy, None, row.total_bytes, result.device_bytes, measured)
    last = LADDER[-1]
    for k in range(1, layout.layers_per_chunk):
        row = _row(layout, sp, last, by_policy, state_bytes, result.device_bytes, k, rest)
        if row.fits:
            result.rows.append(row)
            return RecomputeChoice(
                last, k, row.total_bytes, result.device_bytes, measured, recompute_rest=rest
            )
    everything = result.row(sp, last)
    return RecomputeChoice(last, None, everything.total_bytes, result.device_bytes, measured)


def _combinations(layout: Layout) -> tuple[tuple[bool, str], ...]:
    """:data:`COMBINATIONS`, plus the configured module set if it is no named policy (that of
    the layers beyond ``recompute_num_layers`` included)."""
    if layout.recompute == AUTO:
        return COMBINATIONS
    config = layout.config
    names = {config.layer_recompute(i) for i in range(layout.layers_per_chunk)}
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
                "it buys nothing, so the model does not recompute and auto skips it"
            )
    return notes


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
        key = (
            layout.config.sequence_parallel,
            policy_name(layout.recompute),
            _configured_split(layout),
        )
    else:
        key = (layout.config.sequence_parallel, choice.recompute, choice.recompute_num_layers)
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
) -> RecomputeChoice:
    """Resolve ``recompute: auto`` for a running layout (``parallel``; default: one process):
    the least recomputation with which the most loaded rank's model state + first-stage
    activations fit ``device_bytes`` (see :func:`estimate`; ``fits`` is False when even full
    recompute of every layer does not).

    ``config.recompute`` is ignored. ``parallel.sequence_parallel`` must agree with
    ``config.sequence_parallel`` (``None``: the config's). ``measure``: trace under fake
    tensors (``None``: when ``torch.distributed`` is not yet initialised in this process,
    since the fake world cannot coexist with a real one; otherwise the formulas, which the
    measurement matches within 0.01%). Deterministic, so every rank resolves the same choice.
    """
    import torch.distributed as dist

    if measure is None:
        measure = not (dist.is_available() and dist.is_initialized())
    layout = Layout(
        **dataclasses.asdict(parallel or ParallelConfig()),
        config=dataclasses.replace(config, recompute="auto", recompute_num_layers=None),
        micro_batch_size=micro_batch_size,
        source="the running layout",
    )
    choice = estimate(layout, device_bytes, layers=layers, measure=measure).choice
    assert choice is not None
    return choice
