"""Context parallelism: every sample's sequence split over the ``c`` ranks of a context-parallel
(CP) group, with causal load balancing.

The sequence of length ``s`` is cut into ``2c`` chunks of ``L = s / (2c)`` tokens; CP rank ``r``
holds chunks ``r`` and ``2c - 1 - r``, concatenated in that order, so its local sequence has
``s/c = 2L`` tokens. Under a causal mask the query rows of chunk ``j`` attend ``(j + 1) L``
keys, so rank ``r``'s two chunks attend ``(r + 1) + (2c - r) = 2c + 1`` chunks' worth of keys:
the same attention work on every rank (Megatron-Core's and torchtitan's layout).

Two orders of a sequence of length ``s`` appear below:

* *global order*: the tokens as in the sample, positions ``0 .. s-1``;
* *rank order*: the local sequences of ranks ``0 .. c-1`` concatenated, i.e. the global chunks
  ``0, 2c-1, 1, 2c-2, ..., c-1, c`` (:func:`rank_order_chunks`). An all-gather of the local
  sequences produces it; :func:`gather_context_sequence` reorders it into global order.

With ``c = 1`` (a group of ``None`` or of one rank) the local sequence is the whole sequence in
global order, and every function here is the identity (no copy, no communication).

=====================================  ===========================  ===========================
op (autograd)                          forward                      backward
=====================================  ===========================  ===========================
``scatter_to_context_parallel``        keep own two chunks          all-gather, global order
``gather_from_context_parallel``       all-gather, global order     keep own two chunks
``context_token_mean``                 all-reduce the loss sum      identity (own share)
=====================================  ===========================  ===========================

The scatter / gather pair follows :mod:`lightning_sp.parallel.comm`'s conventions: the scatter's
input is replicated over the group (its gradient is the sum of every rank's, which the
all-gather assembles), the gather's output is replicated (its gradient is complete and identical
on every rank, so each keeps its own chunks).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_sp.parallel.comm import (
    Group,
    _all_gather_single,
    _reduce_scatter_single,
    f_bar,
    group_rank,
    group_size,
)


def check_context_split(seq_len: int, cp_size: int) -> int:
    """The chunk length ``L = seq_len / (2 cp_size)``; ``ValueError`` (one line) unless
    ``seq_len`` is a positive multiple of ``2 cp_size``."""
    if cp_size < 1:
        raise ValueError(f"context_parallel_size={cp_size} must be a positive integer")
    if seq_len < 1 or seq_len % (2 * cp_size):
        raise ValueError(
            f"sequence length {seq_len} is not divisible by 2 * context_parallel_size = "
            f"{2 * cp_size} (causal load balancing cuts it into 2c chunks)"
        )
    return seq_len // (2 * cp_size)


def rank_chunks(cp_size: int, cp_rank: int) -> tuple[int, int]:
    """The global chunk indices CP rank ``cp_rank`` holds, in local order: ``(r, 2c-1-r)``."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank={cp_rank} is not a rank of a group of {cp_size}")
    return cp_rank, 2 * cp_size - 1 - cp_rank


def rank_order_chunks(cp_size: int) -> list[int]:
    """The global chunk index at each chunk slot of the rank order ``[0, 2c-1, 1, 2c-2, ...]``."""
    return [chunk for rank in range(cp_size) for chunk in rank_chunks(cp_size, rank)]


def load_balanced_positions(
    seq_len: int, cp_size: int, cp_rank: int, device: torch.device | str | None = None
) -> Tensor:
    """The global token positions (int64, ``[seq_len / cp_size]``) of CP rank ``cp_rank``'s
    local sequence, in local order: ``[rL .. (r+1)L-1, (2c-1-r)L .. (2c-r)L-1]``.

    What learned position embeddings and RoPE index with, so each rank's tokens get their true
    positions. ``c = 1``: ``arange(seq_len)``.
    """
    chunk = check_context_split(seq_len, cp_size)
    return torch.cat(
        [
            torch.arange(i * chunk, (i + 1) * chunk, device=device)
            for i in rank_chunks(cp_size, cp_rank)
        ]
    )


def shard_for_context_parallel(x: Tensor, dim: int, cp_size: int, cp_rank: int) -> Tensor:
    """CP rank ``cp_rank``'s two chunks of ``x`` along ``dim`` (global order in, local order
    out), without communication: for the data (token ids, labels) each rank reads, and for
    tensors that every rank holds whole. ``x`` itself if ``cp_size == 1``, else a new tensor.
    Differentiable as plain indexing (backward puts the gradient into this rank's chunks of a
    zero tensor; :func:`scatter_to_context_parallel` is the group's version)."""
    if cp_size == 1:
        return x
    chunk = check_context_split(x.shape[dim], cp_size)
    return torch.cat([x.narrow(dim, i * chunk, chunk) for i in rank_chunks(cp_size, cp_rank)], dim)


def _reorder_chunks(x: Tensor, dim: int, cp_size: int, order: list[int]) -> Tensor:
    """``x`` with the ``2c`` chunks of ``dim`` taken in ``order`` (a new tensor)."""
    chunk = x.shape[dim] // (2 * cp_size)
    index = torch.tensor(order, device=x.device)
    return x.unflatten(dim, (2 * cp_size, chunk)).index_select(dim, index).flatten(dim, dim + 1)


def _global_from_rank_order(cp_size: int) -> list[int]:
    """For each global chunk, its slot in the rank order (the inverse permutation)."""
    slots = [0] * (2 * cp_size)
    for slot, chunk in enumerate(rank_order_chunks(cp_size)):
        slots[chunk] = slot
    return slots


def gather_context_sequence(x: Tensor, dim: int, group: Group) -> Tensor:
    """All-gather every CP rank's local sequence along ``dim`` and reorder it into global
    order: ``[.., s/c, ..] -> [.., s, ..]`` (a new tensor; ``x`` itself for ``c = 1``)."""
    cp_size = group_size(group)
    if cp_size == 1:
        return x
    check_context_split(x.shape[dim] * cp_size, cp_size)
    local = x.movedim(dim, 0).contiguous()
    gathered = local.new_empty((cp_size * local.shape[0], *local.shape[1:]))
    _all_gather_single(gathered, local, group=group)  # dim 0 in rank order
    full = _reorder_chunks(gathered, 0, cp_size, _global_from_rank_order(cp_size))
    return full.movedim(0, dim)


def reduce_scatter_context_sequence(x: Tensor, dim: int, group: Group) -> Tensor:
    """Sum ``x`` (global order along ``dim``) over the group and keep this rank's two chunks:
    ``[.., s, ..] -> [.., s/c, ..]``, the adjoint of :func:`gather_context_sequence` (a new
    tensor; ``x`` itself for ``c = 1``)."""
    cp_size = group_size(group)
    if cp_size == 1:
        return x
    check_context_split(x.shape[dim], cp_size)
    ranked = _reorder_chunks(x.movedim(dim, 0), 0, cp_size, rank_order_chunks(cp_size))
    out = ranked.new_empty((ranked.shape[0] // cp_size, *ranked.shape[1:]))
    _reduce_scatter_single(out, ranked.contiguous(), group=group)
    return out.movedim(0, dim)


class _ScatterToContext(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, dim: int, group: Group) -> Tensor:
        ctx.dim, ctx.group = dim, group
        return shard_for_context_parallel(x, dim, group_size(group), group_rank(group))

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return gather_context_sequence(grad, ctx.dim, ctx.group), None, None


class _GatherFromContext(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, dim: int, group: Group) -> Tensor:
        ctx.dim, ctx.group = dim, group
        return gather_context_sequence(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        group = ctx.group
        return (
            shard_for_context_parallel(grad, ctx.dim, group_size(group), group_rank(group)),
            None,
            None,
        )


def scatter_to_context_parallel(x: Tensor, group: Group, dim: int = 0) -> Tensor:
    """Enter the context-parallel region from a tensor replicated over the CP group.

    Forward: this rank's two chunks along ``dim`` (``[.., s, ..] -> [.., s/c, ..]``).
    Backward: all-gathers the per-rank gradients into global order (the gradient of a
    replicated input is the sum of the ranks', each non-zero only on its own chunks).
    """
    return x if group_size(group) == 1 else _ScatterToContext.apply(x, dim, group)


def gather_from_context_parallel(x: Tensor, group: Group, dim: int = 0) -> Tensor:
    """Leave the context-parallel region into a tensor replicated over the CP group.

    Forward: all-gathers the local sequences along ``dim`` in global order
    (``[.., s/c, ..] -> [.., s, ..]``). Backward: keeps this rank's two chunks of a gradient
    that is complete and identical on every rank.
    """
    return x if group_size(group) == 1 else _GatherFromContext.apply(x, dim, group)


def context_token_mean(loss_sum: Tensor, num_tokens: Tensor | int, group: Group) -> Tensor:
    """The mean loss over every token of the CP group's ranks: ``Σ_ranks loss_sum /
    Σ_ranks num_tokens`` (0 when no rank counted a token), so a rank whose chunks hold more
    counted tokens weighs more.

    ``loss_sum``: this rank's summed per-token loss (a scalar); ``num_tokens``: how many tokens
    this rank counted (an int or a scalar tensor; it may differ per rank).
    Forward: the same value on every CP rank (what to log). Backward: ``d/d loss_sum = 1 / Σ
    num_tokens`` on each rank, its own share of the global mean's gradient: parameter gradients
    must be **summed** over the CP group (if a strategy averages them over ``c`` ranks, as
    over data-parallel replicas, multiply this loss by ``c`` first, as Megatron-Core does).
    """
    count = torch.as_tensor(num_tokens, dtype=loss_sum.dtype, device=loss_sum.device)
    count = count.detach().clone()
    if group_size(group) == 1:
        return loss_sum / count.clamp(min=1)
    torch.distributed.all_reduce(count, group=group)
    return f_bar(loss_sum, group) / count.clamp(min=1)  # no token counted: 0, not NaN
