"""The time of one training iteration of a :class:`~lightning_sp.planner.layout.Layout` on a
:class:`~lightning_sp.planner.cluster.Cluster`, from its parts (pure, no I/O).

One layer for one micro-batch on one rank is :mod:`lightning_sp.planner.layertime`'s
(:func:`layer_time`: GEMMs, memory-bound kernels, recompute replays, TP / CP / EP
collectives).

Per micro-batch and pipeline stage: its ``L/p`` layers, the embedding on the first stage and
the output layer + loss on the last, and ``2m`` point-to-point transfers of the
``2sbh/t``-byte boundary activation (one forward, one backward per model chunk; without SP
each receive is followed by an all-gather over the TP group, Megatron's scatter/gather
optimisation), not overlapped (interleaved, with the cluster's ``execution.pipeline_overlap``,
each beside the next chunk's forward). Per iteration:

``n·T_max + (p-1)/m·T_mean`` (the slowest stage sets the pace of the steady state; the
pipeline fills and drains through the others: the bubble ``(p-1)/(m·n)`` of the paper;
``n`` is the micro-batches of one step on a rank, the pipeline schedule's or, at ``p = 1``,
Lightning's ``accumulate_grad_batches``, each a whole forward and backward, no bubble)
``+`` the step's one data-parallel gradient reduction, the part that outlasts the last
micro-batch's backward (all of it without ``overlap_grad_reduce``)
(fp32 gradients, summed over the ``d·c`` ranks of dp x cp, a mixture of experts' routed
experts (``1/e`` of them per rank) over the ``d·c/e`` ranks holding the same ones; all-reduce,
or with the distributed optimizer, which shards over those ranks, a reduce-scatter and an
all-gather of the bf16 weights, exposed unless ``execution.param_gather_overlap`` puts it
beside the next iteration's first forward: :func:`parameter_gather_exposed`; each a ring whose
inter-node hops run on the adapters of the group's members in a node,
:func:`~lightning_sp.planner.kernels.spread_gather_seconds`) ``+`` the
all-reduce of the tied embedding's gradient between the first and last stage ``+`` the
optimizer step (memory bound: the gradient norm reads 4 bytes per parameter and zeroing
writes 4; Adam reads the fp32 gradient, master, m and v and writes master, m, v and the bf16
weight, 30 bytes per parameter of its shard).

MFU and HFU are the paper's: model FLOPs (:func:`lightning_sp.memory.flops.
model_flops_per_iteration`) and hardware FLOPs (recomputation included, :func:`lightning_sp.
memory.flops.hardware_flops_per_iteration`) per second per GPU over the dense BF16 peak,
attention counted whole; beside them the model FLOPs with causal attention at half
(Megatron-LM since 2025, MaxText: :func:`lightning_sp.memory.flops.
causal_half_model_flops_per_iteration`).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass

from lightning_sp.memory.flops import (
    causal_half_model_flops_per_iteration,
    hardware_flops_per_iteration,
    model_flops_per_iteration,
)
from lightning_sp.memory.model_state import expert_parameters_per_rank, parameters_per_rank
from lightning_sp.model.config import GPTConfig
from lightning_sp.model.recompute import RecomputePolicy
from lightning_sp.planner.cluster import Cluster
from lightning_sp.planner.kernels import (
    all_reduce_seconds,
    gather_seconds,
    gemm_seconds,
    memory_seconds,
    spread_gather_seconds,
    transfer_seconds,
)
from lightning_sp.planner.layertime import (
    LayerTime,
    cp_exchange_seconds,
    expert_exchange_seconds,
    layer_time,
)
from lightning_sp.planner.layout import Layout
from lightning_sp.planner.ops import (
    ACT,
    backward_gemms,
    embedding_memory_ops,
    head_gemms,
    head_memory_ops,
)

__all__ = [
    "LayerTime",
    "StepTime",
    "cp_exchange_seconds",
    "data_parallel_exposed",
    "expert_exchange_seconds",
    "layer_time",
    "parameter_gather_exposed",
    "step_time",
]

GRAD_BYTES, OPTIMIZER_BYTES, UNSHARDED_STEP_BYTES = 4, 30, 8
"""fp32 gradient bytes per parameter reduced over data parallelism; bytes Adam moves per
parameter of its shard; bytes per parameter of the gradient norm and zeroing."""


def data_parallel_exposed(
    layout: Layout,
    reduce: float,
    layer: LayerTime,
    policies: Counter[RecomputePolicy],
    attention: str,
) -> float:
    """The part of the step's one gradient reduction (``reduce`` seconds) left exposed: with
    ``overlap_grad_reduce`` the buckets launch during the backward of the step's last
    micro-batch (the earlier ones, accumulated by the pipeline schedule or by Lightning, only
    add into the buffer), so what outlasts one micro-batch's backward of the stage's layers;
    without, all of it."""
    if not layout.overlap_grad_reduce:
        return reduce
    last_backward = layout.virtual_pipeline_size * sum(
        k * (sum(layer.backward.values()) + layer.recompute_seconds(pol, attention))
        for pol, k in policies.items()
    )
    return max(0.0, reduce - last_backward)


def parameter_gather_exposed(
    layout: Layout, cluster: Cluster, gather: float, layer: LayerTime
) -> float:
    """The part of the distributed optimizer's parameter all-gather (``gather`` seconds) left
    exposed: all of it, unless the cluster's stack overlaps it with the next iteration's first
    forward (:attr:`~lightning_sp.planner.execution.Execution.param_gather_overlap`), then
    what outlasts one micro-batch's forward of the stage's layers."""
    if not cluster.execution.param_gather_overlap:
        return gather
    first_forward = layout.layers_per_chunk * layout.virtual_pipeline_size
    return max(0.0, gather - first_forward * sum(layer.forward.values()))


@dataclass(frozen=True)
class StepTime:
    """The predicted iteration and its parts (seconds unless named otherwise)."""

    iteration_seconds: float
    tokens_per_second: float
    model_tflops_per_gpu: float
    mfu: float
    """Model FLOPs per second per GPU / peak (the paper's MFU; attention counted whole)."""
    model_tflops_per_gpu_causal_half: float
    """Model TFLOP/s per GPU with causal attention counted at half (Megatron-LM since 2025,
    MaxText: :func:`lightning_sp.memory.flops.causal_half_model_flops_per_iteration`)."""
    mfu_causal_half: float
    """``model_tflops_per_gpu_causal_half`` / peak."""
    hfu: float
    """Hardware FLOPs (recomputation included) per second per GPU / peak."""
    parts: dict[str, float]
    """``pipeline`` (``n·T_max + bubble``), ``bubble``, ``p2p`` (per iteration on the
    slowest stage), ``layer_forward``, ``layer_backward``, ``layer_recompute``, ``tp``,
    ``cp`` and ``ep`` (the experts' all-to-alls) (per iteration, one stage's layers),
    ``dp_exposed``, ``embedding_grad``, ``optimizer``."""
    layer: LayerTime
    """The parts of one layer for one micro-batch."""


def step_time(layout: Layout, cluster: Cluster, config: GPTConfig | None = None) -> StepTime:
    """The iteration time of ``layout`` on ``cluster``; ``config`` (default
    ``layout.config``) fixes the row's ``sequence_parallel`` and recompute policy (no
    ``auto``)."""
    cfg = layout.config if config is None else config
    t, p, m = (
        layout.tensor_parallel_size,
        layout.pipeline_parallel_size,
        layout.virtual_pipeline_size,
    )
    # n: micro-batches per step on one rank, the pipeline's or Lightning's accumulation's
    n, b, d = layout.microbatches_per_step, layout.micro_batch_size, layout.data_parallel_size
    c = layout.context_parallel_size
    sp, s, h = cfg.sequence_parallel, cfg.seq_length // c, cfg.hidden_size  # s: this rank's
    layer = layer_time(layout.shape_of(cfg), cluster)
    chunk = layout.layers_per_chunk
    policies = Counter(cfg.layer_recompute(i) for i in range(chunk))
    per_chunk = sum(k * layer.seconds(policy, cfg.attention) for policy, k in policies.items())
    layers = m * per_chunk
    within_tp = cluster.within_node(t)
    unit = gather_seconds(cluster, ACT * s * b * h, t, within_tp)
    # embedding (first stage) and output layer + loss (last stage)
    emb = (
        sum(
            memory_seconds(cluster, op.forward_bytes + op.backward_bytes)
            for op in embedding_memory_ops(cfg, t, b, sp, c)
        )
        + 2 * unit
    )  # SP: reduce-scatter forward, all-gather backward; else an all-reduce forward
    logits = head_gemms(cfg, t, b, c)[0]
    dgrad, wgrad = (gemm_seconds(cluster, g) for g in backward_gemms(logits))
    head = gemm_seconds(cluster, logits) + dgrad + wgrad
    head += sum(
        memory_seconds(cluster, op.forward_bytes + op.backward_bytes)
        for op in head_memory_ops(cfg, t, b, sp, c)
    )
    head += (unit + max(0.0, unit - wgrad)) if sp else max(0.0, 2 * unit - wgrad)
    # pipeline
    p2p = 0.0
    if p > 1:
        in_node = t * c * d * p <= cluster.gpus_per_node
        one = transfer_seconds(cluster, ACT * s * b * h / t, in_node)
        if not sp:
            one += unit  # scatter/gather: the receiving TP group all-gathers the message
        if m > 1 and cluster.execution.pipeline_overlap:  # beside the next chunk's compute
            one = max(0.0, one - chunk * sum(layer.forward.values()))
        p2p = 2 * m * one
    if p == 1:
        slowest = mean = layers + emb + head
    else:
        slowest = max(layers + emb, layers + head) + p2p
        mean = layers + p2p + (emb + head) / p
    bubble = (p - 1) / m * mean
    pipeline = n * slowest + bubble
    # data parallelism, tied embedding, optimizer
    e = layout.expert_parallel_size
    params = parameters_per_rank(cfg, layout)
    experts = expert_parameters_per_rank(cfg, layout)  # over the d·c/e ranks holding them
    groups = ((params - experts, d * c), (experts, d * c // e))  # (parameters, ranks)
    dp_exposed = 0.0
    if d * c > 1:  # gradients summed over dp x cp (the ranks of one TP / PP position)
        reduce = gather = 0.0
        strides = (t, t * e)  # dp x cp ranks are t apart; an expert-data group's t·e
        for (count, ranks), stride in zip(groups, strides, strict=True):
            near = cluster.members_in_node(stride, ranks)
            one = spread_gather_seconds(cluster, GRAD_BYTES * count, ranks, near)
            if layout.distributed_optimizer:  # sharded over those ranks: scatter, gather
                reduce += one
                gather += spread_gather_seconds(cluster, ACT * count, ranks, near)
            else:
                reduce += 2 * one  # all-reduce: a reduce-scatter and an all-gather
        dp_exposed = data_parallel_exposed(layout, reduce, layer, policies, cfg.attention)
        dp_exposed += parameter_gather_exposed(layout, cluster, gather, layer)
    embedding_grad = 0.0
    if p > 1:
        vocab = cfg.padded_vocab_size(t) // t * h
        in_node = t * c * d * p <= cluster.gpus_per_node
        embedding_grad = all_reduce_seconds(cluster, GRAD_BYTES * vocab, 2, in_node)
    shard = sum(n / r for n, r in groups) if layout.distributed_optimizer else params
    optimizer = memory_seconds(cluster, UNSHARDED_STEP_BYTES * params + OPTIMIZER_BYTES * shard)
    iteration = pipeline + dp_exposed + embedding_grad + optimizer
    # the paper's metrics
    batch, gpus = layout.global_batch_size, layout.world_size
    model = model_flops_per_iteration(cfg, batch)
    half = causal_half_model_flops_per_iteration(cfg, batch)
    part = dataclasses.replace(cfg, num_layers=chunk)  # the recompute pattern repeats per chunk
    redone = hardware_flops_per_iteration(part, batch, chunk, context_parallel_size=c)
    hardware = model + cfg.num_layers // chunk * (redone - model_flops_per_iteration(part, batch))
    per_gpu = 1.0 / (iteration * gpus)
    recompute = m * sum(k * layer.recompute_seconds(p, cfg.attention) for p, k in policies.items())
    parts = {
        "pipeline": pipeline,
        "bubble": bubble,
        "p2p": n * p2p,
        "layer_forward": n * m * chunk * sum(layer.forward.values()),
        "layer_backward": n * m * chunk * sum(layer.backward.values()),
        "layer_recompute": n * recompute,
        "tp": n * m * chunk * (layer.forward["tp"] + layer.backward["tp"]),
        "cp": n * m * chunk * (layer.forward["cp"] + layer.backward["cp"]),
        "ep": n * m * chunk * (layer.forward["ep"] + layer.backward["ep"]),
        "dp_exposed": dp_exposed,
        "embedding_grad": embedding_grad,
        "optimizer": optimizer,
    }
    return StepTime(
        iteration_seconds=iteration,
        tokens_per_second=batch * cfg.seq_length / iteration,
        model_tflops_per_gpu=model * per_gpu / 1e12,
        mfu=model * per_gpu / cluster.peak_flops,
        model_tflops_per_gpu_causal_half=half * per_gpu / 1e12,
        mfu_causal_half=half * per_gpu / cluster.peak_flops,
        hfu=hardware * per_gpu / cluster.peak_flops,
        parts=parts,
        layer=layer,
    )
