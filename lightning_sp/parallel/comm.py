"""The conjugate communication operators of tensor and sequence parallelism.

Paper, §4.2: ``f`` / ``f̄`` bracket a tensor-parallel region, ``g`` / ``ḡ`` replace them when
the regions around it are sequence parallel. ``f`` and ``g`` (entering the region) have no
function of their own: they are the collectives inside the column-parallel linear's autograd
function (:class:`lightning_sp.parallel.layers.ColumnParallelLinear`; forward all-gather along
s under SP, backward all-reduce or reduce-scatter of the input gradient), which keeps the
gathered input out of the saved tensors and recomputes it in backward. Sequence shards live
on dimension 0 (layout ``[s, b, h]``), so gathers and scatters are contiguous and copy nothing
extra.

Every op is a ``torch.autograd.Function`` over an explicit process group, is the identity for
a group of ``None`` or of one rank, and never writes into its (autograd) input.

=====================================  ===========================  ===========================
op                                     forward                      backward
=====================================  ===========================  ===========================
``f_bar``  (leave TP region)           all-reduce                   identity
``g``      (SP -> TP region)           all-gather along s           reduce-scatter along s
``g_bar``  (TP -> SP region)           reduce-scatter along s       all-gather along s
``scatter_to_sequence_parallel``       keep own shard of s          all-gather along s
``gather_from_sequence_parallel``      all-gather along s           keep own shard of s
=====================================  ===========================  ===========================
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

Group = dist.ProcessGroup | None

# torch 2.13 renamed the tensor-in/tensor-out collectives; older releases only have the old names
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def group_size(group: Group) -> int:
    """Number of ranks in ``group`` (1 for ``None``)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Group) -> int:
    """This rank's index in ``group`` (0 for ``None``)."""
    return 0 if group is None else dist.get_rank(group)


def all_reduce(x: Tensor, group: Group) -> Tensor:
    """Sum ``x`` over ``group`` into a new tensor."""
    if group_size(group) == 1:
        return x
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, group=group)
    return out


def _into_new(collective: Callable[..., Any], x: Tensor, rows: int, group: Group) -> Tensor:
    """``collective(out, x, group=group)`` (tensor in, tensor out, along dim 0) into a new
    ``out`` of ``rows`` rows: ``[rows, ...]``."""
    out = x.new_empty((rows, *x.shape[1:]))
    collective(out, x.contiguous(), group=group)
    return out


def _sequence_shards(x: Tensor, group: Group) -> int:
    """How many slices of dim 0 ``group`` splits ``x`` into (its size); :class:`ValueError`
    unless they are equal."""
    world = group_size(group)
    if world > 1 and x.shape[0] % world:
        raise ValueError(f"dim 0 of size {x.shape[0]} is not divisible by the group size {world}")
    return world


def all_gather_sequence(x: Tensor, group: Group) -> Tensor:
    """Concatenate every rank's ``x`` along dim 0: ``[s/t, ...] -> [s, ...]``."""
    world = group_size(group)
    if world == 1:
        return x
    return _into_new(_all_gather_single, x, x.shape[0] * world, group)


def reduce_scatter_sequence(x: Tensor, group: Group) -> Tensor:
    """Sum over ``group`` and keep this rank's slice of dim 0: ``[s, ...] -> [s/t, ...]``."""
    world = _sequence_shards(x, group)
    if world == 1:
        return x
    return _into_new(_reduce_scatter_single, x, x.shape[0] // world, group)


def split_sequence(x: Tensor, group: Group) -> Tensor:
    """This rank's slice of dim 0, as a new contiguous tensor: ``[s, ...] -> [s/t, ...]``."""
    world = _sequence_shards(x, group)
    if world == 1:
        return x
    return x.chunk(world, dim=0)[group_rank(group)].contiguous()


def conjugate_op(
    name: str,
    forward: Callable[[Tensor, Any], Tensor],
    backward: Callable[[Tensor, Any], Tensor],
) -> type[torch.autograd.Function]:
    """An autograd Function computing ``forward(x, arg)``, with ``backward(grad, arg)``
    (``arg``: the process group here, or whatever else both need, never differentiated)."""

    class Op(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Tensor, arg: Any) -> Tensor:
            ctx.arg = arg
            return forward(x, arg)

        @staticmethod
        def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
            return backward(grad, ctx.arg), None

    Op.__name__ = Op.__qualname__ = name
    return Op


def _identity(x: Tensor, group: Group) -> Tensor:
    return x.view_as(x)


_FBar = conjugate_op("FBar", all_reduce, _identity)
_G = conjugate_op("G", all_gather_sequence, reduce_scatter_sequence)
_GBar = conjugate_op("GBar", reduce_scatter_sequence, all_gather_sequence)
_Scatter = conjugate_op("Scatter", split_sequence, all_gather_sequence)
_Gather = conjugate_op("Gather", all_gather_sequence, split_sequence)


def _apply(fn: type[torch.autograd.Function], x: Tensor, group: Group) -> Tensor:
    return x if group_size(group) == 1 else fn.apply(x, group)


def f_bar(x: Tensor, group: Group) -> Tensor:
    """Leave a tensor-parallel region: forward all-reduce over ``group``, backward identity."""
    return _apply(_FBar, x, group)


def g(x: Tensor, group: Group) -> Tensor:
    """Sequence- to tensor-parallel: forward all-gather along s, backward reduce-scatter.

    ``[s/t, b, h] -> [s, b, h]``; the gradient each rank returns is a partial sum over the
    group (the region's ranks each compute a share), summed into the shard's.
    """
    return _apply(_G, x, group)


def g_bar(x: Tensor, group: Group) -> Tensor:
    """Tensor- to sequence-parallel: forward reduce-scatter along s, backward all-gather.

    ``[s, b, h]`` (partial sums) ``-> [s/t, b, h]`` (complete, this rank's sequence shard).
    """
    return _apply(_GBar, x, group)


def scatter_to_sequence_parallel(x: Tensor, group: Group) -> Tensor:
    """Enter a sequence-parallel region from a replicated tensor.

    Forward keeps this rank's shard (``[s, b, h] -> [s/t, b, h]``); backward all-gathers.
    """
    return _apply(_Scatter, x, group)


def gather_from_sequence_parallel(x: Tensor, group: Group) -> Tensor:
    """Leave a sequence-parallel region into a replicated tensor.

    Forward all-gathers (``[s/t, b, h] -> [s, b, h]``); backward keeps this rank's shard of a
    gradient that is complete and identical on every rank.
    """
    return _apply(_Gather, x, group)
