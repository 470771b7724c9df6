"""The expert-tensor-parallel exchange of dispatched rows inside the TP group.

Under expert tensor parallelism each of the ``t`` TP ranks holds ``f_e/t`` of every local
expert, so each must run every row that the TP group's ranks received for those experts. After
the EP dispatch (:func:`lightning_sp.parallel.dispatch.dispatch`) TP rank ``r`` holds ``n_r``
rows, expert-major, ``c_r[j]`` for local expert ``j``; the counts differ between TP ranks
(each routed its own sequence shard). :func:`gather_rows` all-gathers them (each rank's rows
padded to the longest, ``all_gather_into_tensor``: gloo and NCCL alike) and regroups the
``Σ_r n_r`` rows expert-major (``[j][r]``, the layout a grouped GEMM takes);
:func:`scatter_rows` is its adjoint: it puts the experts' partial outputs back in source-rank
order, padded, and reduce-scatters them, so TP rank ``r`` gets the complete outputs of its
own ``n_r`` rows.

Both regroup with ``split`` and ``cat`` of row blocks whose sizes are Python integers, so
neither saves a tensor for backward (no index).

=================  ===========================================  ============================
op                 forward                                      backward
=================  ===========================================  ============================
``gather_rows``    all-gather (padded), regroup ``[j][r]``      regroup ``[r][j]``, reduce-
                                                                scatter (padded)
``scatter_rows``   regroup ``[r][j]``, reduce-scatter (padded)  all-gather, regroup ``[j][r]``
=================  ===========================================  ============================
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_sp.parallel.comm import (
    Group,
    all_gather_sequence,
    conjugate_op,
    group_rank,
    group_size,
    reduce_scatter_sequence,
)


@dataclass(frozen=True)
class RowPlan:
    """Rows per local expert on every rank of the TP group; what both exchanges need."""

    per_rank: list[list[int]]
    """``[t][E_local]``: rows of each local expert held by each TP rank after the dispatch."""
    group: Group
    """The TP group (``None``: no exchange)."""

    @property
    def counts(self) -> list[int]:
        """Rows per local expert after :func:`gather_rows` (summed over the TP ranks)."""
        return [sum(column) for column in zip(*self.per_rank, strict=True)]

    @property
    def longest(self) -> int:
        """The most rows any TP rank holds: each rank's block is padded to it."""
        return max(sum(rows) for rows in self.per_rank)


def plan_rows(counts: list[int], group: Group, same: bool, device: torch.device) -> RowPlan:
    """Exchange this rank's ``counts`` (rows per local expert) over the TP ``group``.
    ``same``: the caller knows every TP rank holds the same counts (forced-balanced routing),
    so nothing is read from the device."""
    t = group_size(group)
    if t == 1 or same:
        return RowPlan([list(counts)] * t, group)
    mine = torch.tensor(counts, dtype=torch.long, device=device)
    every = all_gather_sequence(mine, group).view(t, len(counts))  # [t, E_local]
    return RowPlan(every.tolist(), group)


def _gather(x: Tensor, plan: RowPlan) -> Tensor:
    """``[n_me, h]`` (this rank's rows, expert-major) -> ``[Σ n_r, h]`` expert-major over the
    group's ranks."""
    m, mine = plan.longest, sum(plan.per_rank[group_rank(plan.group)])
    padded = x if mine == m else torch.cat([x, x.new_zeros((m - mine, *x.shape[1:]))])
    blocks = all_gather_sequence(padded, plan.group).split(m)  # [t][m, h]
    pieces = [
        block[: sum(rows)].split(rows) for block, rows in zip(blocks, plan.per_rank, strict=True)
    ]  # [t][E_local]
    local = len(plan.per_rank[0])
    return torch.cat([piece[j] for j in range(local) for piece in pieces])


def _scatter(y: Tensor, plan: RowPlan) -> Tensor:
    """``[Σ n_r, h]`` expert-major partial sums -> ``[n_me, h]``: this rank's rows, summed
    over the group."""
    t, local, m = len(plan.per_rank), len(plan.per_rank[0]), plan.longest
    sizes = [plan.per_rank[r][j] for j in range(local) for r in range(t)]
    pieces = y.split(sizes)  # [j][r]
    blocks = []
    for r in range(t):
        rows = [pieces[j * t + r] for j in range(local)]
        pad = m - sum(plan.per_rank[r])
        blocks += [*rows, y.new_zeros((pad, *y.shape[1:]))] if pad else rows
    out = reduce_scatter_sequence(torch.cat(blocks), plan.group)  # [m, h]
    return out[: sum(plan.per_rank[group_rank(plan.group)])]


_GatherRows = conjugate_op("GatherRows", _gather, _scatter)
_ScatterRows = conjugate_op("ScatterRows", _scatter, _gather)


def gather_rows(x: Tensor, plan: RowPlan) -> Tensor:
    """The TP group's dispatched rows, expert-major (:data:`RowPlan.counts` per local
    expert); backward reduce-scatters the gradient. Identity for a group of one rank."""
    return x if group_size(plan.group) == 1 else _GatherRows.apply(x, plan)


def scatter_rows(y: Tensor, plan: RowPlan) -> Tensor:
    """The adjoint of :func:`gather_rows`: partial sums of the gathered rows -> the complete
    rows of this rank; backward all-gathers. Identity for a group of one rank."""
    return y if group_size(plan.group) == 1 else _ScatterRows.apply(y, plan)
