"""The training layout the planner estimates, and how ``cli.py estimate`` reads it.

:class:`Layout` is the record the pure estimate takes: the run's
:class:`~lightning_sp.parallel.config.ParallelConfig` with the model config and the
micro-batch size beside it. The runtime (``recompute: auto`` in ``GPTModule``) builds it from
the layout the strategy pushed; ``cli.py estimate`` from a ``fit`` command line, reading the
strategy's ``parallel_config``.

:class:`FitLayoutCLI` reads that command line through the CLI's own parser: mixed in before
the project's ``LightningCLI`` subclass it parses exactly what ``fit`` parses (``--config``
files, every ``--trainer.*``/``--model.*``/``--data.*`` override, the same defaults and
links), adds the planner's options, and instantiates the model and the strategy (cheap: no
weights, no process group) but never the ``Trainer`` (its accelerator may be a GPU this
machine lacks) nor the data module (its files may live on the cluster only).
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

from jsonargparse import Namespace
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.strategies import Strategy, StrategyRegistry
from typing_extensions import override

from lightning_sp.errors import ConfigError, divisors, positive_int
from lightning_sp.model.config import GPTConfig
from lightning_sp.parallel.config import ParallelConfig, resolve_sequence_parallel
from lightning_sp.parallel.state import check_layout
from lightning_sp.pipeline import check_pipeline
from lightning_sp.planner.cluster import load_cluster

DEFAULT_DEVICE_BYTES = 80e9
"""An A100 80GB, in bytes."""


@dataclass(frozen=True, kw_only=True)
class Layout(ParallelConfig):
    """One training step laid out over ranks (the run's :class:`ParallelConfig`), with the
    model and the micro-batch: what the memory of the most loaded rank depends on."""

    config: GPTConfig
    """The model; its ``recompute`` is as configured (``auto`` included) and its
    ``sequence_parallel`` is the layout's."""

    micro_batch_size: int = 1
    """b, samples per micro-batch."""

    source: str = "<layout>"
    """Where the layout was read from, for messages."""

    def __post_init__(self) -> None:
        super().__post_init__()
        sp = resolve_sequence_parallel(self.sequence_parallel, self.config.sequence_parallel)
        object.__setattr__(self, "sequence_parallel", sp)  # frozen: decided once, here

    @property
    def recompute(self) -> str | list[str]:
        """The recompute policy as configured (``auto`` included; a list of modules is kept as
        given)."""
        return self.config.recompute

    @property
    def global_batch_size(self) -> int:
        """Samples per optimizer step over all data-parallel ranks."""
        return self.micro_batch_size * self.num_microbatches * self.data_parallel_size

    @property
    def layers_per_chunk(self) -> int:
        """``L / (p·m)``: layers of one model chunk (one pipeline stage when ``m = 1``)."""
        return self.config.num_layers // (self.pipeline_parallel_size * self.virtual_pipeline_size)

    def validate(self) -> None:
        """Raise :class:`ConfigError` (one line: field, value, what is valid) unless the sizes
        are positive and divide: heads, hidden and FFN width by t, layers by p and by p·m,
        the sequence by 2c (causal load balancing), and, interleaved, micro-batches ≥ p."""
        for name in (
            "tensor_parallel_size", "pipeline_parallel_size", "virtual_pipeline_size",
            "context_parallel_size", "num_microbatches", "micro_batch_size",
            "data_parallel_size",
        ):  # fmt: skip
            positive_int(name, getattr(self, name))
        t, p = self.tensor_parallel_size, self.pipeline_parallel_size
        self.config.validate(t)
        c, s = self.context_parallel_size, self.config.seq_length
        if s % (2 * c):
            raise ConfigError(
                f"context_parallel_size={c}: seq_length={s} is not divisible by 2c = {2 * c} "
                "(causal load balancing cuts each sequence into 2c chunks); "
                f"context_parallel_size must be one of {[x for x in divisors(s // 2)]}"
            )
        layers = self.config.num_layers
        if layers % p:
            raise ConfigError(
                f"num_layers={layers} is not divisible by pipeline_parallel_size={p} (layers per "
                f"stage); pipeline_parallel_size must be one of {divisors(layers)}"
            )
        check_pipeline(layers, p, self.virtual_pipeline_size, self.num_microbatches)

    def with_policy(
        self,
        sequence_parallel: bool,
        recompute: str,
        recompute_num_layers: int | None = None,
        recompute_rest: str | None = None,
    ) -> GPTConfig:
        """The model config for one ``(sequence_parallel, recompute)`` combination; with
        ``recompute_num_layers``, the other layers run ``recompute_rest`` (``None``: as
        configured)."""
        rest = self.config.recompute_rest if recompute_rest is None else recompute_rest
        return dataclasses.replace(
            self.config,
            sequence_parallel=sequence_parallel,
            recompute=recompute,
            recompute_num_layers=recompute_num_layers,
            recompute_rest=rest,
        )


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
    if value <= 0:
        raise ConfigError(f"--device_memory={text!r} must be positive")
    return value


def add_planner_arguments(parser: LightningArgumentParser) -> None:
    """The options ``estimate`` adds to ``fit``'s."""
    parser.add_argument(
        "--device_memory",
        type=str | None,
        default=None,
        help="memory per GPU: bytes, or 80GB / 80GiB style (default: the cluster's, 80GB)",
    )
    parser.add_argument(
        "--cluster",
        type=str,
        default="a100-80gb",
        help="hardware of the step-time prediction: a100-80gb (the paper's Selene from "
        "datasheets and microbenchmarks), selene (a100-80gb with the GEMM efficiency the "
        "paper's Table 4 implies), h100-80gb, or a cluster YAML file (python -m "
        "benchmarks.calibrate writes one)",
    )
    parser.add_argument(
        "--search",
        type=bool,
        default=False,
        help="rank the layouts (t, p, m, d, micro-batch, recompute, SP, distributed optimizer) "
        "of the same GPUs and global batch that fit, fastest first",
    )
    parser.add_argument("--top", type=int, default=10, help="layouts --search prints")
    parser.add_argument(
        "--format", type=Literal["table", "json"], default="table", help="a table or JSON rows"
    )
    parser.add_argument(
        "--plot", type=str | None, default=None, help="draw the memory ladder (Figure 7) here"
    )
    parser.add_argument(
        "--layers", type=int, default=1, help="transformer layers traced per combination"
    )
    parser.add_argument(
        "--formula_only", type=bool, default=False, help="skip the measurement; formulas only"
    )


def planner_options(parsed: Namespace) -> PlannerOptions:
    """:class:`PlannerOptions` from the parsed ``estimate`` command line."""
    cluster = load_cluster(parsed.cluster)
    memory = parsed.device_memory
    return PlannerOptions(
        device_bytes=cluster.hbm_bytes if memory is None else parse_bytes(memory),
        cluster=parsed.cluster,
        search=parsed.search,
        top=positive_int("--top", parsed.top),
        format=parsed.format,
        plot=parsed.plot,
        layers=positive_int("--layers", parsed.layers),
        measure=not parsed.formula_only,
    )


# -- reading a fit command line -----------------------------------------------------------------


def _devices(value: Any) -> int:
    """``trainer.devices`` as a count of GPUs per node."""
    if isinstance(value, list | tuple):
        return len(value)
    if isinstance(value, str):
        if not value.isdigit():
            raise ConfigError(
                f"trainer.devices={value!r} cannot be estimated; give the number of GPUs per node"
            )
        value = int(value)
    return positive_int("trainer.devices", value)


@runtime_checkable
class LaidOut(Protocol):
    """A strategy that states its layout (``MegatronSPStrategy``)."""

    parallel_config: ParallelConfig


def strategy_layout(strategy: Any) -> ParallelConfig:
    """The layout the configured strategy states; a strategy other than ``megatron_sp``
    (``ddp``, ``auto``, ...) is pure data parallelism."""
    if isinstance(strategy, str) and strategy in StrategyRegistry:
        strategy = StrategyRegistry.get(strategy)
    if isinstance(strategy, LaidOut):
        return strategy.parallel_config
    if not isinstance(strategy, Strategy | str):
        raise ConfigError(f"trainer.strategy={strategy!r} is not a Lightning strategy")
    return ParallelConfig()


def layout_from_fit(
    model_config: GPTConfig,
    strategy: Any,
    devices: Any,
    num_nodes: int,
    batch_size: int,
    source: str = "<config>",
) -> Layout:
    """The validated :class:`Layout` of a ``fit`` run: ``model.config``, the instantiated
    ``trainer.strategy``, ``trainer.devices × trainer.num_nodes`` GPUs (= t·c·p·d) and
    ``data.batch_size`` samples per data-parallel rank per step (= b × micro-batches)."""
    gpus_per_node = _devices(devices)
    nodes = positive_int("trainer.num_nodes", num_nodes)
    batch = positive_int("data.batch_size", batch_size)
    parallel = strategy_layout(strategy)
    t, p, c, n = (
        parallel.tensor_parallel_size,
        parallel.pipeline_parallel_size,
        parallel.context_parallel_size,
        parallel.num_microbatches,
    )
    world = gpus_per_node * nodes
    try:
        d = check_layout(world, t, p, c)
    except ConfigError as exc:
        raise ConfigError(
            f"trainer.devices={gpus_per_node} x trainer.num_nodes={nodes} = {world} GPUs must "
            f"be t * c * p * d: {exc}"
        ) from None
    if batch % n:
        raise ConfigError(
            f"data.batch_size={batch} is not divisible by num_microbatches={n} (micro-batch = "
            f"batch_size / num_microbatches); num_microbatches must be one of {divisors(batch)}"
        )
    layout = Layout(
        **dataclasses.asdict(parallel) | {"data_parallel_size": d},
        config=model_config,
        micro_batch_size=batch // n,
        source=source,
    )
    layout.validate()
    return layout


class FitLayoutCLI(LightningCLI):
    """Mix in before a ``LightningCLI`` subclass and construct with ``run=False``: parses the
    subclass's ``fit`` command line plus the planner's options into :attr:`layout` and
    :attr:`options`, building neither the Trainer nor the data module.

    The model class must take the GPT config as ``config`` (``GPTModule``); a bad value raises
    :class:`ConfigError` from the class that rejects it.
    """

    layout: Layout
    """The ``fit`` run's layout."""

    options: PlannerOptions
    """The planner's own options."""

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        super().add_arguments_to_parser(parser)
        add_planner_arguments(parser)

    @override
    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        self.config = parser.parse_args(args)  # args: the words after ``estimate``

    @override
    def instantiate_classes(self) -> None:
        parsed = self.config.clone()
        data = parsed.pop("data")  # its files may exist on the cluster only: not opened
        rejected: list[ConfigError] = []

        def build(cls: type, *args: Any, **kwargs: Any) -> Any:
            try:
                return cls(*args, **kwargs)
            except ConfigError as exc:  # jsonargparse re-raises it inside a multi-line error
                rejected.append(exc)
                raise

        try:
            built = self.parser.instantiate(parsed, instantiators=[(build, object, True)])
        except ValueError:
            if rejected:
                raise rejected[0] from None
            raise
        files = parsed.get("config") or []
        self.layout = layout_from_fit(
            built.model.config,
            built.trainer.strategy,
            built.trainer.devices,
            built.trainer.num_nodes,
            data.batch_size,
            source=os.fspath(files[-1]) if files else "<command line>",
        )
        self.options = planner_options(parsed)
