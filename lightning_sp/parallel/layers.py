"""Tensor- and sequence-parallel layers (Megatron-LM's, paper §4.2).

Layouts are ``[s, b, h]``. With ``sequence_parallel`` the activations between these layers are
sequence shards ``[s/t, b, h]``; without it they are replicated ``[s, b, h]``.

The column-parallel linear is one autograd function that saves only the tensor it was given:
under sequence parallelism that is the local shard ``[s/t, b, h]``, all-gathered once in
forward for the matmul and once again in backward for the weight gradient. (Saving the
gathered input instead costs ``4sbh(1 - 1/t)`` bytes per layer, which is what DTensor's
``SequenceParallel`` does.)

The vocabulary-parallel embedding and cross entropy are :mod:`lightning_sp.parallel.vocab`'s.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lightning_sp.parallel.comm import (
    Group,
    all_gather_sequence,
    all_reduce,
    f_bar,
    g_bar,
    group_size,
    reduce_scatter_sequence,
)
from lightning_sp.parallel.init import ShardSpec, mark_parameter
from lightning_sp.parallel.state import ParallelState


def divide(numerator: int, denominator: int, what: str) -> int:
    """``numerator // denominator``; a ``ValueError`` naming ``what`` unless it divides."""
    if numerator % denominator:
        raise ValueError(f"{what}={numerator} is not divisible by {denominator}")
    return numerator // denominator


NormFn = Callable[[Tensor, Tensor, Tensor | None, float], Tensor]
"""``norm(x, weight, bias, eps)``, differentiable by autograd (LayerNorm, RMSNorm)."""


def weight_grad(grad: Tensor, x: Tensor) -> Tensor:
    """``gradᵀ x`` over all leading dims: ``[..., n], [..., k] -> [n, k]``."""
    return grad.reshape(-1, grad.shape[-1]).t().matmul(x.reshape(-1, x.shape[-1]))


def interleave(parts: Sequence[Tensor], groups: int) -> Tensor:
    """Rows of ``parts`` interleaved group by group: each part ``[groups·n_i, ...]`` viewed as
    ``[groups, n_i, ...]`` and concatenated along the second dimension, ``[groups·Σn_i, ...]``
    (one part: itself). This is how Q, K and V rows sit in the fused QKV output."""
    if len(parts) == 1:
        return parts[0]
    views = [p.reshape(groups, p.shape[0] // groups, *p.shape[1:]) for p in parts]
    joined = torch.cat(views, dim=1)
    return joined.reshape(-1, *joined.shape[2:])


def deinterleave(whole: Tensor, sizes: Sequence[int], groups: int) -> list[Tensor]:
    """The inverse of :func:`interleave`: ``sizes`` are the parts' row counts."""
    if len(sizes) == 1:
        return [whole]
    per_group = [n // groups for n in sizes]
    view = whole.reshape(groups, sum(per_group), *whole.shape[1:])
    return [p.reshape(-1, *whole.shape[1:]) for p in view.split(per_group, dim=1)]


class _ColumnParallelFn(torch.autograd.Function):
    """``y = norm(x) Wᵀ + b`` with a column (output) shard of ``W``, where ``W`` is one or more
    weights whose rows are interleaved per group (:func:`interleave`; the fused QKV's
    ``[group][q_1 … q_r | k | v]``, SwiGLU's ``[gate | up]``), and the input saved as given.

    forward:  ``norm`` (optional) on x; sequence_parallel: gather ``[s/t, b, k] -> [s, b, k]``
              (g), then one matmul; otherwise matmul on the replicated x (f is the identity).
    backward: grad_in = grad_y W, then reduce-scatter along s (ḡ of g) or all-reduce (f);
              grad_W = grad_yᵀ x_full, re-gathering x_full under sequence parallelism; with
              ``norm``, the norm is recomputed from x (with a graph) and back-propagated.
    saves:    x as given (the local shard under sequence parallelism, the norm's *input* with
              ``norm``), the norm's weight and bias, and the weights.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        norm_weight: Tensor | None,
        norm_bias: Tensor | None,
        norm: NormFn | None,
        eps: float,
        groups: int,
        group: Group,
        sequence_parallel: bool,
        *params: Tensor | None,
    ) -> Tensor:
        weights = [w for w in params[0::2] if w is not None]
        biases = list(params[1::2])
        ctx.norm, ctx.eps, ctx.groups = norm, eps, groups
        ctx.group, ctx.sequence_parallel = group, sequence_parallel
        ctx.has_bias = [b is not None for b in biases]
        ctx.save_for_backward(x, norm_weight, norm_bias, *weights)
        y = (
            norm(x, norm_weight, norm_bias, eps)
            if norm is not None and norm_weight is not None
            else x
        )
        full = all_gather_sequence(y, group) if sequence_parallel else y  # [s, b, k]
        out = torch.matmul(full, interleave(weights, groups).t())  # [s, b, Σn/t]
        present = [b for b in biases if b is not None]
        if present:
            out = out + interleave(present, groups)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, norm_weight, norm_bias, *weights = ctx.saved_tensors
        group, sp, groups = ctx.group, ctx.sequence_parallel, ctx.groups
        leaves: list[Tensor] = []
        y = x
        if ctx.norm is not None:
            with torch.enable_grad():  # the norm again, this time with a graph
                leaves = [
                    t.detach().requires_grad_(True)
                    for t in (x, norm_weight, norm_bias)
                    if t is not None
                ]
                bias = leaves[2] if norm_bias is not None else None
                y = ctx.norm(leaves[0], leaves[1], bias, ctx.eps)
        weight = interleave(weights, groups)
        grad_full = torch.matmul(grad, weight)  # [s, b, k], a partial sum per rank
        grad_y = reduce_scatter_sequence(grad_full, group) if sp else all_reduce(grad_full, group)
        full = all_gather_sequence(y.detach(), group) if sp else y.detach()
        sizes = [w.shape[0] for w in weights]
        grad_ws = deinterleave(weight_grad(grad, full), sizes, groups)
        grad_bs: list[Tensor | None] = [None] * len(sizes)
        if any(ctx.has_bias):  # no reduction over every token for a bias-free model
            summed = deinterleave(grad.reshape(-1, grad.shape[-1]).sum(0), sizes, groups)
            grad_bs = [g if has else None for g, has in zip(summed, ctx.has_bias, strict=True)]
        params: list[Tensor | None] = []
        for w_grad, b_grad in zip(grad_ws, grad_bs, strict=True):
            params += [w_grad, b_grad]
        grad_x, grad_nw, grad_nb = grad_y, None, None
        if ctx.norm is not None:
            grads = torch.autograd.grad(y, leaves, grad_y)
            grad_x, grad_nw = grads[0], grads[1]
            grad_nb = grads[2] if norm_bias is not None else None
        return (grad_x, grad_nw, grad_nb, None, None, None, None, None, *params)


def column_parallel_linear(
    x: Tensor,
    weight: Tensor | Sequence[Tensor],
    bias: Tensor | Sequence[Tensor | None] | None,
    group: Group,
    sequence_parallel: bool,
    *,
    norm: NormFn | None = None,
    norm_weight: Tensor | None = None,
    norm_bias: Tensor | None = None,
    eps: float = 0.0,
    groups: int = 1,
) -> Tensor:
    """Column-parallel linear (see :class:`_ColumnParallelFn`), optionally with several
    weights (interleaved per ``groups``) and a norm applied first and recomputed in backward.

    ``x``: ``[s/t, b, k]`` under sequence parallelism, else ``[s, b, k]``; returns ``[s, b,
    Σn/t]``.
    """
    weights = [weight] if isinstance(weight, Tensor) else list(weight)
    biases = [bias] * len(weights) if bias is None or isinstance(bias, Tensor) else list(bias)
    if norm is None and len(weights) == 1 and group_size(group) == 1:
        return nn.functional.linear(x, weights[0], biases[0])
    params = [p for pair in zip(weights, biases, strict=True) for p in pair]
    return _ColumnParallelFn.apply(
        x, norm_weight, norm_bias, norm, eps, groups, group, sequence_parallel, *params
    )


class ColumnParallelLinear(nn.Module):
    """A linear layer whose output features are split over the tensor-parallel group.

    Weight shard ``[out/t, in]``; input replicated ``[s, b, in]`` or, with
    ``sequence_parallel``, a sequence shard ``[s/t, b, in]``; output ``[s, b, out/t]``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        state: ParallelState,
        *,
        sequence_parallel: bool,
        bias: bool = True,
        init_std: float = 0.02,
        replicas: int = 1,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        """``replicas``: how many consecutive tensor-parallel ranks hold the same slice (each
        rank then holds ``out·replicas/t`` rows; its gradient is summed over them by
        :func:`~lightning_sp.parallel.grads.finalize_grads`). Grouped-query attention with
        fewer key/value heads than ranks uses it."""
        super().__init__()
        t, rank = state.tensor_parallel_size, state.tensor_parallel_rank
        local = divide(out_features * replicas, t, "out_features * replicas")
        start = rank // replicas * local
        self.group, self.sequence_parallel = state.tp_group, sequence_parallel
        self.weight = mark_parameter(
            nn.Parameter(torch.empty(local, in_features, dtype=dtype, device=device)),
            shard=ShardSpec(0, start, replicas),
            std=init_std,
        )
        self.bias = (
            mark_parameter(
                nn.Parameter(torch.empty(local, dtype=dtype, device=device)),
                shard=ShardSpec(0, start, replicas),
                init="zeros",
            )
            if bias
            else None
        )

    def forward(self, x: Tensor) -> Tensor:
        return column_parallel_linear(x, self.weight, self.bias, self.group, self.sequence_parallel)


class RowParallelLinear(nn.Module):
    """A linear layer whose input features are split over the tensor-parallel group.

    Weight shard ``[out, in/t]``; input ``[s, b, in/t]``; the partial products are summed by
    f̄ (all-reduce, output ``[s, b, out]``) or, with ``sequence_parallel``, by ḡ
    (reduce-scatter, output ``[s/t, b, out]``); the replicated bias is added after.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        state: ParallelState,
        *,
        sequence_parallel: bool,
        bias: bool = True,
        init_std: float = 0.02,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        t, rank = state.tensor_parallel_size, state.tensor_parallel_rank
        local = divide(in_features, t, "in_features")
        self.group, self.sequence_parallel = state.tp_group, sequence_parallel
        self.weight = mark_parameter(
            nn.Parameter(torch.empty(out_features, local, dtype=dtype, device=device)),
            shard=ShardSpec(1, rank * local),
            std=init_std,
        )
        self.bias = (
            mark_parameter(
                nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)),
                init="zeros",
                sequence_parallel=sequence_parallel,
            )
            if bias
            else None
        )

    def reduce(self, partial: Tensor) -> Tensor:
        """Sum this layer's partial products over the group (ḡ or f̄) and add the replicated
        bias: ``[s, b, out]`` per rank -> ``[s/t or s, b, out]``."""
        group = self.group
        out = g_bar(partial, group) if self.sequence_parallel else f_bar(partial, group)
        return out + self.bias if self.bias is not None else out

    def forward(self, x: Tensor) -> Tensor:
        return self.reduce(torch.matmul(x, self.weight.t()))  # [s, b, out] partial per rank
