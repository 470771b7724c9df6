"""``lightning-sp estimate``: the memory planner and the step-time model on a ``fit`` command
line.

The command reads exactly what ``fit`` reads, through the CLI's own parser: :class:`FitLayoutCLI`,
mixed in before the project's ``LightningCLI`` subclass, parses the ``--config`` files, every
``--trainer.*``/``--model.*``/``--data.*`` override, the same defaults and links, adds the
planner's options, and instantiates the model and the strategy (cheap: no weights, no process
group) but never the ``Trainer`` (its accelerator may be a GPU this machine lacks) nor the data
module (its files may live on the cluster only). The result is a
:class:`~lightning_sp.planner.layout.Layout` and
:class:`~lightning_sp.planner.layout.PlannerOptions`; the planner computes
(:mod:`lightning_sp.planner.estimate`, :mod:`lightning_sp.planner.search`) and
:mod:`lightning_sp.planner.report` formats.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Callable
from typing import Any, Literal, Protocol, runtime_checkable

from jsonargparse import Namespace
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.strategies import Strategy, StrategyRegistry
from typing_extensions import override

from lightning_sp.cli.fit import GPTCLI, Unseeded
from lightning_sp.cli.init_from import complete_from_directory
from lightning_sp.data import TextDataModule
from lightning_sp.errors import ConfigError, divisors, positive_int
from lightning_sp.model.config import GPTConfig
from lightning_sp.model.lora import LoRAConfig
from lightning_sp.parallel.config import ParallelConfig
from lightning_sp.planner.dpo import format_reference, reference_cost
from lightning_sp.planner.estimate import estimate
from lightning_sp.planner.layout import Layout, PlannerOptions, parse_bytes
from lightning_sp.planner.lora import format_lora, lora_estimate
from lightning_sp.planner.presets import load_cluster
from lightning_sp.planner.report import (
    _candidate_json,
    check_plot_path,
    format_table,
    plot_ladder,
    to_json,
)
from lightning_sp.planner.search import format_search, search
from lightning_sp.training.gpt_module import GPTModule


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
        "lightning_sp.planner.calibrate writes one)",
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
    if parsed.plot is not None:
        check_plot_path(parsed.plot)
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


def _overlaps(strategy: Any) -> bool:
    """Whether the strategy overlaps its gradient reduction with backward (its
    :class:`~lightning_sp.parallel.buffer.GradBufferConfig`; a strategy without one: yes)."""
    buffer = getattr(strategy, "grad_buffer", None)
    return bool(getattr(buffer, "overlap", True))


def layout_from_fit(
    model_config: GPTConfig,
    strategy: Any,
    devices: Any,
    num_nodes: int,
    batch_size: int,
    source: str = "<config>",
    accumulate_grad_batches: Any = 1,
    document_mask: bool = False,
    reset_position_ids: bool = False,
) -> Layout:
    """The validated :class:`Layout` of a ``fit`` run: ``model.config``, the instantiated
    ``trainer.strategy``, ``trainer.devices × trainer.num_nodes`` GPUs (= t·c·p·d),
    ``data.batch_size`` samples per data-parallel rank per pipeline step (= b ×
    micro-batches) and ``trainer.accumulate_grad_batches`` such batches per optimizer step
    (Lightning's accumulation, ``p = 1`` only); ``document_mask`` / ``reset_position_ids``: the
    data options of packed documents (:attr:`Layout.document_mask`)."""
    gpus_per_node = _devices(devices)
    nodes = positive_int("trainer.num_nodes", num_nodes)
    batch = positive_int("data.batch_size", batch_size)
    if isinstance(accumulate_grad_batches, bool) or not isinstance(accumulate_grad_batches, int):
        raise ConfigError(
            f"trainer.accumulate_grad_batches={accumulate_grad_batches!r} must be a positive "
            "integer (micro-batches accumulated per optimizer step)"
        )
    accumulate = positive_int("trainer.accumulate_grad_batches", accumulate_grad_batches)
    world, parallel = gpus_per_node * nodes, strategy_layout(strategy)
    try:
        parallel = parallel.for_world_size(world)
    except ConfigError as exc:
        raise ConfigError(
            f"trainer.devices={gpus_per_node} x trainer.num_nodes={nodes} = {world} GPUs must "
            f"be t * c * p * d: {exc}"
        ) from None
    n = parallel.num_microbatches
    if batch % n:
        raise ConfigError(
            f"data.batch_size={batch} is not divisible by num_microbatches={n} (micro-batch = "
            f"batch_size / num_microbatches); num_microbatches must be one of {divisors(batch)}"
        )
    layout = Layout(
        **dataclasses.asdict(parallel),
        config=model_config,
        micro_batch_size=batch // n,
        accumulate_grad_batches=accumulate,
        overlap_grad_reduce=_overlaps(strategy),
        document_mask=document_mask,
        reset_position_ids=reset_position_ids,
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

    lora: LoRAConfig | None = None
    """``model.lora``: the run trains adapters on a frozen base (priced next to its full
    fine-tune, :mod:`lightning_sp.planner.lora`)."""

    reference: str | None = None
    """``model.dpo``'s reference kind, resolved (``copy``, ``adapters``, ``precomputed``;
    priced by :mod:`lightning_sp.planner.dpo`); ``None``: not a DPO run."""

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        super().add_arguments_to_parser(parser)
        add_planner_arguments(parser)

    @override
    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        self.config = parser.parse_args(args)  # args: the words after ``estimate``
        complete_from_directory(parser, args, self.config)  # sizes left to model.init_from

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
        chat = data.get("chat_template_dir") is not None
        self.layout = layout_from_fit(
            built.model.config,
            built.trainer.strategy,
            built.trainer.devices,
            built.trainer.num_nodes,
            data.batch_size,
            source=os.fspath(files[-1]) if files else "<command line>",
            accumulate_grad_batches=parsed.trainer.get("accumulate_grad_batches", 1),
            # chat data always packs with document masks and restarting positions
            document_mask=bool(data.get("document_mask")) or chat,
            reset_position_ids=bool(data.get("reset_position_ids")) or chat,
        )
        self.options = planner_options(parsed)
        self.lora = getattr(built.model, "lora", None)
        dpo = getattr(built.model, "dpo", None)
        self.reference = dpo.resolved_reference(self.lora is not None) if dpo else None


class EstimateCLI(Unseeded, FitLayoutCLI, GPTCLI):
    """``estimate``: ``fit``'s parser plus the planner's options; builds no Trainer."""


def read_estimate_args(args: list[str]) -> EstimateCLI:
    """Parse an ``estimate`` command line (everything after ``estimate``)."""
    return EstimateCLI(
        GPTModule, TextDataModule, args=args, run=False, load_from_checkpoint_support=False
    )


def main(read: Callable[[list[str]], FitLayoutCLI], argv: list[str]) -> int:
    """``lightning-sp estimate``: ``read(argv)`` parses the ``fit`` command line plus the
    planner's options (a :class:`FitLayoutCLI`); print the table (or JSON), optionally plot;
    return the exit status (0, or 2 with a one-line ``error:`` on stderr for a bad config)."""
    try:
        parsed = read(argv)
        options = parsed.options
        cluster = load_cluster(options.cluster)
        if options.search:
            lora = getattr(parsed, "lora", None)  # priced as the LoRA run, as below
            found = search(parsed.layout, cluster, options.device_bytes, lora=lora)
            if options.format == "json":
                print(json.dumps([_candidate_json(x) for x in found.ranked[: options.top]]))
            else:
                print(format_search(found, options.top))
            return 0
        result = estimate(
            parsed.layout,
            options.device_bytes,
            layers=options.layers,
            measure=options.measure,
            cluster=cluster,
        )
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # a LoRA run beside its full fine-tune, a DPO run's reference: after the table, or on
    # stderr beside the JSON rows (stdout stays one JSON document)
    extras = []
    lora = getattr(parsed, "lora", None)
    if lora is not None:
        extras.append(format_lora(lora_estimate(parsed.layout, lora, cluster)))
    reference = getattr(parsed, "reference", None)
    if reference is not None:
        extras.append(format_reference(reference_cost(parsed.layout, reference, cluster)))
    if options.format == "json":
        print(json.dumps([to_json(r) for r in result.rows], indent=2))
        if result.choice is not None:
            print(result.choice.describe(), file=sys.stderr)
        for extra in extras:
            print(extra, file=sys.stderr)
    else:
        print(format_table(result))
        for extra in extras:
            print(extra)
    if options.plot:
        plot_ladder(result, options.plot)
        if options.format == "table":
            print(f"plot: {options.plot}")
    return 0
