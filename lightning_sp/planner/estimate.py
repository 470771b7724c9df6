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
others as :meth:`GPTConfig.layer_recompute` says), else the last on every layer.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from lightning_sp.memory.fake import ActivationMeasurement, measure_activations
from lightning_sp.memory.formulas import (
    FIGURE7_ROWS,
    MIXED_PRECISION_ADAM,
    TABLE2_SETTINGS,
    ModelStatePrecision,
    activation_bytes_per_layer,
    chunk_forwards_in_flight,
    embedding_activation_bytes,
    model_parameter_count,
    model_state_bytes,
    output_activation_bytes,
    parameters_per_rank,
)
from lightning_sp.model.config import RECOMPUTE_POLICIES, GPTConfig
from lightning_sp.model.recompute import AUTO, policy_name
from lightning_sp.model.shape import ActivationShape
from lightning_sp.planner.layout import DEFAULT_DEVICE_BYTES, Layout

LADDER: tuple[str, ...] = RECOMPUTE_POLICIES
"""The recompute policies the planner tabulates, least recomputation first: the one place
the planner enumerates them (``auto`` climbs it in this order, skipping a policy that stores no
less than the one before it, such as ``selective`` under ``attention: sdpa``: it would
recompute for no gain)."""

COMBINATIONS: tuple[tuple[bool, str], ...] = tuple(
    (sp, rc) for sp in (False, True) for rc in LADDER
)
"""The ``(sequence_parallel, recompute)`` rows of the estimate."""


def gigabytes(nbytes: float) -> str:
    """``"64.12 GB"`` (10⁹ bytes, as device memory is quoted)."""
    return f"{nbytes / 1e9:.2f} GB"


def _partial(recompute: str, recompute_num_layers: int) -> str:
    """``"full on 2 layer(s) per model chunk, selective on the rest"``: what the model runs
    (:meth:`GPTConfig.layer_recompute`) with ``recompute_num_layers`` set."""
    config = GPTConfig(recompute=recompute, recompute_num_layers=recompute_num_layers)
    rest = config.layer_recompute(recompute_num_layers)
    return f"{recompute} on {recompute_num_layers} layer(s) per model chunk, {rest} on the rest"


# -- records -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Activations:
    """Activation bytes rank 0 saves for one micro-batch, measured or by formula."""

    per_layer: float
    """One transformer layer."""

    embedding: float
    """The input embedding (its dropout mask)."""

    head: float
    """The final LayerNorm, output layer and loss (on the first stage only when ``p = 1``)."""


@dataclass
class EstimateRow:
    """One ``(sequence_parallel, recompute)`` row of the estimate; bytes per rank."""

    sequence_parallel: bool
    """Sequence parallelism on."""

    recompute: str
    """The recompute policy."""

    activation_bytes_per_layer: int
    """Measured under fake tensors (the formula's value when not measured). For a partial
    ``full`` row: the mean over a model chunk's layers."""

    formula_bytes_per_layer: int
    """Table 2, generalised (:func:`lightning_sp.memory.formulas.activation_bytes_per_layer`)."""

    first_stage_activation_bytes: int
    """Per layer × layers in flight (eq. 5, interleaving) + the §4.5 extras, measured."""

    formula_first_stage_activation_bytes: int
    """The same from the formulas alone."""

    model_state_bytes: int
    """Parameters + gradients + optimizer state of the most loaded rank."""

    total_bytes: int
    """``model_state_bytes + first_stage_activation_bytes``."""

    device_bytes: int
    """The device memory it is set against."""

    recompute_num_layers: int | None = None
    """With ``full``: layers per model chunk recomputed in full, the others as
    :meth:`GPTConfig.layer_recompute` says; ``None``: every layer."""

    selected: bool = False
    """The configured combination, or the one ``recompute: auto`` chose."""

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.device_bytes

    @property
    def label(self) -> str:
        """``SP + selective``, ``TP only + full (2 layers/chunk, rest selective)``, ..."""
        policy = self.recompute
        if self.recompute_num_layers is not None:
            policy = _partial(policy, self.recompute_num_layers)
        return f"{'SP' if self.sequence_parallel else 'TP only'} + {policy}"


@dataclass(frozen=True)
class RecomputeChoice:
    """What ``recompute: auto`` resolves to."""

    recompute: str
    """A policy of :data:`LADDER`."""

    recompute_num_layers: int | None
    """With ``full``: how many layers of each model chunk recompute in full (the first ones;
    the others as :meth:`GPTConfig.layer_recompute` says); ``None``: all of them."""

    total_bytes: int
    """Model state + first-stage activations under this choice."""

    device_bytes: int
    """The memory it had to fit."""

    measured: bool
    """Whether the activation bytes were measured (else: from the formulas)."""

    @property
    def fits(self) -> bool:
        """False only when even full recompute of every layer does not fit."""
        return self.total_bytes <= self.device_bytes

    def describe(self) -> str:
        """One line for logs: the choice, its total and the device memory."""
        what = self.recompute
        if self.recompute_num_layers is not None:
            what = _partial(what, self.recompute_num_layers)
        verdict = "fits" if self.fits else "does NOT fit even so"
        source = "measured" if self.measured else "formula"
        return (
            f"recompute: auto -> {what} ({gigabytes(self.total_bytes)} of "
            f"{gigabytes(self.device_bytes)}, {verdict}; {source})"
        )


@dataclass
class Estimate:
    """Everything ``estimate`` reports for one layout."""

    layout: Layout
    """The configuration estimated."""

    device_bytes: int
    """Device memory per GPU."""

    rows: list[EstimateRow]
    """One per :data:`COMBINATIONS` entry that can run, then a partial-``full`` row if
    ``auto`` chose one."""

    measurements: dict[tuple[bool, str], ActivationMeasurement] = field(default_factory=dict)
    """Raw measurements per ``(sequence_parallel, recompute)`` (empty if not measured)."""

    parameters_per_rank: int = 0
    """Parameters on the most loaded rank (the first pipeline stage)."""

    model_parameters: int = 0
    """Parameters of the whole model."""

    choice: RecomputeChoice | None = None
    """The resolution of ``recompute: auto`` (``None`` if a policy was configured)."""

    seconds: float = 0.0
    """Wall time spent measuring."""

    def row(self, sequence_parallel: bool, recompute: str) -> EstimateRow:
        """The row of one of :data:`COMBINATIONS` (every layer on ``recompute``)."""
        for r in self.rows:
            if (r.sequence_parallel, r.recompute, r.recompute_num_layers) == (
                sequence_parallel, recompute, None,
            ):  # fmt: skip
                return r
        raise KeyError((sequence_parallel, recompute))

    def figure7(self, measured: bool = True) -> dict[str, float]:
        """The paper's Figure 7 for this model: Table 2 rows as a percentage of the
        tensor-parallel baseline (SP off, no recompute), per layer, measured or by formula."""
        key = "activation_bytes_per_layer" if measured else "formula_bytes_per_layer"
        base = getattr(self.row(False, "none"), key)
        return {
            name: 100.0 * getattr(self.row(*TABLE2_SETTINGS[name]), key) / base
            for name in FIGURE7_ROWS
        }


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
) -> EstimateRow:
    """One row from ``by_policy[policy] = (got, formula)`` activations of this SP setting; the
    layers of a chunk run what :meth:`GPTConfig.layer_recompute` says they run."""
    config = layout.with_policy(sequence_parallel, recompute, recompute_num_layers)
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
    k, sp = _configured_split(layout), layout.sequence_parallel
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
        result.choice = _choose(result, acts[layout.sequence_parallel], state_bytes)
    _mark_selected(result)
    return result


def _choose(
    result: Estimate, by_policy: dict[str, tuple[Activations, Activations]], state_bytes: int
) -> RecomputeChoice:
    """The least recomputation that fits, for the layout's sequence-parallel setting; a row for
    a partial choice of the last policy is appended to ``result.rows``."""
    layout, sp, measured = result.layout, result.layout.sequence_parallel, bool(result.measurements)
    previous: int | None = None
    for policy in LADDER[:-1]:
        row = result.row(sp, policy)
        if previous is not None and row.formula_bytes_per_layer >= previous:
            continue  # recomputes for no gain (selective under sdpa)
        previous = row.formula_bytes_per_layer
        if row.fits:
            return RecomputeChoice(policy, None, row.total_bytes, result.device_bytes, measured)
    last = LADDER[-1]
    for k in range(1, layout.layers_per_chunk):
        row = _row(layout, sp, last, by_policy, state_bytes, result.device_bytes, k)
        if row.fits:
            result.rows.append(row)
            return RecomputeChoice(last, k, row.total_bytes, result.device_bytes, measured)
    everything = result.row(sp, last)
    return RecomputeChoice(last, None, everything.total_bytes, result.device_bytes, measured)


def _combinations(layout: Layout) -> tuple[tuple[bool, str], ...]:
    """:data:`COMBINATIONS`, plus the configured module set if it is no named policy."""
    if layout.recompute == AUTO or policy_name(layout.recompute) in LADDER:
        return COMBINATIONS
    name = policy_name(layout.recompute)
    return (*COMBINATIONS, (False, name), (True, name))


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
        key = (layout.sequence_parallel, policy_name(layout.recompute), _configured_split(layout))
    else:
        key = (layout.sequence_parallel, choice.recompute, choice.recompute_num_layers)
    for row in result.rows:
        row.selected = (row.sequence_parallel, row.recompute, row.recompute_num_layers) == key


def resolve_recompute(
    config: GPTConfig,
    *,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    virtual_pipeline_size: int = 1,
    num_microbatches: int = 1,
    micro_batch_size: int = 1,
    data_parallel_size: int = 1,
    sequence_parallel: bool | None = None,
    device_bytes: float = DEFAULT_DEVICE_BYTES,
    layers: int = 1,
    measure: bool | None = None,
) -> RecomputeChoice:
    """Resolve ``recompute: auto`` for a running layout: the least recomputation with which the
    most loaded rank's model state + first-stage activations fit ``device_bytes`` (see
    :func:`estimate`; ``fits`` is False when even full recompute of every layer does not).

    ``config.recompute`` is ignored. ``sequence_parallel`` defaults to
    ``config.sequence_parallel``. ``measure``: trace under fake tensors (``None``: when
    ``torch.distributed`` is not yet initialised in this process, since the fake world cannot
    coexist with a real one; otherwise the formulas, which the measurement matches within
    0.01%). Deterministic, so every rank resolves the same choice.
    """
    import torch.distributed as dist

    if measure is None:
        measure = not (dist.is_available() and dist.is_initialized())
    sp = config.sequence_parallel if sequence_parallel is None else sequence_parallel
    layout = Layout(
        config=dataclasses.replace(
            config, sequence_parallel=sp, recompute="auto", recompute_num_layers=None
        ),
        tensor_parallel_size=tensor_parallel_size,
        pipeline_parallel_size=pipeline_parallel_size,
        virtual_pipeline_size=virtual_pipeline_size,
        num_microbatches=num_microbatches,
        micro_batch_size=micro_batch_size,
        data_parallel_size=data_parallel_size,
        source="the running layout",
    )
    choice = estimate(layout, device_bytes, layers=layers, measure=measure).choice
    assert choice is not None
    return choice
