"""Token dispatch for expert parallelism: each (token, expert) assignment travels to the rank
holding that expert and back, with ``all_to_all_single`` (uneven splits) inside the EP group.

The ``E`` experts are spread over the ``e`` ranks of the EP group in blocks: EP rank ``j`` holds
experts ``[j·E/e, (j+1)·E/e)``. :func:`dispatch` sends every kept assignment's token row to its
expert's rank and returns the rows this rank's experts must process, grouped by local expert
(expert-major, the layout a grouped GEMM takes); :func:`combine` brings the experts' output rows
back, weights them by their routing probability and sums each token's ``k`` rows.

Every step is differentiable: row gathers (``index_select``, whose backward adds into the rows it
read and saves only the index) and :class:`AllToAll` (backward: the same exchange with the splits
swapped); the combine (:class:`_WeightedSum`) gathers each (token, slot)'s row and adds the ``k``
weighted rows of a token in slot order, and its backward gathers too (each row's token's
gradient; no scatter-add). With
``e = 1`` (group ``None``) nothing is communicated and the routing is the same, so one process
and every layout run the same arithmetic per row.

======================  =========================================  ==========================
op                      forward                                    backward
======================  =========================================  ==========================
``AllToAll``            rows to ranks by ``send`` splits           rows back by ``recv`` splits
``_WeightedSum``        ``Σ_j w[t, j] · y[row of (t, j)]``         gathers by ``token``
======================  =========================================  ==========================
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_sp.parallel.comm import Group, group_size


def _exchange(x: Tensor, recv: list[int], send: list[int], group: Group) -> Tensor:
    """Rows ``x`` (``sum(send)`` of them, in destination-rank order) exchanged over
    ``group``: returns ``sum(recv)`` rows in source-rank order."""
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    return out


class AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits over ``group``; its adjoint is the same exchange
    with ``recv`` and ``send`` swapped."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, recv: list[int], send: list[int], group: Group) -> Tensor:
        ctx.recv, ctx.send, ctx.group = recv, send, group
        return _exchange(x, recv, send, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        return _exchange(grad, ctx.send, ctx.recv, ctx.group), None, None, None


def all_to_all(x: Tensor, recv: list[int], send: list[int], group: Group) -> Tensor:
    """Differentiable uneven all-to-all: ``x`` ``[Σsend, ...]`` -> ``[Σrecv, ...]``; identity
    for a group of ``None`` or one rank."""
    if group_size(group) == 1:
        return x
    return AllToAll.apply(x, recv, send, group)


def expert_counts(experts: Tensor, num_experts: int) -> Tensor:
    """Choices per expert ``[E]`` (int64) of the indices ``experts``: a bincount of static
    shape (it traces under fake tensors)."""
    flat = experts.reshape(-1)
    return torch.zeros(num_experts, dtype=torch.long, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat)
    )


@dataclass(frozen=True)
class Routing:
    """How one dispatch moved rows; what :func:`combine` needs to move them back."""

    token: Tensor
    """``[N]``: for each kept assignment sorted by expert, its token's row (local index)."""
    slot: Tensor
    """``[N]``: the same assignments' flat ``token·k + slot`` index into ``[T, k]``."""
    send: list[int]
    """Rows sent to each EP rank (forward)."""
    recv: list[int]
    """Rows received from each EP rank (forward)."""
    regroup: Tensor | None
    """``[N_recv]``: received row of each expert-major row; ``None`` without EP."""
    counts: list[int]
    """Rows per local expert, in the expert-major order returned by :func:`dispatch`."""


def dispatch(
    x: Tensor,
    experts: Tensor,
    keep: Tensor | None,
    num_experts: int,
    group: Group,
    balanced: bool = False,
) -> tuple[Tensor, Routing]:
    """Send each kept (token, slot) assignment's row of ``x`` to the rank of its expert.

    ``x``: ``[T, h]`` this rank's tokens; ``experts``: ``[T, k]`` expert indices (global, in
    ``[0, E)``); ``keep``: ``[T, k]`` bool (``None``: all kept; a dropped assignment is neither
    sent nor combined). Returns ``[N_local, h]`` rows for this rank's ``E/e`` experts,
    expert-major, and the :class:`Routing` to undo it (``counts``: rows per local expert).
    ``balanced``: the caller guarantees every expert gets ``T·k/E`` of every rank's rows (a
    forced-balanced router, dropless), so no count is read from the device: the path traces
    under fake tensors.
    """
    t, k = experts.shape
    e = group_size(group)
    local = num_experts // e
    flat = experts.reshape(-1)  # [T·k]
    kept = (
        torch.arange(t * k, device=x.device)
        if keep is None
        else keep.reshape(-1).nonzero().squeeze(1)
    )
    order = torch.argsort(flat[kept], stable=True)
    slot = kept[order]  # [N] flat (token, slot) indices sorted by expert
    token = torch.div(slot, k, rounding_mode="floor")
    rows = x.index_select(0, token)  # [N, h], expert-sorted
    if balanced:  # T·k/E rows per (rank, expert): known without reading the device
        per = t * k // num_experts
        counts_list = [per] * num_experts
        received_list = counts_list
    else:
        counts = expert_counts(flat[slot], num_experts)  # [E]
        counts_list = counts.tolist()
    if e == 1:
        return rows, Routing(token, slot, [], [], None, counts_list)
    if not balanced:
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=group)  # [e (source), E/e]
        received_list = received.tolist()
    send = [sum(counts_list[r * local : (r + 1) * local]) for r in range(e)]
    recv = [sum(received_list[r * local : (r + 1) * local]) for r in range(e)]
    rows = all_to_all(rows, recv, send, group)  # [N_recv, h]: [source][local expert]
    expert_of = torch.repeat_interleave(
        torch.arange(local, device=x.device).repeat(e),
        torch.tensor(received_list, device=x.device),
        output_size=sum(recv),
    )
    regroup = torch.argsort(expert_of, stable=True)
    per_expert = [sum(received_list[j::local]) for j in range(local)]
    return rows.index_select(0, regroup), Routing(token, slot, send, recv, regroup, per_expert)


class _WeightedSum(torch.autograd.Function):
    """``out[t] = Σ_j w[t, j] · y[row of (t, j)]``: each token's weighted sum of its expert
    output rows (``y`` ``[N, h]`` in expert-sorted assignment order, the (token, slot) of row
    ``n`` being ``slot[n]``; a dropped assignment has no row and adds nothing). Saves ``y``,
    ``w`` and the two indices (``token`` is the dispatch's own, stored once); gathers both ways,
    no ``[T, k, h]`` product and no scatter-add."""

    @staticmethod
    def forward(ctx: Any, y: Tensor, w: Tensor, token: Tensor, slot: Tensor) -> Tensor:
        ctx.save_for_backward(y, w, token, slot)
        t, k = w.shape
        # row of each (token, slot), the zero row appended at N for a dropped one
        position = torch.full((t * k,), y.shape[0], dtype=torch.long, device=y.device)
        position[slot] = torch.arange(y.shape[0], device=y.device)
        rows = y if y.shape[0] == t * k else torch.cat([y, y.new_zeros((1, y.shape[1]))])
        position = position.view(t, k)
        out = rows.index_select(0, position[:, 0]) * w[:, :1]  # [T, h]
        for j in range(1, k):
            out.addcmul_(rows.index_select(0, position[:, j]), w[:, j : j + 1])
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None, None]:
        y, w, token, slot = ctx.saved_tensors
        per_row = grad.index_select(0, token)  # [N, h]: each row's token's gradient
        grad_w = None
        if ctx.needs_input_grad[1]:  # <grad[t], y[n]> to (t, j), zero for a dropped slot
            dots = torch.linalg.vecdot(per_row, y)  # [N]
            grad_w = dots.new_zeros(w.numel()).index_copy_(0, slot, dots).view_as(w)
        grad_y = None
        if ctx.needs_input_grad[0]:
            grad_y = per_row.mul_(w.reshape(-1).index_select(0, slot).unsqueeze(1))
        return grad_y, grad_w, None, None


def combine(y: Tensor, weights: Tensor, routing: Routing, group: Group) -> Tensor:
    """The inverse of :func:`dispatch`: ``y`` ``[N_local, h]`` expert outputs (expert-major)
    go back to their tokens' ranks; each row is scaled by its routing weight (``weights``:
    ``[T, k]``) and summed into its token: ``-> [T, h]`` (a token whose assignments were all
    dropped gets zeros)."""
    if routing.regroup is not None:
        back = torch.empty_like(routing.regroup)
        back[routing.regroup] = torch.arange(len(routing.regroup), device=y.device)
        y = all_to_all(y.index_select(0, back), routing.send, routing.recv, group)  # [N, h]
    # [N, h] in the dispatch's expert-sorted order -> [T, h]; the weights in y's dtype
    return _WeightedSum.apply(y, weights.to(y.dtype), routing.token, routing.slot)
