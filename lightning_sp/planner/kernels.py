"""Seconds per kernel on a :class:`~lightning_sp.planner.cluster.Cluster`: GEMMs, memory-bound
kernels, fused attention, ring collectives and point-to-point transfers.

The GEMM model (a roofline with quantization, after NVIDIA's *Matrix Multiplication Background
User's Guide*): the output is cut into ``gemm_tile`` tiles (either orientation, whichever
quantizes better), one thread block per tile, run in waves of ``num_sms`` blocks; a shape
reaches ``gemm_efficiency x (useful tile area) / (waves x num_sms x tile area)`` of the peak
FLOP/s. The time is that compute time or the time to move its operands and result through
HBM once, whichever is longer. A calibration table's measured time replaces the model for
the exact shapes it has.

Collectives are NCCL's ring algorithm, bandwidth terms only (the messages here are megabytes,
where per-step latency is well under 1%): all-gather and reduce-scatter of a tensor of ``N``
bytes over ``g`` ranks move ``(g-1)/g·N`` bytes per GPU, all-reduce twice that, at the
achievable rate of the slowest link in the group (NVLink if the group is inside one node).
An all-to-all (expert parallelism's dispatch and combine) sends each peer its own share
directly: the shares for peers in the node over NVLink, those for other nodes over the
network, at the same time.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from lightning_sp.planner.cluster import Cluster
from lightning_sp.planner.ops import Collective, CollectiveKind, Gemm


def wave_efficiency(cluster: Cluster, m: int, n: int, batch: int = 1) -> float:
    """Fraction of the thread-block slots doing useful work for an ``m x n`` output (``batch``
    of them): tile quantization times wave quantization, the better of the two tile
    orientations."""
    best = 0.0
    rows, cols = cluster.gemm_tile
    for tr, tc in ((rows, cols), (cols, rows)):
        tiles = math.ceil(m / tr) * math.ceil(n / tc) * batch
        waves = math.ceil(tiles / cluster.num_sms)
        best = max(best, m * n * batch / (waves * cluster.num_sms * tr * tc))
    return best


def gemm_seconds(cluster: Cluster, gemm: Gemm) -> float:
    """Seconds of one GEMM: measured if the calibration has its shape, else the roofline
    ``max(flops / (peak x gemm_efficiency x wave_efficiency), bytes / memory rate)``."""
    measured = cluster.calibration.lookup("gemm", gemm.m, gemm.n, gemm.k, gemm.batch)
    if measured is not None:
        return measured
    compute = gemm.flops / (
        cluster.gemm_flops * wave_efficiency(cluster, gemm.m, gemm.n, gemm.batch)
    )
    return max(compute, gemm.bytes / cluster.memory_rate)


def memory_seconds(cluster: Cluster, nbytes: float) -> float:
    """Seconds to stream ``nbytes`` through HBM at the achievable rate."""
    return nbytes / cluster.memory_rate


def flash_attention_seconds(
    cluster: Cluster, seq: int, head_dim: int, heads: int, dropout: bool = False
) -> tuple[float, float]:
    """``(forward, backward)`` seconds of a fused causal attention kernel over ``heads``
    (micro-batch x heads per rank) heads: measured if calibrated, else the FLOPs it executes
    (causal: half of ``4·s²·d`` per head forward; backward 2.5x forward, five matmuls to two,
    one of them the recomputed ``QKᵀ``) at ``flash_attention_efficiency`` of the peak. With
    ``dropout`` (attention dropout inside the kernel) both times ``x
    flash_attention_dropout_cost`` (the calibration table's times are without dropout)."""
    cost = cluster.flash_attention_dropout_cost if dropout else 1.0
    measured = cluster.calibration.lookup("attention", seq, head_dim, 0, heads)
    if measured is not None:
        return cost * measured / 3.5, cost * measured * 2.5 / 3.5
    forward = 0.5 * 4.0 * seq * seq * head_dim * heads
    rate = cluster.peak_flops * cluster.flash_attention_efficiency
    return cost * forward / rate, cost * 2.5 * forward / rate


def masked_attention_seconds(
    cluster: Cluster, pairs: int, head_dim: int, heads: int
) -> tuple[float, float]:
    """``(forward, backward)`` seconds of a fused attention kernel under an explicit mask over
    ``pairs`` query-key pairs per head (every pair computed, none skipped): ``4·pairs·d`` FLOPs
    per head forward, backward 2.5x, at ``flash_attention_efficiency`` of the peak (the
    context-parallel core's ``sdpa`` chunks, which it runs without dropout; no separate
    published figure for the memory-efficient kernel a mask selects, so the flash one is
    used)."""
    forward = 4.0 * pairs * head_dim * heads
    rate = cluster.peak_flops * cluster.flash_attention_efficiency
    return forward / rate, 2.5 * forward / rate


def gather_seconds(cluster: Cluster, nbytes: float, group: int, within_node: bool) -> float:
    """A ring all-gather (or reduce-scatter) whose full tensor is ``nbytes``."""
    if group <= 1:
        return 0.0
    return (group - 1) / group * nbytes / cluster.link_rate(within_node)


def spread_gather_seconds(
    cluster: Cluster, nbytes: float, group: int, members_in_node: int
) -> float:
    """A ring all-gather (or reduce-scatter) whose full tensor is ``nbytes`` over ``group``
    ranks, ``members_in_node`` of them in each node (a data-parallel group: the ranks of
    equal TP / PP position, ``t`` apart). Every member passes ``(group-1)/group`` of the
    tensor along the ring. Inside one node that is :func:`gather_seconds` over NVLink. Across
    nodes NCCL runs one ring per channel and stripes the channels over the node's network
    adapters, one per GPU ([DGXA100] / [DGXH100]): the ``members_in_node`` members' adapters
    carry the ring's inter-node hops side by side, so the ring runs at the slower of NVLink
    and ``members_in_node`` adapters. With one member per node this is the ring over the
    network."""
    if group <= 1:
        return 0.0
    if members_in_node >= group:
        return gather_seconds(cluster, nbytes, group, True)
    rate = min(cluster.link_rate(True), members_in_node * cluster.link_rate(False))
    return (group - 1) / group * nbytes / rate


def all_to_all_seconds(cluster: Cluster, nbytes: float, group: int, members_in_node: int) -> float:
    """An all-to-all over ``group`` ranks in which each rank sends ``1/group`` of its
    ``nbytes`` to every other rank and receives as much: to the ``members_in_node - 1`` others
    in its node over NVLink, to the ``group - members_in_node`` others over the network (its
    own NIC), both at once; the slower of the two sets the time. Inside one node this is a ring
    all-gather's ``(group-1)/group·nbytes``; across nodes only the share for other nodes
    crosses the network."""
    if group <= 1:
        return 0.0
    share = nbytes / group
    nvlink = (members_in_node - 1) * share / cluster.link_rate(True)
    network = (group - members_in_node) * share / cluster.link_rate(False)
    return max(nvlink, network)


def all_reduce_seconds(cluster: Cluster, nbytes: float, group: int, within_node: bool) -> float:
    """A ring all-reduce of ``nbytes``: a reduce-scatter and an all-gather."""
    return 2.0 * gather_seconds(cluster, nbytes, group, within_node)


COLLECTIVE_SECONDS: dict[CollectiveKind, Callable[[Cluster, float, int, bool], float]] = {
    CollectiveKind.ALL_REDUCE: all_reduce_seconds,
    CollectiveKind.ALL_GATHER: gather_seconds,
    CollectiveKind.REDUCE_SCATTER: gather_seconds,
}
"""The ring time of each kind of part collective: ``(cluster, nbytes, group, within_node) ->
seconds``."""


def collective_seconds(
    cluster: Cluster, collective: Collective, group: int, within_node: bool
) -> float:
    """One call of a part's ``collective`` over ``group`` ranks, priced by its kind."""
    return COLLECTIVE_SECONDS[collective.kind](cluster, collective.nbytes, group, within_node)


def transfer_seconds(cluster: Cluster, nbytes: float, within_node: bool) -> float:
    """A point-to-point send of ``nbytes`` (its receive runs at the same time)."""
    return nbytes / cluster.link_rate(within_node)
