"""Finishing gradients after backward: the reductions a parallel layout needs, and the true
global gradient norm.

Gradients live in ``param.main_grad`` (fp32 accumulation buffer) when the optimizer keeps
fp32 master weights, else in ``param.grad``; :func:`grad_of` hides the difference.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_sp.parallel.buffer import GradBuffer
from lightning_sp.parallel.state import ParallelState


def grad_of(param: Tensor) -> Tensor | None:
    """The gradient the optimizer will use: ``main_grad`` if present, else ``grad``."""
    main = getattr(param, "main_grad", None)
    return main if main is not None else param.grad


def _all_reduce_coalesced(
    tensors: list[Tensor], group: dist.ProcessGroup, op: dist.ReduceOp.RedOpType
) -> None:
    """All-reduce ``tensors`` in place, one collective per dtype."""
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for group_tensors in by_dtype.values():
        flat = torch._utils._flatten_dense_tensors(group_tensors)
        dist.all_reduce(flat, op=op, group=group)
        for t, reduced in zip(
            group_tensors, torch._utils._unflatten_dense_tensors(flat, group_tensors), strict=True
        ):
            t.copy_(reduced)


def allreduce_sequence_parallel_grads(module: nn.Module, state: ParallelState) -> None:
    """Sum the gradients of the parameters marked ``sequence_parallel`` over the
    tensor-parallel group: whole on every TP rank, each applied to only this rank's share of
    the work, so each rank holds a partial gradient.

    Under sequence parallelism the LayerNorm weights and biases, the row-parallel biases and
    the position embedding see only this rank's sequence shard; with or without it, Qwen3's
    per-head query/key norm weights see only this rank's heads (:mod:`lightning_sp.model.
    qk_norm`). Call once after the backward passes of a step.
    """
    if state.tp_group is None:
        return
    grads = [
        g
        for p in module.parameters()
        if getattr(p, "sequence_parallel", False) and (g := grad_of(p)) is not None
    ]
    if grads:
        _all_reduce_coalesced(grads, state.tp_group, dist.ReduceOp.SUM)


def zero_inert_grads(module: nn.Module) -> None:
    """Set exactly to zero the gradients of parameters marked ``inert_gradient`` (their
    gradient is zero in exact arithmetic, e.g. the key bias without rotary embeddings: what
    is computed is rounding noise, which Adam's normalisation would turn into updates that
    differ between layouts)."""
    for p in module.parameters():
        if getattr(p, "inert_gradient", False) and (g := grad_of(p)) is not None:
            g.zero_()


def allreduce_replicated_grads(module: nn.Module, state: ParallelState) -> None:
    """Sum the gradients of shards that several tensor-parallel ranks hold (``ShardSpec.
    replicas > 1``: the key/value heads of grouped-query attention with fewer groups than
    ranks) over the ranks that share them: each computed only its own query heads' part."""
    by_size: dict[int, list[Tensor]] = {}
    for p in module.parameters():
        shard = getattr(p, "shard", None)
        if shard is not None and shard.replicas > 1 and (g := grad_of(p)) is not None:
            by_size.setdefault(shard.replicas, []).append(g)
    for size, grads in by_size.items():
        subgroup = state.tensor_parallel_subgroup(size)
        if subgroup is not None:
            _all_reduce_coalesced(grads, subgroup, dist.ReduceOp.SUM)


def is_expert(param: Tensor) -> bool:
    """Whether ``param`` is a mixture-of-experts expert weight (marked ``expert``): held by
    the ``d·c/e`` ranks of the expert-data group rather than all ``d·c``."""
    return getattr(param, "expert", False)


def reduce_expert_grads(module: nn.Module, state: ParallelState) -> None:
    """Sum expert gradients over the expert-data group and divide by d.

    An expert's local gradient already holds every token routed to it from the ``e`` ranks
    of its EP group (the all-to-all's backward brings them), each token weighted by its own
    rank's loss scale; summing over the ``d·c/e`` ranks holding the same experts covers every
    token of the d·c ranks once, and dividing by d gives the dense weights' convention (sum
    over CP, mean over DP). For ``e = 1`` the group is all d·c ranks: the dense reduction."""
    grads = [g for p in module.parameters() if is_expert(p) and (g := grad_of(p)) is not None]
    if not grads:
        return
    if state.expert_data_group is not None:
        _all_reduce_coalesced(grads, state.expert_data_group, dist.ReduceOp.SUM)
    if state.data_parallel_size > 1:
        for g in grads:
            g.div_(state.data_parallel_size)


def sum_context_parallel_grads(module: nn.Module, state: ParallelState) -> None:
    """Sum every gradient over the context-parallel group.

    Each CP rank holds the gradient of its own tokens' share of the loss
    (:func:`~lightning_sp.parallel.context.context_token_mean` gives ``1 / Σ tokens`` of the
    whole CP group, not of the rank), so the sum over the group is the gradient of the loss of
    the whole sequences: afterwards every CP rank holds the same gradient, as a data-parallel
    replica does after its mean. The convention is *sum over cp, then mean over dp* (not a mean
    over dp × cp with the loss scaled by c). No-op for ``c = 1``.
    """
    if state.cp_group is None:
        return
    grads = [g for p in module.parameters() if not is_expert(p) and (g := grad_of(p)) is not None]
    if grads:
        _all_reduce_coalesced(grads, state.cp_group, dist.ReduceOp.SUM)


def average_data_parallel_grads(module: nn.Module, state: ParallelState) -> None:
    """Average every gradient but the experts' over the data-parallel group (replicas see
    different data)."""
    if state.dp_group is None:
        return
    grads = [g for p in module.parameters() if not is_expert(p) and (g := grad_of(p)) is not None]
    if grads:
        _all_reduce_coalesced(grads, state.dp_group, dist.ReduceOp.SUM)
        for g in grads:
            g.div_(state.data_parallel_size)


def finalize_grads(
    module: nn.Module, state: ParallelState, buffer: GradBuffer | None = None
) -> None:
    """All reductions between the last backward and the optimizer step.

    With a :class:`~lightning_sp.parallel.buffer.GradBuffer` the data-parallel mean is the
    buffer's bucketed reduction (most of it already launched during backward), finished
    here; the sequence-parallel sums over TP follow it (both are linear, so they commute).
    Under context parallelism every gradient is then summed over the CP group
    (:func:`sum_context_parallel_grads`), except with a distributed optimizer's buffer, whose
    reduce-scatter over the d·c ranks already summed it. Last,
    gradients that are zero in exact arithmetic are made exactly zero
    (:func:`zero_inert_grads`). Expert weights are reduced over their expert-data group instead
    (:func:`reduce_expert_grads`; a buffer does it in buckets of their own).
    """
    if buffer is not None:
        buffer.finish()
    allreduce_sequence_parallel_grads(module, state)
    allreduce_replicated_grads(module, state)
    if buffer is None:
        average_data_parallel_grads(module, state)
        reduce_expert_grads(module, state)
    if buffer is None or not buffer.distributed:
        sum_context_parallel_grads(module, state)
    zero_inert_grads(module)


def _counted_once(param: Tensor, state: ParallelState) -> bool:
    """Whether this rank contributes ``param`` to the global norm.

    A shard of a tensor-parallel parameter is unique to its rank (or, held by ``replicas``
    ranks, counted on the first of them); a parameter replicated over the tensor-parallel
    group is counted on TP rank 0 only; a pipeline stage's copy of the tied embedding
    (``pipeline_copy``) is counted on the stage that owns the original.
    """
    if getattr(param, "pipeline_copy", False):
        return False
    sliced = getattr(param, "expert_slice", None)
    if sliced is not None and sliced.size > 1:  # expert TP: each TP rank's own f_e slice
        return True
    shard = getattr(param, "shard", None)
    if shard is not None and shard.dim is not None:
        return state.tensor_parallel_rank % shard.replicas == 0
    return state.tensor_parallel_rank == 0


def global_grad_norm(
    params: Iterable[Tensor],
    state: ParallelState,
    sharded_over_dp: bool = False,
    flat: list[Tensor] | None = None,
) -> Tensor:
    """The L2 norm of the whole model's gradient, over all TP and PP shards (an fp32 scalar;
    fp64 for fp64 gradients).

    Data-parallel (and context-parallel) replicas hold identical gradients after the
    reduction, so they are not summed; ``sharded_over_dp`` (the distributed optimizer's
    buffer: each of the d·c ranks holds its own shard, zeros elsewhere) sums them too.
    Expert weights differ between the ranks of an expert-parallel group: their squares are
    summed over it as well (each expert counted once: on TP rank 0, or under expert tensor
    parallelism each TP rank's slice). ``flat``: the gradient buffer's storage, read whole
    instead of ``params`` (only as :func:`counted_flat_grads` gives it: every gradient counted
    once, none an expert's); the same collectives run either way.
    """
    dense: list[Tensor] = []
    expert: list[Tensor] = []
    if flat is not None:
        dense = flat
        device = flat[0].device if flat else state.device
        wide = any(g.dtype == torch.float64 for g in flat)
    else:
        params = list(params)
        device = params[0].device if params else state.device
        # fp32, or fp64 for fp64 gradients (so that float64 parity tests see no fp32 rounding)
        wide = any((g := grad_of(p)) is not None and g.dtype == torch.float64 for p in params)
        for p in params:
            g = grad_of(p)
            if g is not None and _counted_once(p, state):
                (expert if is_expert(p) else dense).append(g.detach())
    dtype = torch.float64 if wide else torch.float32
    total, experts = (_sum_of_squares(grads, dtype, device) for grads in (dense, expert))
    if state.ep_group is not None and not sharded_over_dp:  # sharded: the d·c sum below
        dist.all_reduce(experts, group=state.ep_group)
    total += experts
    shards = state.gradient_group if sharded_over_dp else None
    for group in (state.tp_group, state.pp_group, shards):
        if group is not None:
            dist.all_reduce(total, group=group)
    return total.sqrt()


def flat_grads(params: Iterable[Tensor], buffer: GradBuffer | None) -> list[Tensor] | None:
    """``buffer``'s flat storage (one tensor per gradient dtype, every ``main_grad`` a view
    into it) when it holds the gradient of every parameter of ``params`` that requires one,
    else ``None``: one tensor per dtype to read or scale instead of one per parameter. Loops
    over ``params``: work it out once per run, not per step."""
    if buffer is None:
        return None
    held = {id(p) for p in buffer.params}
    if any(p.requires_grad and id(p) not in held for p in params):
        return None
    return list(buffer.buffers.values())


def counted_flat_grads(
    params: Iterable[Tensor], buffer: GradBuffer | None, state: ParallelState
) -> list[Tensor] | None:
    """:func:`flat_grads` when :func:`global_grad_norm` may read the storage whole: every
    buffered gradient is counted once on this rank and none is an expert's (``t = 1``, no
    tied copy on this stage, no experts), else ``None``. Once per run, as ``flat_grads``."""
    flat = flat_grads(params, buffer)
    if flat is None or buffer is None:
        return None
    if any(is_expert(p) or not _counted_once(p, state) for p in buffer.params):
        return None
    return flat


def _sum_of_squares(grads: list[Tensor], dtype: torch.dtype, device: torch.device) -> Tensor:
    """``Σ ‖g‖²`` over ``grads`` in ``dtype``, as multi-tensor kernels (one norm per tensor,
    a handful of kernels for all of them rather than a few per parameter)."""
    if not grads:
        return torch.zeros((), dtype=dtype, device=device)
    norms = torch._foreach_norm(grads, 2, dtype=dtype)
    return torch.stack(norms).pow(2).sum()


def clip_grad_norm_(
    params: Iterable[Tensor],
    max_norm: float,
    state: ParallelState,
    sharded_over_dp: bool = False,
    flat: list[Tensor] | None = None,
) -> Tensor:
    """Scale every gradient so the global norm is at most ``max_norm``; return the norm.
    ``flat`` (:func:`counted_flat_grads`): norm and scale the buffer's storage whole, one
    kernel each per dtype, instead of ``params`` one by one."""
    grads = flat
    if grads is None:
        params = list(params)
        grads = [g for p in params if (g := grad_of(p)) is not None]
    norm = global_grad_norm(params, state, sharded_over_dp, flat)
    coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for dtype, same in by_dtype.items():  # one multi-tensor kernel per dtype
        torch._foreach_mul_(same, coefficient.to(dtype))
    return norm
