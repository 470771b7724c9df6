"""A DPO run's reference model priced beside the policy (``estimate`` with ``model.dpo``):
what the reference adds per iteration and per GPU to the fit run's estimate. Pure, no I/O.

By reference kind (``dpo.reference`` resolved, :mod:`lightning_sp.training.dpo`):

* ``copy``: a frozen copy of the starting weights in the policy's layout: its weights only
  (``param_bytes`` per parameter of the fullest rank: no gradient, no optimizer state), and one
  forward of the global batch;
* ``adapters`` (LoRA): the policy with its adapters off: the same forward, no weights;
* ``precomputed``: nothing per step (the reference log-probabilities were computed once, before
  training, by one such forward over the prepared data).

The forward's FLOPs are :func:`~lightning_sp.memory.flops.forward_flops_per_iteration` (the
matmuls of the whole model over the global batch: a third of the model FLOPs of a step
without recompute). Its seconds per GPU are the layer's forward
(:func:`~lightning_sp.planner.layertime.layer_time`, its exposed TP and CP collectives
included) on each stage's ``L/p`` layers for the ``n`` micro-batches and the forward
schedule's ``(p-1)/m`` bubble, plus per micro-batch the model's ends: the output layer's
logits GEMM, the final norm and the vocab-parallel cross entropy's forward passes over the
``s·b·v/t`` logits (the reference's per-token log-probabilities are that cross entropy's,
:func:`~lightning_sp.model.sequence_logps.sequence_logps`: 38 bytes a logit,
:func:`~lightning_sp.planner.ops.head_memory_ops`), the embedding's forward
(:func:`~lightning_sp.planner.ops.embedding_memory_ops`) and their TP collectives (under SP
the embedding's reduce-scatter and the head's all-gather, without it the embedding's
all-reduce); with a pipeline the embedding is on the first stage and the head on the last,
so the slower of the two is on the steady state's path, as in
:func:`~lightning_sp.planner.steptime.step_time`.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_sp.memory.flops import forward_flops_per_iteration
from lightning_sp.memory.model_state import (
    MIXED_PRECISION_ADAM,
    ModelStatePrecision,
    parameters_per_rank,
)
from lightning_sp.planner.cluster import Cluster
from lightning_sp.planner.kernels import gather_seconds, gemm_seconds, memory_seconds
from lightning_sp.planner.layertime import layer_time
from lightning_sp.planner.layout import Layout
from lightning_sp.planner.ops import ACT, embedding_memory_ops, head_gemms, head_memory_ops
from lightning_sp.planner.presets import load_cluster

KINDS = ("copy", "adapters", "precomputed")
"""The resolved reference kinds (``auto`` resolved by the run: ``adapters`` with LoRA, else
``copy``)."""


@dataclass(frozen=True)
class ReferenceCost:
    """What the reference adds to one iteration (:func:`reference_cost`)."""

    kind: str
    """``copy``, ``adapters`` or ``precomputed``."""
    forward_flops: float
    """Matmul FLOPs of the reference forward per iteration, over every GPU (0: precomputed)."""
    weight_bytes: float
    """The frozen copy's weights on the fullest GPU (0 unless ``copy``)."""
    seconds: float
    """The reference forward's seconds per iteration on a GPU (0: precomputed)."""


def reference_cost(
    layout: Layout,
    kind: str,
    cluster: Cluster | str | None = None,
    precision: ModelStatePrecision = MIXED_PRECISION_ADAM,
) -> ReferenceCost:
    """The reference of ``kind`` (one of :data:`KINDS`) for ``layout``'s run (see the module
    docstring)."""
    if kind not in KINDS:
        raise ValueError(f"reference kind {kind!r} is not one of {', '.join(KINDS)}")
    if kind == "precomputed":
        return ReferenceCost(kind, 0.0, 0.0, 0.0)
    hardware = load_cluster(cluster)
    config = layout.config
    t, p, m = (
        layout.tensor_parallel_size,
        layout.pipeline_parallel_size,
        layout.virtual_pipeline_size,
    )
    b, c, n = layout.micro_batch_size, layout.context_parallel_size, layout.microbatches_per_step
    layer = sum(layer_time(layout.shape_of(config), hardware).forward.values())
    sp, s = config.sequence_parallel, config.seq_length // c  # s: this rank's tokens
    # one TP collective of the [s, b, h] activation at each end (module docstring)
    unit = gather_seconds(hardware, ACT * s * b * config.hidden_size, t, hardware.within_node(t))
    head = gemm_seconds(hardware, head_gemms(config, t, b, c)[0]) + sum(
        memory_seconds(hardware, op.forward_bytes) for op in head_memory_ops(config, t, b, sp, c)
    )
    embedding = sum(
        memory_seconds(hardware, op.forward_bytes)
        for op in embedding_memory_ops(config, t, b, sp, c)
    )
    head, embedding = head + (unit if sp else 0.0), embedding + (unit if sp else 2 * unit)
    ends = head + embedding if p == 1 else max(head, embedding)
    seconds = (n + (p - 1) / m) * config.num_layers / p * layer + n * ends
    weights = 0.0
    if kind == "copy":
        weights = parameters_per_rank(config, layout) * precision.param_bytes
    flops = forward_flops_per_iteration(config, layout.global_batch_size)
    return ReferenceCost(kind, flops, weights, seconds)


def format_reference(cost: ReferenceCost) -> str:
    """One line per quantity (GB = 10^9 B, as the estimate's table)."""
    if cost.kind == "precomputed":
        return (
            "DPO reference precomputed: no weights, no forward per step (one pass before training)"
        )
    return (
        f"DPO reference {cost.kind}: forward {cost.forward_flops / 1e12:.4g} TFLOP per "
        f"iteration (all GPUs), {cost.seconds:.4g} s per iteration, weights "
        f"{cost.weight_bytes / 1e9:.4g} GB per GPU"
    )
