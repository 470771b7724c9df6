"""A LoRA run priced next to the full fine-tune of the same layout (``estimate`` with
``model.lora``): model state, activations and step time per GPU. Pure, no I/O.

* **Model state.** The frozen base keeps its weights only (``param_bytes`` per parameter, 2
  for bf16): no gradient, no master copy, no Adam moments. The adapters keep everything mixed
  precision Adam keeps (18 bytes per parameter; the distributed optimizer shards their fp32
  state over the ``d·c`` ranks). Adapter parameters per rank, per adapted linear of ``k``
  inputs and ``n`` outputs: column parallel ``r·k + r·n/t`` (``A`` replicated, ``B`` split),
  row parallel ``r·k/t + r·n``, for the ``L/p`` layers of the fullest stage.
* **Activations.** The formula per layer with the adapters' terms
  (:meth:`~lightning_sp.model.parts.base.Part.adapter_terms`: the low-rank activations and
  dropout masks added, the inputs of frozen linears without adapters left out; measured to the
  byte by ``tests/test_lora_bytes.py``), and the first stage's bytes (eq. 5, interleaving,
  §4.5) as for the full fine-tune. The embedding's and head's extras are the full fine-tune's
  (a frozen output layer keeps its input for the input gradient anyway).
* **Step time.** The full fine-tune's (:func:`~lightning_sp.planner.steptime.step_time`) less
  what a frozen base does not run, plus what the adapters do:

  - per layer, every weight-gradient GEMM (those of the linears; the attention core has none),
    on each stage's ``L/p`` layers for the ``n`` micro-batches and the bubble's
    ``(p-1)/m`` (the per-layer time drops alike on every stage);
  - the tensor-parallel collective each input group's weight-gradient GEMM hid (the
    reduce-scatter of QKV's and fc1's input gradient under SP, the all-reduce without) is
    exposed now: ``min(collective, weight-gradient GEMMs)`` per group comes back;
  - the output layer's weight-gradient GEMM (on the last stage, ``n`` times), its hidden
    collective as above;
  - plus per adapted linear, per micro-batch, its six small GEMMs (forward ``x Aᵀ`` and
    ``low Bᵀ``; backward ``grad B``, ``gradᵀ low``, ``grad_lowᵀ x``, ``grad_low A``), at
    their shapes on one rank;
  - the data-parallel reduction, the tied embedding's all-reduce and the optimizer step
    priced on the adapters alone (the reduction all exposed: it is small), in place of the
    full fine-tune's.

  MFU is not stated for LoRA (the paper's FLOPs count assumes every weight trains).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from lightning_sp.memory.formulas import activation_bytes_per_layer
from lightning_sp.memory.model_state import (
    MIXED_PRECISION_ADAM,
    ModelStatePrecision,
    expert_parameters_per_rank,
    model_state_bytes,
    parameters_per_rank,
)
from lightning_sp.model.config import GPTConfig
from lightning_sp.model.lora import LoRAConfig, with_adapters
from lightning_sp.model.parts.base import Gemm
from lightning_sp.model.parts.block import block_of_shape
from lightning_sp.model.recompute import RecomputePolicy
from lightning_sp.model.shape import ActivationShape
from lightning_sp.parallel.config import ParallelConfig
from lightning_sp.planner.cluster import Cluster
from lightning_sp.planner.kernels import (
    all_reduce_seconds,
    gather_seconds,
    gemm_seconds,
    memory_seconds,
)
from lightning_sp.planner.layout import Layout
from lightning_sp.planner.ops import backward_gemms, head_gemms
from lightning_sp.planner.presets import load_cluster
from lightning_sp.planner.records import EstimateRow
from lightning_sp.planner.rows import first_stage_bytes, formula_activations, optimizer_shards
from lightning_sp.planner.steptime import (
    GRAD_BYTES,
    OPTIMIZER_BYTES,
    UNSHARDED_STEP_BYTES,
    step_time,
)

ACT = 2
"""Bytes per bf16 activation element (the collectives' tensors)."""


@dataclass(frozen=True)
class Priced:
    """One run's bytes and seconds per GPU (the most loaded rank)."""

    trainable_parameters: int
    """Parameters with gradients and optimizer state on the rank."""
    frozen_parameters: int
    """Parameters held as weights only."""
    model_state_bytes: float
    activation_bytes_per_layer: float
    first_stage_activation_bytes: float
    iteration_seconds: float

    @property
    def total_bytes(self) -> float:
        return self.model_state_bytes + self.first_stage_activation_bytes


@dataclass(frozen=True)
class LoRAEstimate:
    """A LoRA run and the full fine-tune of the same layout (:func:`lora_estimate`)."""

    lora: LoRAConfig
    full: Priced
    adapted: Priced
    recompute: RecomputePolicy


def adapter_parameters_per_rank(
    config: GPTConfig, lora: LoRAConfig, layout: ParallelConfig | None = None
) -> int:
    """Adapter parameters on the fullest rank of ``layout`` (None: one rank): per adapted
    linear ``r·k + r·n/t`` (column) or ``r·k/t + r·n`` (row), for ``L/p`` layers."""
    layout = ParallelConfig() if layout is None else layout
    shape = with_adapters(config.activation_shape(layout), lora, config)
    assert shape.lora is not None
    r, t, per_layer = lora.r, shape.t, 0
    for sub in block_of_shape(shape).sublayers:
        for lin in sub.mixer.linears(shape):
            if f"{sub.name}.{lin.name}" in shape.lora.targets:
                k, n = (
                    (lin.width, lin.outputs // t)
                    if lin.kind == "column"
                    else (lin.width // t, lin.outputs)
                )
                per_layer += r * (k + n)
    return config.num_layers // layout.pipeline_parallel_size * per_layer


def _adapter_gemms(shape: ActivationShape, config: GPTConfig, rows: int) -> list[Gemm]:
    """Each adapter's six GEMMs per micro-batch on one rank (``rows`` = ``s·b/c``, the
    whole sequence's: column adapters read the gathered input, row ones their shard)."""
    assert shape.lora is not None
    r, t, out = shape.lora.r, shape.t, []
    for sub in block_of_shape(shape).sublayers:
        for lin in sub.mixer.linears(shape):
            if f"{sub.name}.{lin.name}" not in shape.lora.targets:
                continue
            k, n = (
                (lin.width, lin.outputs // t)
                if lin.kind == "column"
                else (lin.width // t, lin.outputs)
            )
            out += [
                Gemm("lora_a", rows, r, k), Gemm("lora_b", rows, n, r),  # forward
                Gemm("lora_grad_low", rows, r, n), Gemm("lora_grad_b", n, r, rows),
                Gemm("lora_grad_a", r, k, rows), Gemm("lora_grad_x", rows, k, r),
            ]  # fmt: skip
    return out


def _hidden_collective(cluster: Cluster, layout: Layout, config: GPTConfig, wgrad: float) -> float:
    """What a weight-gradient GEMM of ``wgrad`` seconds hid of the input gradient's TP
    reduction (reduce-scatter under SP, all-reduce without; 0 at t = 1)."""
    t, c = layout.tensor_parallel_size, layout.context_parallel_size
    s = config.seq_length // c
    unit = gather_seconds(
        cluster, ACT * s * layout.micro_batch_size * config.hidden_size, t, cluster.within_node(t)
    )
    collective = unit if config.sequence_parallel else 2 * unit
    return min(collective, wgrad)


def _layer_saving(
    cluster: Cluster, layout: Layout, config: GPTConfig, shape: ActivationShape
) -> float:
    """Seconds one layer's backward saves per micro-batch with its base frozen, less what the
    adapters' GEMMs add (see the module docstring)."""
    block = block_of_shape(shape)
    wgrad = {
        g.name: gemm_seconds(cluster, backward_gemms(g)[1]) for g in block.gemms(shape) if not g.tag
    }
    saved = sum(wgrad.values())
    for group in block.input_gemms():
        saved -= _hidden_collective(cluster, layout, config, sum(wgrad.get(n, 0.0) for n in group))
    rows = config.seq_length // layout.context_parallel_size * layout.micro_batch_size
    added = sum(gemm_seconds(cluster, g) for g in _adapter_gemms(shape, config, rows))
    return saved - added


def lora_estimate(
    layout: Layout,
    lora: LoRAConfig,
    cluster: Cluster | str | None = None,
    precision: ModelStatePrecision = MIXED_PRECISION_ADAM,
) -> LoRAEstimate:
    """``layout`` priced twice, as a full fine-tune and with ``lora``'s adapters on its frozen
    base, under its configured recompute policy (``auto``: ``selective``), by formula."""
    hardware = load_cluster(cluster)
    config = layout.config
    if config.recompute.auto:
        config = dataclasses.replace(config, recompute=RecomputePolicy.parse("selective"))
    recompute = config.recompute
    t, p, m = (
        layout.tensor_parallel_size,
        layout.pipeline_parallel_size,
        layout.virtual_pipeline_size,
    )
    n, d = layout.microbatches_per_step, layout.data_parallel_size
    params = parameters_per_rank(config, layout)
    adapters = adapter_parameters_per_rank(config, lora, layout)
    shards, zero = optimizer_shards(layout), layout.distributed_optimizer
    full_acts = formula_activations(layout, config)
    shape = with_adapters(layout.shape_of(config), lora, config)
    lora_per_layer = activation_bytes_per_layer(shape, recompute)
    lora_acts = dataclasses.replace(full_acts, per_layer=lora_per_layer)
    layers = [full_acts.per_layer] * layout.layers_per_chunk
    adapted_layers = [lora_per_layer] * layout.layers_per_chunk

    e = layout.expert_parallel_size
    experts = expert_parameters_per_rank(config, layout)  # sharded over d·c/e, as estimate's
    full_state = model_state_bytes(params - experts, precision, shards, zero)
    full_state += model_state_bytes(experts, precision, shards // e, zero)
    lora_state = model_state_bytes(adapters, precision, shards, zero)
    lora_state += params * precision.param_bytes  # the frozen base: weights only

    full_time = step_time(layout, hardware, config)
    parts = full_time.parts
    layer = _layer_saving(hardware, layout, config, shape)
    seconds = parts["pipeline"] - (n + (p - 1) / m) * config.num_layers / p * layer
    logits = head_gemms(config, t, layout.micro_batch_size, layout.context_parallel_size)[0]
    head_wgrad = gemm_seconds(hardware, backward_gemms(logits)[1])
    seconds -= n * (head_wgrad - _hidden_collective(hardware, layout, config, head_wgrad))
    reduce = 0.0
    if d * layout.context_parallel_size > 1:
        ranks = d * layout.context_parallel_size
        reduce = all_reduce_seconds(
            hardware, GRAD_BYTES * adapters, ranks, hardware.within_node(t * ranks)
        )
    shard = adapters / shards if zero else adapters
    optimizer = memory_seconds(hardware, UNSHARDED_STEP_BYTES * adapters + OPTIMIZER_BYTES * shard)
    seconds += reduce + optimizer
    full = Priced(
        trainable_parameters=params,
        frozen_parameters=0,
        model_state_bytes=full_state,
        activation_bytes_per_layer=full_acts.per_layer,
        first_stage_activation_bytes=first_stage_bytes(layout, layers, full_acts),
        iteration_seconds=full_time.iteration_seconds,
    )
    adapted = Priced(
        trainable_parameters=adapters,
        frozen_parameters=params,
        model_state_bytes=lora_state,
        activation_bytes_per_layer=lora_per_layer,
        first_stage_activation_bytes=first_stage_bytes(layout, adapted_layers, lora_acts),
        iteration_seconds=seconds,
    )
    return LoRAEstimate(lora=lora, full=full, adapted=adapted, recompute=recompute)


def lora_row(row: EstimateRow, layout: Layout, lora: LoRAConfig, cluster: Cluster) -> EstimateRow:
    """``row`` (of ``layout``, whose config has the row's SP and recompute policy) priced as
    the LoRA run :func:`lora_estimate` prices: its model state, activations and iteration
    time, tokens per second from that time; MFU and HFU 0 (not stated for LoRA: the paper's
    FLOPs count assumes every weight trains). What ``estimate --search`` ranks a LoRA run
    by."""
    adapted = lora_estimate(layout, lora, cluster).adapted
    seconds = adapted.iteration_seconds
    tokens = layout.global_batch_size * layout.config.seq_length
    return dataclasses.replace(
        row,
        activation_bytes_per_layer=int(adapted.activation_bytes_per_layer),
        formula_bytes_per_layer=int(adapted.activation_bytes_per_layer),
        first_stage_activation_bytes=int(adapted.first_stage_activation_bytes),
        formula_first_stage_activation_bytes=int(adapted.first_stage_activation_bytes),
        model_state_bytes=int(adapted.model_state_bytes),
        total_bytes=int(adapted.total_bytes),
        iteration_seconds=seconds,
        tokens_per_second=tokens / seconds,
        model_tflops_per_gpu=0.0,
        mfu=0.0,
        model_tflops_per_gpu_causal_half=0.0,
        mfu_causal_half=0.0,
        hfu=0.0,
    )


def lora_note(lora: LoRAConfig) -> str:
    """The line ``estimate --search`` prints under its header for a LoRA run."""
    return (
        f"LoRA r={lora.r} on {', '.join(lora.target_modules)}: memory and step of the LoRA "
        "run (frozen base: weights only; adapters trained), by formula; MFU and HFU not "
        "stated (0)"
    )


def format_lora(result: LoRAEstimate) -> str:
    """The two runs side by side, per GPU (GB = 10^9 B, as the estimate's table; seconds)."""
    gb = 1e9
    rows = [
        ("trainable parameters", "trainable_parameters", 1e9, "B", ".3f"),
        ("model state", "model_state_bytes", gb, "GB", ".2f"),
        ("activations per layer", "activation_bytes_per_layer", gb, "GB", ".4f"),
        ("first-stage activations", "first_stage_activation_bytes", gb, "GB", ".2f"),
        ("total", "total_bytes", gb, "GB", ".2f"),
        ("iteration", "iteration_seconds", 1.0, "s", ".3f"),
    ]
    lora = result.lora
    lines = [
        f"LoRA r={lora.r} on {', '.join(lora.target_modules)} (recompute {result.recompute}, "
        "by formula), per GPU:",
        f"  {'':26}{'full fine-tune':>16}{'LoRA':>16}",
    ]
    for label, attr, scale, unit, fmt in rows:
        a, b = getattr(result.full, attr) / scale, getattr(result.adapted, attr) / scale
        lines.append(f"  {label:26}{a:>12{fmt}} {unit:<3}{b:>12{fmt}} {unit:<3}")
    return "\n".join(lines)
