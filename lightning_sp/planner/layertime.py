"""The time of one transformer layer for one micro-batch on one rank, from its parts (pure,
no I/O): :func:`layer_time` and its :class:`LayerTime`, the pieces
:func:`lightning_sp.planner.steptime.step_time` assembles into an iteration.

Per transformer layer and micro-batch, on one rank (:mod:`lightning_sp.planner.ops` lists the
kernels, :mod:`lightning_sp.planner.kernels` times them):

* **compute**: the forward GEMMs; backward, a data- and a weight-gradient GEMM for each; with
  ``attention: sdpa`` the attention core is one fused kernel instead of two GEMMs and the
  softmax/dropout kernels (its attention dropout at the cluster's
  ``flash_attention_dropout_cost``);
* **memory-bound kernels**: LayerNorms, bias-dropout-adds, GeLU, softmax, attention dropout;
* **recompute** in backward: ``full`` replays the layer's forward (its TP collectives
  included); a module set replays, for each active module, the kernels tagged with it, the
  GEMMs scaled to the FLOPs the module's descriptor says it redoes
  (:data:`lightning_sp.model.recompute.RECOMPUTE_MODULES`);
* **tensor-parallel collectives** (Megatron's placement and overlap, plus what a part runs
  itself, exposed, each priced by its kind: :func:`lightning_sp.planner.ops.layer_collectives`):
  without SP, an all-reduce of the ``2sbh``-byte activation after the projection and after
  fc2 (exposed) and in backward before QKV and fc1 (overlapped with their weight-gradient
  GEMMs: only what outlasts the GEMM is exposed); with SP, an all-gather before QKV and fc1 and a
  reduce-scatter after the projection and fc2 (exposed), in backward the all-gathers of the
  gradient entering the projection and fc2 (exposed), the re-gather of QKV's and fc1's
  input (overlapped with the data-gradient GEMM) and the reduce-scatter of their input
  gradient (overlapped with the weight-gradient GEMM); with the cluster's
  ``execution.tensor_parallel_overlap`` the exposed ones run in ``t`` chunks beside the GEMM
  they feed or drain (:meth:`~lightning_sp.planner.execution.Execution.overlapped`);
* **context parallelism** (``c > 1``, :mod:`lightning_sp.parallel.context_attention`): every
  kernel above runs on the rank's ``s/c`` tokens; the attention core is the CP core's, rank
  0's two chunks against their key prefixes (``(2c+1)·L²`` query-key pairs per head, ``L =
  s/(2c)``, dense masked blocks: :func:`lightning_sp.planner.ops.attention_pairs`), and its
  backward first replays its forward (whatever the recompute policy; ``core_attn`` does not
  act under CP). Its exchanges are what the code runs: forward one all-gather of this TP
  rank's K and V (``2·b·(g'/t)·s·d`` elements in all, GQA's KV heads only), backward one
  all-gather and one reduce-scatter of the same size, each over the CP group (NVLink when the
  ``t·c`` ranks of a TP x CP block share a node, else the network), none overlapped (the
  code calls them before and after the core, synchronously: no ring of per-chunk transfers to
  hide behind compute, as Megatron/TransformerEngine's ring would).
* **expert parallelism** (``e > 1``, a mixture-of-experts layer at balanced routing, or on
  its busiest rank at ``execution.expert_load_imbalance``: the GEMMs and kernels a part marks
  ``routed`` and the all-to-alls scaled by it): each
  rank's ``E/e`` experts run as a batch of GEMMs of ``k·T/E·e`` rows each (``T`` the tokens a
  rank routes: ``s·b/c``, ``/t`` under SP) at the experts' weight shapes, their SwiGLU and
  the dispatch's and combine's row copies as memory-bound kernels
  (:meth:`~lightning_sp.model.moe.part.MoEFeedForward.memory_ops`); the dispatch and
  combine all-to-alls (forward, and their adjoints in backward; none overlapped) each send
  ``(e-1)/e`` of the rank's ``k·T`` rows, the shares for EP peers in the rank's node over
  NVLink and those for peers in other nodes over the network at once
  (:func:`expert_exchange_seconds`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from lightning_sp.model.cores import ATTENTION_BACKENDS
from lightning_sp.model.parts.block import block_of_shape
from lightning_sp.model.recompute import (
    RECOMPUTE_MODULES,
    RecomputePolicy,
    active_modules,
)
from lightning_sp.model.shape import ActivationShape
from lightning_sp.planner.cluster import Cluster
from lightning_sp.planner.fp8 import check_fp8_cluster, fp8_gemm_seconds
from lightning_sp.planner.kernels import (
    all_to_all_seconds,
    collective_seconds,
    flash_attention_seconds,
    gather_seconds,
    gemm_seconds,
    masked_attention_seconds,
    memory_seconds,
)
from lightning_sp.planner.ops import (
    ACT,
    CP_CORE,
    Gemm,
    MemoryOp,
    attention_pairs,
    backward_gemms,
    layer_collectives,
    layer_gemms,
    layer_memory_ops,
)


@dataclass(frozen=True)
class LayerTime:
    """Seconds of one transformer layer for one micro-batch on one rank."""

    forward: dict[str, float]
    """``gemm``, ``attention`` (the core: GEMMs + softmax/dropout, or the fused kernel),
    ``memory`` (the other memory-bound kernels), ``tp`` (exposed collectives), ``cp`` (the
    context-parallel K/V exchange, 0 without CP)."""

    backward: dict[str, float]
    """The same parts of backward (before any recompute)."""

    replays: dict[str, float] = field(default_factory=dict)
    """Recompute module -> seconds its replay adds to backward."""

    def recompute_seconds(self, policy: str | RecomputePolicy, attention: str) -> float:
        """What ``policy`` (a layer's, by :meth:`GPTConfig.layer_recompute`) adds to
        backward."""
        parsed = RecomputePolicy.parse(policy).check_resolved()
        if parsed.full:
            return sum(self.forward.values())
        return sum(self.replays[m.name] for m in active_modules(parsed.modules, attention))

    def seconds(self, policy: str | RecomputePolicy, attention: str) -> float:
        """Forward + backward + recompute under ``policy``."""
        return (
            sum(self.forward.values())
            + sum(self.backward.values())
            + self.recompute_seconds(policy, attention)
        )


_LAYER_TIMES: dict[tuple[ActivationShape, str, Cluster], LayerTime] = {}
"""Memo of :func:`layer_time` by ``(shape, repr(shape's block), cluster)``: a search asks for
the same layer under many layouts (the recompute policy does not enter it)."""


def layer_time(shape: ActivationShape, cluster: Cluster) -> LayerTime:
    """The parts of one layer of ``shape`` (a model laid out at a micro-batch, its
    ``sequence_parallel`` and ``attention`` included: :meth:`GPTConfig.activation_shape`) on
    ``cluster`` (memoised)."""
    key = (shape, repr(block_of_shape(shape)), cluster)
    if key not in _LAYER_TIMES:
        if len(_LAYER_TIMES) > 4096:
            _LAYER_TIMES.clear()
        _LAYER_TIMES[key] = _layer_time(shape, cluster)
    return _LAYER_TIMES[key]


def expert_exchange_seconds(shape: ActivationShape, cluster: Cluster) -> float:
    """One all-to-all of the ``k·s·b/(c·t)`` rows (SP) a rank dispatches to experts, at
    balanced routing, over the ``e`` ranks of its EP group: ``1/e`` of them stay, the shares
    of the other members of its node go over NVLink and those of members on other nodes over
    the network (the group is ``e`` ranks ``t`` apart:
    :meth:`~lightning_sp.planner.cluster.Cluster.members_in_node`;
    :func:`~lightning_sp.planner.kernels.all_to_all_seconds`); 0 for ``e = 1`` or a dense
    layer. The combine moves as many rows back."""
    nbytes = block_of_shape(shape).dispatch_bytes(shape)
    e = shape.e
    if e == 1 or not nbytes:
        return 0.0
    return all_to_all_seconds(cluster, nbytes, e, cluster.members_in_node(shape.t, e))


def cp_exchange_seconds(shape: ActivationShape, cluster: Cluster) -> float:
    """One all-gather (or reduce-scatter) of this TP rank's K and V over the CP group: the
    gathered ``[2, b, g'/t, s, d]`` tensor, ``g' = max(g, t)``, over ``c`` ranks (NVLink when
    the ``t·c`` ranks of a TP x CP block share a node)."""
    t, c = shape.t, shape.c
    nbytes = ACT * 2 * shape.b * (shape.kv_heads // t) * shape.s * shape.head_dim
    return gather_seconds(cluster, nbytes, c, cluster.within_node(t * c))


def _core_seconds(
    shape: ActivationShape,
    cluster: Cluster,
    gemms: dict[str, Gemm],
    secs: tuple[dict[str, float], dict[str, float], dict[str, float]],
    core_memory: list[MemoryOp],
) -> tuple[float, float]:
    """``(forward, backward)`` of the attention core; under CP the backward includes the CP
    core's replay of its forward."""
    fwd_secs, dgrad, wgrad = secs
    c = shape.c
    core = [name for name, g in gemms.items() if g.tag in ("core_attn", CP_CORE)]
    if ATTENTION_BACKENDS[shape.attention].keeps_scores:  # math: GEMMs, softmax / dropout
        forward = sum(fwd_secs[n] for n in core) + sum(
            memory_seconds(cluster, op.forward_bytes) for op in core_memory
        )
        backward = sum(dgrad[n] + wgrad[n] for n in core) + sum(
            memory_seconds(cluster, op.backward_bytes) for op in core_memory
        )
    elif c == 1:  # one fused kernel; its backward's own recomputation of QKᵀ is inside
        scores = gemms[core[0]]
        forward, backward = flash_attention_seconds(
            cluster, scores.m, scores.k, scores.batch, shape.attention_dropout
        )
    else:  # the CP chunks: fused kernels under a mask, every pair computed
        scores = gemms[core[0]]
        pairs = attention_pairs(shape.s, c)
        forward, backward = masked_attention_seconds(cluster, pairs, scores.k, scores.batch)
    return forward, backward + (forward if c > 1 else 0.0)


def _layer_time(shape: ActivationShape, cluster: Cluster) -> LayerTime:
    t, c, sp, block = shape.t, shape.c, shape.sequence_parallel, block_of_shape(shape)
    skew = cluster.execution.expert_load_imbalance  # the busiest EP rank's routed tokens
    gemms = {g.name: g for g in layer_gemms(shape)}
    timed = {name: _busiest(g, skew) for name, g in gemms.items()}
    grads = {name: backward_gemms(g) for name, g in timed.items()}
    secs = {name: gemm_seconds(cluster, g) for name, g in timed.items()}
    dgrad = {name: gemm_seconds(cluster, d) for name, (d, _) in grads.items()}
    wgrad = {name: gemm_seconds(cluster, w) for name, (_, w) in grads.items()}
    core_tags = ("core_attn", CP_CORE)
    core = [name for name, g in gemms.items() if g.tag in core_tags]
    if shape.fp8 is not None:  # the linears' GEMMs in float8 (but the core's and the router's)
        check_fp8_cluster(cluster, shape.fp8)
        for name in (n for n in gemms if n not in core and not gemms[n].high_precision):
            (dg, wg), price = grads[name], fp8_gemm_seconds
            secs[name] = price(cluster, timed[name])
            dgrad[name], wgrad[name] = price(cluster, dg), price(cluster, wg)
    ops = [_busiest_op(op, skew) for op in layer_memory_ops(shape)]
    core_memory = [op for op in ops if op.tag in core_tags]
    attn_fwd, attn_bwd = _core_seconds(shape, cluster, gemms, (secs, dgrad, wgrad), core_memory)
    others = [op for op in ops if op.tag not in core_tags]
    dense = [name for name in gemms if name not in core]
    unit = gather_seconds(
        cluster, ACT * shape.s // c * shape.b * shape.h, t, cluster.within_node(t)
    )
    exchange = cp_exchange_seconds(shape, cluster) if c > 1 else 0.0
    experts = skew * expert_exchange_seconds(shape, cluster)
    # the input linears of attention and of the MLP (fc1, or SwiGLU's gate and up run as one)
    inputs = block.input_gemms()
    in_dgrad = [sum(dgrad[n] for n in names) for names in inputs]
    in_wgrad = [sum(wgrad[n] for n in names) for names in inputs]
    if sp:  # all-gather before qkv/fc1, reduce-scatter after projection/fc2
        # beside the GEMM each feeds or drains (exposed unless the stack pipelines them)
        outputs = _output_gemms(shape, inputs)
        run = cluster.execution
        fed = [sum(secs[n] for n in names) for names in (*inputs, *outputs)]
        drained = [sum(dgrad[n] for n in names) for names in outputs]  # the gradient's gather
        tp_fwd = sum(run.overlapped(unit, g, t) for g in fed)
        tp_bwd = sum(run.overlapped(unit, g, t) for g in drained) + sum(
            max(0.0, unit - dg) + max(0.0, unit - wg)
            for dg, wg in zip(in_dgrad, in_wgrad, strict=True)
        )
    else:  # all-reduce after projection/fc2; backward's before qkv/fc1 overlap wgrad
        tp_fwd = 4 * unit
        tp_bwd = sum(max(0.0, 2 * unit - wg) for wg in in_wgrad)
    for col in layer_collectives(shape):  # a part's own (exposed)
        one = collective_seconds(cluster, col, t, cluster.within_node(t))
        tp_fwd, tp_bwd = tp_fwd + col.forward * one, tp_bwd + col.backward * one
    forward = {
        "gemm": sum(secs[n] for n in dense),
        "attention": attn_fwd,
        "memory": sum(memory_seconds(cluster, op.forward_bytes) for op in others),
        "tp": tp_fwd,
        "cp": exchange,
        "ep": 2 * experts,  # dispatch and combine
    }
    backward = {
        "gemm": sum(dgrad[n] + wgrad[n] for n in dense),
        "attention": attn_bwd,
        "memory": sum(memory_seconds(cluster, op.backward_bytes) for op in others),
        "tp": tp_bwd,
        "cp": 2 * exchange,  # the all-gather again and the reduce-scatter of dK/dV
        "ep": 2 * experts,  # the combine's and the dispatch's adjoints
    }
    return LayerTime(forward, backward, _replays(shape, cluster, gemms, secs, ops))


def _busiest(gemm: Gemm, skew: float) -> Gemm:
    """``gemm`` on the busiest expert-parallel rank: a routed GEMM's rows times ``skew``
    (the tokens it receives over the mean); any other as it is."""
    if not gemm.routed or skew == 1:
        return gemm
    return dataclasses.replace(gemm, m=math.ceil(gemm.m * skew))


def _busiest_op(op: MemoryOp, skew: float) -> MemoryOp:
    """``op`` on the busiest expert-parallel rank: a routed kernel's bytes times ``skew``."""
    if not op.routed or skew == 1:
        return op
    replay = None if op.replay_bytes is None else op.replay_bytes * skew
    return dataclasses.replace(
        op, forward_bytes=op.forward_bytes * skew, backward_bytes=op.backward_bytes * skew,
        replay_bytes=replay,
    )  # fmt: skip


def _output_gemms(
    shape: ActivationShape, inputs: tuple[tuple[str, ...], ...]
) -> tuple[tuple[str, ...], ...]:
    """Per sublayer, the mixer's GEMMs that are neither its inputs nor the attention core:
    the row-parallel output (projection, fc2) whose result the reduce-scatter takes."""
    core_tags = ("core_attn", CP_CORE)
    return tuple(
        tuple(
            g.name for g in sub.mixer.gemms(shape) if g.name not in names and g.tag not in core_tags
        )
        for sub, names in zip(block_of_shape(shape).sublayers, inputs, strict=True)
    )


def _replays(
    shape: ActivationShape,
    cluster: Cluster,
    gemms: dict[str, Gemm],
    secs: dict[str, float],
    ops: list[MemoryOp],
) -> dict[str, float]:
    """Seconds each recompute module's replay takes: its tagged memory kernels, and its tagged
    GEMMs scaled to the FLOPs its descriptor redoes (per rank: ``/(t·c)``). Under CP
    ``core_attn`` replays nothing (the model leaves the CP core, which replays itself, alone)."""
    t, c = shape.t, shape.c
    replays = {}
    for name, module in RECOMPUTE_MODULES.items():
        if c > 1 and module.needs_scores:
            replays[name] = 0.0
            continue
        tagged = [n for n, g in gemms.items() if g.tag == name]
        flops = sum(gemms[n].flops for n in tagged)
        redone = module.redone_flops(shape) / (t * c)
        if redone and not flops:
            raise ValueError(f"recompute module {name} redoes FLOPs but tags no GEMM")
        seconds = sum(secs[n] for n in tagged) * (redone / flops) if flops else 0.0
        seconds += sum(memory_seconds(cluster, op.replayed) for op in ops if op.tag == name)
        replays[name] = seconds
    return replays
