"""The training layout the planner estimates, and what ``estimate`` does with it.

:class:`Layout` is the record the pure estimate takes: the run's
:class:`~lightning_sp.parallel.config.ParallelConfig` with the model config and the
micro-batch size beside it. The runtime (``recompute: auto`` in ``GPTModule``) builds it from
the layout the strategy pushed; the ``estimate`` command (:mod:`lightning_sp.cli.estimate`)
from a ``fit`` command line. :class:`PlannerOptions` holds the command's own options.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from functools import cached_property

from lightning_sp.errors import ConfigError, divisors, positive_int
from lightning_sp.model.config import GPTConfig
from lightning_sp.model.config_checks import check_model_layout
from lightning_sp.model.recompute import RecomputePolicy
from lightning_sp.model.shape import ActivationShape
from lightning_sp.parallel.config import ParallelConfig
from lightning_sp.pipeline import check_pipeline

DEFAULT_DEVICE_BYTES = 80e9
"""An A100 80GB, in bytes."""


@dataclass(frozen=True, kw_only=True)
class Layout(ParallelConfig):
    """One training step laid out over ranks (the run's :class:`ParallelConfig`), with the
    model and the micro-batch: what the memory of the most loaded rank depends on."""

    config: GPTConfig
    """The model; its ``recompute`` is as configured (``auto`` included) and its
    ``sequence_parallel`` is the run's (the one home of that setting)."""

    micro_batch_size: int = 1
    """b, samples per micro-batch."""

    accumulate_grad_batches: int = 1
    """k: micro-batches Lightning accumulates per optimizer step (``trainer.
    accumulate_grad_batches``), each a forward and backward of the whole model; the way to
    split a step when ``p = 1`` (``num_microbatches`` is the pipeline schedule's, and ``fit``
    refuses both > 1 together). The gradients are reduced once per step, on the last."""

    overlap_grad_reduce: bool = True
    """The strategy's ``overlap_grad_reduce``: the data-parallel reduction starts during the
    last micro-batch's backward (else it runs after it, all exposed)."""

    document_mask: bool = False
    """``data.document_mask`` (or chat data, which always packs with document masks):
    block-causal attention, whose bytes the attention part states (``document_context``), and
    the micro-batch's document ids (:class:`~lightning_sp.model.documents.PackedBytes`)."""

    reset_position_ids: bool = False
    """``data.reset_position_ids`` (or chat data): positions per token, and under RoPE their
    cos/sin tables per micro-batch and model chunk in flight."""

    source: str = "<layout>"
    """Where the layout was read from, for messages."""

    @cached_property
    def shape(self) -> ActivationShape:
        """The model's activation shape on one rank of this layout at ``micro_batch_size``
        (document-masked with ``document_mask``), built once and passed whole to the formulas
        and the step time (:meth:`GPTConfig.activation_shape`)."""
        return self.config.activation_shape(
            self, self.micro_batch_size, documents=self.document_mask
        )

    def shape_of(self, config: GPTConfig) -> ActivationShape:
        """:attr:`shape` for ``config``, one of :meth:`with_policy`'s rows (a row differs from
        the layout's model only in its sequence parallelism and recompute, and the shape
        holds the first)."""
        return dataclasses.replace(self.shape, sequence_parallel=config.sequence_parallel)

    @property
    def recompute(self) -> RecomputePolicy:
        """The recompute policy as configured (``auto`` included)."""
        return self.config.recompute

    @property
    def microbatches_per_step(self) -> int:
        """Forward + backward passes of a micro-batch per optimizer step on one rank: the
        pipeline's ``n`` times Lightning's accumulation ``k`` (one of them is 1)."""
        return self.num_microbatches * self.accumulate_grad_batches

    @property
    def global_batch_size(self) -> int:
        """Samples per optimizer step over all data-parallel ranks: ``b·n·k·d``."""
        return self.micro_batch_size * self.microbatches_per_step * self.data_parallel_size

    @property
    def layers_per_chunk(self) -> int:
        """``L / (p·m)``: layers of one model chunk (one pipeline stage when ``m = 1``)."""
        return self.config.num_layers // (self.pipeline_parallel_size * self.virtual_pipeline_size)

    def validate(self) -> None:
        """Raise :class:`ConfigError` (one line: field, value, what is valid) unless the sizes
        are positive and divide: heads, hidden and FFN width by t, layers by p and by p·m,
        the sequence by 2c (causal load balancing), and, interleaved, micro-batches ≥ p."""
        positive_int("micro_batch_size", self.micro_batch_size)  # the sizes: ParallelConfig's
        k = positive_int("trainer.accumulate_grad_batches", self.accumulate_grad_batches)
        self.for_world_size(self.world_size)  # complete already: e divides its d·c ranks
        p = self.pipeline_parallel_size
        if k > 1 and p > 1:
            raise ConfigError(
                f"trainer.accumulate_grad_batches={k} with pipeline_parallel_size={p}; the "
                "pipeline schedule accumulates over num_microbatches, use "
                "accumulate_grad_batches=1"
            )
        c, s = self.context_parallel_size, self.config.seq_length
        # the sequence by 2c whatever SP (a layout whose SP cannot split it is shown SP off)
        check_model_layout(self.config, self, split_sequence=False)
        if s % self.sequence_divisor(False):
            raise ConfigError(
                f"context_parallel_size={c}: seq_length={s} is not divisible by 2c = {2 * c} "
                "(causal load balancing cuts each sequence into 2c chunks); "
                f"context_parallel_size must be one of {self.valid_context_sizes()}"
            )
        layers = self.config.num_layers
        if layers % p:
            raise ConfigError(
                f"num_layers={layers} is not divisible by pipeline_parallel_size={p} (layers per "
                f"stage); pipeline_parallel_size must be one of {divisors(layers)}"
            )
        check_pipeline(layers, p, self.virtual_pipeline_size, self.num_microbatches)

    def valid_context_sizes(self) -> list[int]:
        """The context-parallel sizes ``fit`` accepts for this sequence, t and SP setting
        (:func:`lightning_sp.training.checks.check_context_sequence`): 1, and each ``c`` with
        ``2c`` dividing ``s`` (with SP at ``t > 1``, ``lcm(2c, c·t)``)."""
        s, sp, t = self.config.seq_length, self.config.sequence_parallel, self.tensor_parallel_size

        def divisor(c: int) -> int:
            return ParallelConfig(tensor_parallel_size=t, context_parallel_size=c).sequence_divisor(
                sp
            )

        return [1] + [c for c in divisors(s // 2) if c > 1 and not s % divisor(c)]

    def splits_sequence(self) -> bool:
        """Whether sequence parallelism, if on, can split each rank's ``s/c`` tokens over t
        (``fit`` refuses the layout otherwise: :meth:`ParallelConfig.sequence_divisor`)."""
        return not self.config.seq_length % self.sequence_divisor(True)

    def with_policy(
        self,
        sequence_parallel: bool,
        recompute: str | RecomputePolicy,
        recompute_num_layers: int | None = None,
        recompute_rest: str | RecomputePolicy | None = None,
    ) -> GPTConfig:
        """The model config for one ``(sequence_parallel, recompute)`` combination; with
        ``recompute_num_layers``, the other layers run ``recompute_rest`` (``None``: as
        configured). Built once per combination and layout (a search asks for each row's
        several times; building one checks the whole config): do not change what it returns."""
        key = (sequence_parallel, recompute, recompute_num_layers, recompute_rest)
        built: dict[tuple[object, ...], GPTConfig] = self.__dict__.setdefault("_with_policy", {})
        if key not in built:
            rest = self.config.recompute_rest if recompute_rest is None else recompute_rest
            built[key] = dataclasses.replace(
                self.config,
                sequence_parallel=sequence_parallel,
                recompute=RecomputePolicy.parse(recompute),
                recompute_num_layers=recompute_num_layers,
                recompute_rest=RecomputePolicy.parse(rest, "recompute_rest", rest=True),
            )
        return built[key]


def runs(config: GPTConfig, layout: ParallelConfig) -> bool:
    """Whether ``config`` (a row's sequence parallelism and recompute) can run on ``layout``
    (:func:`~lightning_sp.model.config_checks.check_model_layout`, the sequence aside: the
    rows whose SP cannot split it are left out by the estimate itself)."""
    try:
        check_model_layout(config, layout, split_sequence=False)
    except ConfigError:
        return False
    return True


# -- the estimate command's options -------------------------------------------------------------


@dataclass(frozen=True)
class PlannerOptions:
    """What ``estimate`` does with a layout, besides the layout itself."""

    device_bytes: float = DEFAULT_DEVICE_BYTES
    """Memory per GPU the estimate is set against."""

    format: str = "table"
    """``table`` or ``json``."""

    plot: str | None = None
    """Where to draw the memory ladder (Figure 7), if anywhere."""

    layers: int = 1
    """Transformer layers traced per combination."""

    measure: bool = True
    """Trace under fake tensors (else: formulas only)."""

    cluster: str = "a100-80gb"
    """The hardware of the step-time prediction: a preset or a cluster YAML file."""

    search: bool = False
    """Enumerate layouts of the same GPUs and global batch and rank them by predicted time."""

    top: int = 10
    """How many layouts ``search`` prints."""


def parse_bytes(text: str) -> float:
    """``"80e9"``, ``"80GB"``, ``"80 GiB"``, ``"81920MiB"``, ``"80G"`` -> bytes (G = GB = 10⁹,
    GiB = 2³⁰); :class:`ConfigError` otherwise."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([KMGT]?)(i?)B?\s*", text)
    if match is None:
        raise ConfigError(f"--device_memory={text!r} is not a size; use e.g. 80GB, 80GiB or 80e9")
    number, prefix, binary = match.groups()
    power = "_KMGT".index(prefix) if prefix else 0
    value = float(number) * (1024 if binary else 1000) ** power
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"--device_memory={text!r} must be a positive finite size")
    return value
