"""The activation-memory planner behind ``python cli.py estimate --config CONFIG.yaml``.

It reads a ``fit`` config (the YAML a training run is launched with), checks that its sizes
divide, measures the activation bytes of one rank's shard of the real model under fake tensors
and a fake process group of the full world size
(:func:`lightning_sp.memory.fake.measure_activations`), and sets them, with the paper's
formulas alongside, against the device memory:

* per transformer layer, measured and by formula, for sequence parallelism on and off and
  each recompute policy;
* the first pipeline stage's activations: per layer × the layers in flight (eq. 5, ×
  ``1 + (p-1)/(p·m)`` interleaved) + the §4.5 extras (embedding dropout masks; with ``p = 1``
  also the final LayerNorm, output layer and loss), all measured;
* parameters + gradients + optimizer state per rank (18 bytes per parameter, see
  :class:`lightning_sp.memory.formulas.ModelStatePrecision`).

``total = model state + first-stage activations``; it leaves out the CUDA context, library
workspaces, allocator fragmentation and transient buffers (all-gathered inputs, gradients in
flight), so give ``--device-memory`` what you can actually allocate.

``recompute: auto`` picks the least recomputation that fits: ``none``, else ``selective``,
else ``full`` on just enough layers of each model chunk (the others selective), else ``full``.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_sp.errors import ConfigError, divisors
from lightning_sp.memory.fake import ActivationMeasurement, measure_activations
from lightning_sp.memory.formulas import (
    FIGURE7_ROWS,
    MIXED_PRECISION_ADAM,
    TABLE2_SETTINGS,
    ModelStatePrecision,
    activation_bytes_per_layer,
    chunk_forwards_in_flight,
    extra_activation_bytes,
    layers_in_flight,
    model_parameter_count,
    model_state_bytes,
    parameters_per_rank,
)
from lightning_sp.model.config import RECOMPUTE_POLICIES, GPTConfig
from lightning_sp.parallel.state import check_layout
from lightning_sp.pipeline import check_pipeline

DEFAULT_DEVICE_BYTES = 80e9
"""An A100 80GB, in bytes."""

RECOMPUTE_CHOICES = (*RECOMPUTE_POLICIES, "auto")
COMBINATIONS: tuple[tuple[bool, str], ...] = tuple(
    (sp, rc) for sp in (False, True) for rc in RECOMPUTE_POLICIES
)
"""The six ``(sequence_parallel, recompute)`` rows of the estimate table."""

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
)


# -- the fit config ----------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainingLayout:
    """What ``estimate`` reads from a ``fit`` config: the model and how it is laid out."""

    config: GPTConfig
    """``model.config``; its ``recompute`` is a concrete policy (``selective`` stands in for
    ``auto``) and its ``sequence_parallel`` is the strategy's."""

    recompute: str = "selective"
    """The recompute policy as configured: ``none``, ``selective``, ``full`` or ``auto``."""

    tensor_parallel_size: int = 1
    """t (``trainer.strategy.init_args.tensor_parallel_size``)."""

    pipeline_parallel_size: int = 1
    """p (``...pipeline_parallel_size``)."""

    virtual_pipeline_size: int = 1
    """m, model chunks per pipeline rank; ``> 1`` is the interleaved schedule."""

    sequence_parallel: bool = True
    """``...sequence_parallel``."""

    num_microbatches: int = 1
    """Micro-batches per optimizer step (``...num_microbatches``)."""

    devices: int = 1
    """GPUs per node (``trainer.devices``)."""

    num_nodes: int = 1
    """``trainer.num_nodes``."""

    batch_size: int = 1
    """Samples per data-parallel rank per optimizer step (``data.batch_size``)."""

    source: str = "<config>"
    """Where the layout was read from, for messages."""

    @property
    def world_size(self) -> int:
        """GPUs: ``devices × num_nodes = t·p·d``."""
        return self.devices * self.num_nodes

    @property
    def data_parallel_size(self) -> int:
        """d = world / (t·p)."""
        return self.world_size // (self.tensor_parallel_size * self.pipeline_parallel_size)

    @property
    def micro_batch_size(self) -> int:
        """b = ``data.batch_size / num_microbatches``."""
        return self.batch_size // self.num_microbatches

    @property
    def global_batch_size(self) -> int:
        """Samples per optimizer step over all data-parallel ranks."""
        return self.batch_size * self.data_parallel_size

    @property
    def layers_per_chunk(self) -> int:
        """``L / (p·m)``: layers of one model chunk (one pipeline stage when ``m = 1``)."""
        return self.config.num_layers // (self.pipeline_parallel_size * self.virtual_pipeline_size)

    def validate(self) -> None:
        """Raise :class:`ConfigError` (one line: field, value, what is valid) unless every size
        divides: heads, hidden and FFN width by t, layers by p and by p·m, GPUs by t·p,
        ``data.batch_size`` by the micro-batches, and, interleaved, micro-batches ≥ p."""
        strategy = "trainer.strategy.init_args"
        for name, value in (
            ("trainer.devices", self.devices),
            ("trainer.num_nodes", self.num_nodes),
            (f"{strategy}.tensor_parallel_size", self.tensor_parallel_size),
            (f"{strategy}.pipeline_parallel_size", self.pipeline_parallel_size),
            (f"{strategy}.virtual_pipeline_size", self.virtual_pipeline_size),
            (f"{strategy}.num_microbatches", self.num_microbatches),
            ("data.batch_size", self.batch_size),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}={value!r} must be a positive integer")
        if self.recompute not in RECOMPUTE_CHOICES:
            raise ConfigError(
                f"model.config.recompute={self.recompute!r} is not a recompute policy; "
                f"valid: {', '.join(RECOMPUTE_CHOICES)}"
            )
        t, p, m = self.tensor_parallel_size, self.pipeline_parallel_size, self.virtual_pipeline_size
        try:
            check_layout(self.world_size, t, p)
        except ConfigError as exc:
            raise ConfigError(
                f"trainer.devices={self.devices} x trainer.num_nodes={self.num_nodes} = "
                f"{self.world_size} GPUs must be t * p * d: {exc}"
            ) from None
        self.config.validate(t)
        layers = self.config.num_layers
        if layers % p:
            raise ConfigError(
                f"num_layers={layers} is not divisible by pipeline_parallel_size={p} (layers per "
                f"stage); pipeline_parallel_size must be one of {divisors(layers)}"
            )
        check_pipeline(layers, p, m, self.num_microbatches)  # the rules the trainer enforces
        if self.batch_size % self.num_microbatches:
            raise ConfigError(
                f"data.batch_size={self.batch_size} is not divisible by "
                f"num_microbatches={self.num_microbatches} (micro-batch = batch_size / "
                f"num_microbatches); num_microbatches must be one of {divisors(self.batch_size)}"
            )

    def with_policy(self, sequence_parallel: bool, recompute: str) -> GPTConfig:
        """The model config for one ``(sequence_parallel, recompute)`` combination."""
        return dataclasses.replace(
            self.config,
            sequence_parallel=sequence_parallel,
            recompute=recompute,  # type: ignore[arg-type]
        )


def _section(raw: dict[str, Any], *path: str) -> dict[str, Any]:
    """``raw[path[0]][path[1]]...`` (each level may wrap its arguments in ``init_args``)."""
    node: Any = raw
    for key in path:
        node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, dict) and "init_args" in node and key != "init_args":
            node = node["init_args"]
        if node is None:
            return {}
    if not isinstance(node, dict):
        raise ConfigError(f"{'.'.join(path)}={node!r} must be a mapping")
    return node


def _defaults(cls_path: str, names: Sequence[str], fallback: dict[str, Any]) -> dict[str, Any]:
    """Constructor defaults of ``cls_path`` for ``names`` (``fallback`` if it cannot be read)."""
    module_name, _, cls_name = cls_path.rpartition(".")
    try:
        module = __import__(module_name, fromlist=[cls_name])
        params = inspect.signature(getattr(module, cls_name).__init__).parameters
    except (ImportError, AttributeError, ValueError):
        return dict(fallback)
    return {
        name: params[name].default
        if name in params and params[name].default is not inspect.Parameter.empty
        else fallback[name]
        for name in names
    }


def layout_from_dict(raw: dict[str, Any], source: str = "<config>") -> TrainingLayout:
    """Build and validate a :class:`TrainingLayout` from a parsed ``fit`` config.

    Missing keys take the defaults of the classes that would receive them (``GPTConfig``,
    ``MegatronSPStrategy``, the data module, Lightning's ``Trainer``).
    """
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{source}: expected a mapping at the top level, got {type(raw).__name__}"
        )
    trainer = _section(raw, "trainer")
    strategy_raw = trainer.get("strategy")
    strategy = _section(raw, "trainer", "strategy") if isinstance(strategy_raw, dict) else {}
    strategy_defaults = _defaults(
        "lightning_sp.training.strategy.MegatronSPStrategy",
        (
            "tensor_parallel_size", "pipeline_parallel_size", "virtual_pipeline_size",
            "sequence_parallel", "num_microbatches",
        ),
        {
            "tensor_parallel_size": 1, "pipeline_parallel_size": 1, "virtual_pipeline_size": 1,
            "sequence_parallel": True, "num_microbatches": 1,
        },
    )  # fmt: skip
    strategy = {**strategy_defaults, **strategy}
    data_cls = "lightning_sp.training.data.TextDataModule"
    data = _defaults(data_cls, ("batch_size",), {"batch_size": 8})
    data.update(_section(raw, "data"))
    model = _section(raw, "model", "config")
    known = {f.name for f in dataclasses.fields(GPTConfig)}
    unknown = sorted(set(model) - known)
    if unknown:
        raise ConfigError(
            f"model.config.{unknown[0]}={model[unknown[0]]!r} is not a GPTConfig field; "
            f"valid: {', '.join(sorted(known))}"
        )
    recompute = model.get("recompute", GPTConfig.recompute)
    sequence_parallel = strategy["sequence_parallel"]
    if not isinstance(sequence_parallel, bool):
        raise ConfigError(
            f"trainer.strategy.init_args.sequence_parallel={sequence_parallel!r} must be true "
            "or false"
        )
    concrete = recompute if recompute in RECOMPUTE_POLICIES else "selective"
    config = GPTConfig(**{**model, "recompute": concrete, "sequence_parallel": sequence_parallel})
    devices = trainer.get("devices", 1)
    if devices == "auto":
        raise ConfigError(
            "trainer.devices='auto' cannot be estimated; give the number of GPUs per node"
        )
    layout = TrainingLayout(
        config=config,
        recompute=recompute,
        tensor_parallel_size=strategy["tensor_parallel_size"],
        pipeline_parallel_size=strategy["pipeline_parallel_size"],
        virtual_pipeline_size=strategy["virtual_pipeline_size"],
        sequence_parallel=sequence_parallel,
        num_microbatches=strategy["num_microbatches"],
        devices=devices,
        num_nodes=trainer.get("num_nodes", 1),
        batch_size=data["batch_size"],
        source=source,
    )
    layout.validate()
    return layout


def read_layout(path: str) -> TrainingLayout:
    """Read a ``fit`` config YAML (``yaml.safe_load``; no data is touched) into a validated
    :class:`TrainingLayout`."""
    import yaml

    try:
        with open(path) as fh:
            raw = yaml.safe_load(fh)
    except OSError as exc:
        raise ConfigError(f"--config={path!r} cannot be read: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"--config={path!r} is not valid YAML: {first}") from None
    return layout_from_dict(raw or {}, source=path)


# -- the estimate ------------------------------------------------------------------------------


@dataclass
class EstimateRow:
    """One ``(sequence_parallel, recompute)`` row of the estimate; bytes per rank."""

    sequence_parallel: bool
    """Sequence parallelism on."""

    recompute: str
    """``none``, ``selective`` or ``full``."""

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
    """With ``full``: layers per model chunk recomputed in full, the rest selective;
    ``None``: every layer."""

    selected: bool = False
    """The configured combination, or the one ``recompute: auto`` chose."""

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.device_bytes

    @property
    def label(self) -> str:
        """``SP + selective``, ``TP only + full (2/4 layers)``, ..."""
        policy = self.recompute
        if self.recompute == "full" and self.recompute_num_layers is not None:
            policy = f"full ({self.recompute_num_layers} layers/chunk, rest selective)"
        return f"{'SP' if self.sequence_parallel else 'TP only'} + {policy}"

    def to_json(self) -> dict[str, Any]:
        """The ``--format json`` object: :data:`JSON_KEYS`, then the extra fields."""
        row = {key: getattr(self, key) for key in JSON_KEYS}
        row["formula_first_stage_activation_bytes"] = self.formula_first_stage_activation_bytes
        row["recompute_num_layers"] = self.recompute_num_layers
        row["selected"] = self.selected
        return row


@dataclass(frozen=True)
class RecomputeChoice:
    """What ``recompute: auto`` resolves to."""

    recompute: str
    """``none``, ``selective`` or ``full``."""

    recompute_num_layers: int | None
    """With ``full``: how many layers of each model chunk recompute in full (the first ones;
    the others use ``selective``); ``None``: all of them."""

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
        if self.recompute == "full" and self.recompute_num_layers is not None:
            what = (
                f"full on {self.recompute_num_layers} layer(s) per model chunk, "
                "selective on the rest"
            )
        verdict = "fits" if self.fits else "does NOT fit even so"
        source = "measured" if self.measured else "formula"
        return (
            f"recompute: auto -> {what} ({_gb(self.total_bytes)} of {_gb(self.device_bytes)}, "
            f"{verdict}; {source})"
        )


@dataclass
class Estimate:
    """Everything ``estimate`` reports for one layout."""

    layout: TrainingLayout
    """The configuration estimated."""

    device_bytes: int
    """Device memory per GPU."""

    rows: list[EstimateRow]
    """The six combinations, then a partial-``full`` row if ``auto`` chose one."""

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
        """The row of one of the six combinations."""
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


def _formula_kwargs(config: GPTConfig) -> dict[str, Any]:
    return {
        "ffn_hidden_size": config.ffn_size,
        "hidden_dropout": config.hidden_dropout > 0,
        "attention_dropout": config.attention_dropout > 0,
    }


def _first_stage(
    layout: TrainingLayout,
    per_layer_by_chunk_position: Sequence[float],
    embedding: float,
    head: float,
) -> float:
    """Activation bytes of the first stage: the chunk's layers × the chunk forwards in flight
    (= per layer × eq. 5 × interleaving), the embedding per micro-batch in flight (§4.5), and
    the head if the first stage is also the last."""
    p, m, n = layout.pipeline_parallel_size, layout.virtual_pipeline_size, layout.num_microbatches
    chunk = sum(per_layer_by_chunk_position)
    total = chunk * chunk_forwards_in_flight(p, m, n) + embedding * min(p, n)
    return total + (head if p == 1 else 0.0)


def estimate(
    layout: TrainingLayout,
    device_bytes: float = DEFAULT_DEVICE_BYTES,
    *,
    layers: int = 1,
    measure: bool = True,
    precision: ModelStatePrecision = MIXED_PRECISION_ADAM,
) -> Estimate:
    """Estimate per-rank memory for the six ``(sequence_parallel, recompute)`` combinations of
    ``layout`` and resolve ``recompute: auto``.

    ``measure``: trace ``layers`` layers of rank 0's shard under fake tensors (needs
    ``torch.distributed`` uninitialised in this process); otherwise use the formulas only.
    Combinations that cannot run (sequence parallelism with ``s`` not divisible by t) are
    left out.
    """
    cfg = layout.config
    t, p = layout.tensor_parallel_size, layout.pipeline_parallel_size
    s, b, h, a = cfg.seq_length, layout.micro_batch_size, cfg.hidden_size, cfg.num_heads
    v = cfg.padded_vocab_size(t)
    n_params = parameters_per_rank(cfg, t, p)
    state_bytes = round(model_state_bytes(n_params, precision))
    start = time.perf_counter()
    measurements: dict[tuple[bool, str], ActivationMeasurement] = {}
    rows: list[EstimateRow] = []
    formula_parts: dict[tuple[bool, str], tuple[float, float]] = {}
    for sp, rc in COMBINATIONS:
        if sp and s % t:
            continue
        combo = layout.with_policy(sp, rc)
        formula = activation_bytes_per_layer(
            s, b, h, a, t, sequence_parallel=sp, recompute=rc, **_formula_kwargs(combo)
        )
        extras = extra_activation_bytes(
            s, b, h, v, t, p, sequence_parallel=sp,
            microbatches_in_flight=min(p, layout.num_microbatches),
            hidden_dropout=combo.hidden_dropout > 0,
        )  # fmt: skip
        formula_parts[(sp, rc)] = (formula, extras)
        formula_first = (
            formula
            * layers_in_flight(
                cfg.num_layers, p, layout.virtual_pipeline_size, layout.num_microbatches
            )
            + extras
        )
        if measure:
            got = measure_activations(
                combo,
                tensor_parallel_size=t,
                pipeline_parallel_size=p,
                data_parallel_size=layout.data_parallel_size,
                micro_batch_size=b,
                layers=min(layers, cfg.num_layers),
                head=p == 1,
            )
            measurements[(sp, rc)] = got
            per_layer = got.bytes_per_layer
            first = _first_stage(
                layout, [per_layer] * layout.layers_per_chunk, got.embedding_bytes,
                got.head_bytes or 0,
            )  # fmt: skip
        else:
            per_layer, first = formula, formula_first
        rows.append(
            EstimateRow(
                sequence_parallel=sp,
                recompute=rc,
                activation_bytes_per_layer=round(per_layer),
                formula_bytes_per_layer=round(formula),
                first_stage_activation_bytes=round(first),
                formula_first_stage_activation_bytes=round(formula_first),
                model_state_bytes=state_bytes,
                total_bytes=round(first) + state_bytes,
                device_bytes=round(device_bytes),
            )
        )
    result = Estimate(
        layout=layout,
        device_bytes=round(device_bytes),
        rows=rows,
        measurements=measurements,
        parameters_per_rank=n_params,
        model_parameters=model_parameter_count(cfg),
        seconds=time.perf_counter() - start,
    )
    if layout.recompute == "auto":
        result.choice = _choose(result, formula_parts)
    _mark_selected(result)
    return result


def _choose(
    result: Estimate, formula_parts: dict[tuple[bool, str], tuple[float, float]]
) -> RecomputeChoice:
    """The least recomputation that fits, for the layout's sequence-parallel setting; a row for
    a partial ``full`` choice is appended to ``result.rows``."""
    layout, sp = result.layout, result.layout.sequence_parallel
    measured = bool(result.measurements)
    for policy in ("none", "selective"):
        row = result.row(sp, policy)
        if row.fits:
            return RecomputeChoice(policy, None, row.total_bytes, result.device_bytes, measured)
    selective, full = result.row(sp, "selective"), result.row(sp, "full")
    lc = layout.layers_per_chunk

    def partial_row(k: int) -> EstimateRow:
        def first(s_bytes: float, f_bytes: float, emb: float, head: float) -> float:
            return _first_stage(layout, [f_bytes] * k + [s_bytes] * (lc - k), emb, head)

        if measured:
            ms, mf = result.measurements[(sp, "selective")], result.measurements[(sp, "full")]
            got = first(ms.bytes_per_layer, mf.bytes_per_layer, ms.embedding_bytes,
                        ms.head_bytes or 0)  # fmt: skip
        else:
            got = selective.formula_first_stage_activation_bytes + k * (
                full.formula_bytes_per_layer - selective.formula_bytes_per_layer
            ) * chunk_forwards_in_flight(
                layout.pipeline_parallel_size, layout.virtual_pipeline_size,
                layout.num_microbatches,
            )  # fmt: skip
        fs_sel, fs_full = formula_parts[(sp, "selective")][0], formula_parts[(sp, "full")][0]
        formula_first = selective.formula_first_stage_activation_bytes + k * (
            fs_full - fs_sel
        ) * chunk_forwards_in_flight(
            layout.pipeline_parallel_size, layout.virtual_pipeline_size, layout.num_microbatches
        )
        mean = (k * full.activation_bytes_per_layer
                + (lc - k) * selective.activation_bytes_per_layer) / lc  # fmt: skip
        mean_formula = (k * fs_full + (lc - k) * fs_sel) / lc
        return EstimateRow(
            sequence_parallel=sp,
            recompute="full",
            activation_bytes_per_layer=round(mean),
            formula_bytes_per_layer=round(mean_formula),
            first_stage_activation_bytes=round(got),
            formula_first_stage_activation_bytes=round(formula_first),
            model_state_bytes=selective.model_state_bytes,
            total_bytes=round(got) + selective.model_state_bytes,
            device_bytes=result.device_bytes,
            recompute_num_layers=k,
        )

    for k in range(1, lc):
        row = partial_row(k)
        if row.fits:
            result.rows.append(row)
            return RecomputeChoice("full", k, row.total_bytes, result.device_bytes, measured)
    return RecomputeChoice("full", None, full.total_bytes, result.device_bytes, measured)


def _mark_selected(result: Estimate) -> None:
    layout, choice = result.layout, result.choice
    if choice is None:
        key = (layout.sequence_parallel, layout.recompute, None)
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
    """Resolve ``recompute: auto``: the least recomputation with which the most loaded rank's
    model state + first-stage activations fit ``device_bytes`` — ``none``, else
    ``selective``, else ``full`` on the first k layers of every model chunk (the others
    selective) for the smallest k that fits, else ``full`` everywhere (``fits`` is then False).

    ``config.recompute`` is ignored (it may be anything, ``auto`` included — pass the config
    with any valid policy). ``sequence_parallel`` defaults to ``config.sequence_parallel``.
    ``measure``: trace under fake tensors (``None``: when ``torch.distributed`` is not yet
    initialised in this process, since the fake world cannot coexist with a real one;
    otherwise the formulas, which the measurement matches within 0.01%). Deterministic, so
    every rank resolves the same choice.
    """
    import torch.distributed as dist

    if measure is None:
        measure = not (dist.is_available() and dist.is_initialized())
    sp = config.sequence_parallel if sequence_parallel is None else sequence_parallel
    if config.recompute not in RECOMPUTE_POLICIES:
        config = dataclasses.replace(config, recompute="selective")
    t, p = tensor_parallel_size, pipeline_parallel_size
    layout = TrainingLayout(
        config=dataclasses.replace(config, sequence_parallel=sp),
        recompute="auto",
        tensor_parallel_size=t,
        pipeline_parallel_size=p,
        virtual_pipeline_size=virtual_pipeline_size,
        sequence_parallel=sp,
        num_microbatches=num_microbatches,
        devices=t * p * data_parallel_size,
        num_nodes=1,
        batch_size=micro_batch_size * num_microbatches,
    )
    layout.validate()
    choice = estimate(layout, device_bytes, layers=layers, measure=measure).choice
    assert choice is not None
    return choice


# -- output ------------------------------------------------------------------------------------


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f} GB"


def parse_bytes(text: str) -> float:
    """``"80e9"``, ``"80GB"``, ``"80 GiB"``, ``"81920MiB"``, ``"80G"`` -> bytes (G = GB = 10⁹,
    GiB = 2³⁰)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([KMGT]?)(i?)B?\s*", text)
    if match is None:
        raise argparse.ArgumentTypeError(
            f"--device-memory={text!r} is not a size; use e.g. 80GB, 80GiB or 80e9"
        )
    number, prefix, binary = match.groups()
    power = "_KMGT".index(prefix) if prefix else 0
    value = float(number) * (1024 if binary else 1000) ** power
    if value <= 0:
        raise argparse.ArgumentTypeError(f"--device-memory={text!r} must be positive")
    return value


def format_table(result: Estimate) -> str:
    """The human-readable report: the layout, the six rows, Figure 7 and the verdict."""
    layout, cfg = result.layout, result.layout.config
    t, p, m = (
        layout.tensor_parallel_size,
        layout.pipeline_parallel_size,
        layout.virtual_pipeline_size,
    )
    n = layout.num_microbatches
    lif = layers_in_flight(cfg.num_layers, p, m, n)
    mb = 1e6
    lines = [
        f"{layout.source}: GPT {result.model_parameters / 1e9:.1f}B parameters "
        f"(s={cfg.seq_length} h={cfg.hidden_size} a={cfg.num_heads} L={cfg.num_layers} "
        f"v={cfg.vocab_size}, padded {cfg.padded_vocab_size(t)}), "
        f"dropout {cfg.hidden_dropout}/{cfg.attention_dropout}",
        f"layout: t={t} p={p} m={m} d={layout.data_parallel_size} on {layout.world_size} GPUs; "
        f"micro-batch b={layout.micro_batch_size} x {n} micro-batches "
        f"(global batch {layout.global_batch_size})",
        f"first stage: {cfg.num_layers // p} layers ({m} chunk(s) of {layout.layers_per_chunk}), "
        f"holds {lif:g} layers' worth = L x {lif / cfg.num_layers:.4f}"
        + (" (1 + (p-1)/(p*m))" if m > 1 else " (eq. 5)"),
        f"model state per rank: {result.parameters_per_rank / 1e9:.3f}B parameters x "
        f"{MIXED_PRECISION_ADAM.bytes_per_parameter:g} B (bf16 weight 2 + fp32 grad 4 + "
        f"fp32 master 4 + Adam m,v 8) = {_gb(result.rows[0].model_state_bytes)}",
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
            policy = f"full {r.recompute_num_layers}/{layout.layers_per_chunk} + selective"
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
                ]
            )
        )
    lines.append("(* the configured combination, or auto's choice; MB = 10^6 B, GB = 10^9 B)")
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
        paper = 34 * cfg.seq_length * layout.micro_batch_size * cfg.hidden_size / t
        how = "measured" if result.measurements else "by formula"
        lines.append(
            f"SP + selective per layer: {sp_sel.activation_bytes_per_layer:,} B {how} vs "
            f"34sbh/t = {paper:,.0f} B ({sp_sel.activation_bytes_per_layer / paper - 1:+.4%})"
        )
    if result.choice is not None:
        lines.append(result.choice.describe())
    else:
        selected = next((r for r in result.rows if r.selected), None)
        if selected is not None:
            lines.append(
                f"configured: {selected.label}: {_gb(selected.total_bytes)} of "
                f"{_gb(selected.device_bytes)}, {'fits' if selected.fits else 'does NOT fit'}"
            )
    return "\n".join(lines)


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
            else f"full {r.recompute_num_layers}/chunk"
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


# -- command line ------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The ``estimate`` argument parser."""
    parser = argparse.ArgumentParser(
        prog="cli.py estimate",
        description=(
            "Per-GPU memory of a fit config: activations measured on one rank's shard of the "
            "real model under fake tensors (no memory needed), the paper's formulas beside "
            "them, parameters + gradients + Adam state, against the device memory."
        ),
    )
    parser.add_argument("--config", required=True, help="a fit config YAML (configs/gpt175b.yaml)")
    parser.add_argument(
        "--device-memory", type=parse_bytes, default=DEFAULT_DEVICE_BYTES, metavar="SIZE",
        help="memory per GPU: bytes, or 80GB / 80GiB style (default 80GB = 80e9 bytes)",
    )  # fmt: skip
    parser.add_argument("--format", choices=("table", "json"), default="table")
    parser.add_argument("--plot", metavar="FILE.png", help="draw the memory ladder (Figure 7)")
    parser.add_argument(
        "--layers", type=int, default=1,
        help="transformer layers to trace per combination (default 1; all are equal)",
    )  # fmt: skip
    parser.add_argument(
        "--formula-only", action="store_true", help="skip the measurement; formulas only"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """``python cli.py estimate``: print the table (or JSON), optionally plot; return the exit
    status (0, or 2 with a one-line ``error:`` on stderr for a bad config)."""
    args = build_parser().parse_args(argv)
    try:
        if args.layers < 1:
            raise ConfigError(f"--layers={args.layers} must be a positive integer")
        layout = read_layout(args.config)
        result = estimate(
            layout, args.device_memory, layers=args.layers, measure=not args.formula_only
        )
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.format == "json":
        print(json.dumps([r.to_json() for r in result.rows], indent=2))
        if result.choice is not None:
            print(result.choice.describe(), file=sys.stderr)
    else:
        print(format_table(result))
    if args.plot:
        plot_ladder(result, args.plot)
        if args.format == "table":
            print(f"plot: {args.plot}")
    return 0
