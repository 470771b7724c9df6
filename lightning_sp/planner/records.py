"""The records of the memory planner: the rows of an estimate, the estimate itself and what
``recompute: auto`` resolves to (computed by :mod:`lightning_sp.planner.estimate`).

All byte counts are per rank and per micro-batch where they are activations; ``total =
model state + first-stage activations`` (see :mod:`lightning_sp.planner.estimate` for what
that leaves out).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning_sp.memory.fake import ActivationMeasurement
from lightning_sp.memory.formulas import FIGURE7_ROWS, TABLE2_SETTINGS
from lightning_sp.model.config import RECOMPUTE_POLICIES
from lightning_sp.planner.layout import Layout

LADDER: tuple[str, ...] = RECOMPUTE_POLICIES
"""The recompute policies the planner tabulates, least recomputation first: the one place
the planner enumerates them (``auto`` picks the fastest that fits; on a tie, the first)."""

COMBINATIONS: tuple[tuple[bool, str], ...] = tuple(
    (sp, rc) for sp in (False, True) for rc in LADDER
)
"""The ``(sequence_parallel, recompute)`` rows of the estimate."""


def gigabytes(nbytes: float) -> str:
    """``"64.12 GB"`` (10⁹ bytes, as device memory is quoted)."""
    return f"{nbytes / 1e9:.2f} GB"


def _partial(recompute: str, recompute_num_layers: int, recompute_rest: str | None) -> str:
    """``"full on 2 layer(s) per model chunk, lean on the rest"``: what the model runs
    (:meth:`GPTConfig.layer_recompute`) with ``recompute_num_layers`` set."""
    return (
        f"{recompute} on {recompute_num_layers} layer(s) per model chunk, "
        f"{recompute_rest} on the rest"
    )


@dataclass(frozen=True)
class Activations:
    """Activation bytes rank 0 saves for one micro-batch, measured or by formula."""

    per_layer: float
    """One transformer layer."""

    embedding: float
    """The input embedding (its dropout mask)."""

    head: float
    """The final LayerNorm, output layer and loss (on the first stage only when ``p = 1``)."""

    ids: float = 0.0
    """Packed documents: the micro-batch's document ids and positions, held for the step
    (each of the step's micro-batches: :attr:`PackedBytes.ids
    <lightning_sp.model.documents.PackedBytes.ids>`)."""

    tables: float = 0.0
    """Packed documents under RoPE: the per-token cos/sin of one micro-batch, per model chunk
    forward in flight (:attr:`PackedBytes.tables
    <lightning_sp.model.documents.PackedBytes.tables>`)."""


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
    """With ``full``: layers per model chunk recomputed in full, the others on
    ``recompute_rest``; ``None``: every layer."""

    recompute_rest: str | None = None
    """With ``recompute_num_layers``: the policy of a chunk's other layers (by
    :func:`~lightning_sp.model.recompute.policy_name`); ``None`` otherwise."""

    selected: bool = False
    """The configured combination, or the one ``recompute: auto`` chose."""

    iteration_seconds: float = 0.0
    """Predicted time of one iteration (:mod:`lightning_sp.planner.steptime`)."""

    tokens_per_second: float = 0.0
    """Global batch x sequence length / ``iteration_seconds``."""

    model_tflops_per_gpu: float = 0.0
    """Model FLOPs per second per GPU, in 10¹² (the paper's Appendix A count: attention
    counted whole, as torchtitan and Megatron-Core until 2025 count it)."""

    mfu: float = 0.0
    """Model FLOPs utilization: ``model_tflops_per_gpu`` / the GPU's dense BF16 peak."""

    model_tflops_per_gpu_causal_half: float = 0.0
    """``model_tflops_per_gpu`` counted as Megatron-LM (since 2025) and MaxText count:
    causal attention's cores at half (:func:`lightning_sp.memory.flops.
    causal_half_model_flops_per_iteration`)."""

    mfu_causal_half: float = 0.0
    """``mfu`` with causal attention counted at half."""

    hfu: float = 0.0
    """Hardware FLOPs utilization: recomputation included."""

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.device_bytes

    @property
    def label(self) -> str:
        """``SP + selective``, ``TP only + full on 2 layer(s) per model chunk, lean on the
        rest``, ..."""
        policy = self.recompute
        if self.recompute_num_layers is not None:
            policy = _partial(policy, self.recompute_num_layers, self.recompute_rest)
        return f"{'SP' if self.sequence_parallel else 'TP only'} + {policy}"


@dataclass(frozen=True)
class RecomputeChoice:
    """What ``recompute: auto`` resolves to."""

    recompute: str
    """A policy of :data:`LADDER`."""

    recompute_num_layers: int | None
    """With ``full``: how many layers of each model chunk recompute in full (the first ones;
    the others on ``recompute_rest``); ``None``: all of them."""

    total_bytes: int
    """Model state + first-stage activations under this choice."""

    device_bytes: int
    """The memory it had to fit."""

    measured: bool
    """Whether the activation bytes were measured (else: from the formulas)."""

    recompute_rest: str | None = None
    """With ``recompute_num_layers``: what a chunk's other layers run (a policy below
    ``full`` on :data:`LADDER`, the one whose split is fastest); ``None`` otherwise."""

    iteration_seconds: float = 0.0
    """The predicted iteration time under this choice."""

    @property
    def fits(self) -> bool:
        """False only when even full recompute of every layer does not fit."""
        return self.total_bytes <= self.device_bytes

    def describe(self) -> str:
        """One line for logs: the choice, its total and the device memory."""
        what = self.recompute
        if self.recompute_num_layers is not None:
            what = _partial(what, self.recompute_num_layers, self.recompute_rest)
        verdict = "fits" if self.fits else "does NOT fit even so"
        source = "measured" if self.measured else "formula"
        return (
            f"recompute: auto -> {what} ({gigabytes(self.total_bytes)} of "
            f"{gigabytes(self.device_bytes)}, {verdict}; {source}; predicted "
            f"{self.iteration_seconds:.3g} s per iteration)"
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

    cluster: str = ""
    """The cluster the step times are predicted for (its name)."""

    fp8_peak_flops: float | None = None
    """The cluster's dense FP8 peak, FLOP/s, that an ``fp8`` run's linears are priced at."""

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
