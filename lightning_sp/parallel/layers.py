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

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

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
from lightning_sp.parallel.fp8_linears import fp8_column_linear, fp8_row_matmul
from lightning_sp.parallel.fused_norm import NormFn, column_grads, norm_with_graph
from lightning_sp.parallel.init import ShardSpec, mark_parameter
from lightning_sp.parallel.lora import (
    LoRA,
    adapter_tensors,
    column_b_blocks,
    column_b_grads,
    column_backward,
    column_low,
    row_backward,
    row_forward,
)
from lightning_sp.parallel.state import ParallelState

if TYPE_CHECKING:
    from lightning_sp.parallel.fp8 import Recipe


def divide(numerator: int, denominator: int, what: str) -> int:
    """``numerator // denominator``; a ``ValueError`` naming ``what`` unless it divides."""
    if numerator % denominator:
        raise ValueError(f"{what}={numerator} is not divisible by {denominator}")
    return numerator // denominator


def tensor_parallel_weight(
    full_shape: tuple[int, int],
    dim: int,
    state: ParallelState,
    what: str,
    *,
    init_std: float,
    replicas: int = 1,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> tuple[nn.Parameter, ShardSpec]:
    """This rank's shard of a ``full_shape`` weight split along ``dim`` over the tensor-parallel
    group, and where it sits: ``full_shape[dim]·replicas/t`` rows starting at ``rank // replicas``
    such shards (``replicas`` consecutive ranks hold the same one). The weight is empty and
    marked for initialisation (normal, ``init_std``) and resharding; a ``ValueError`` naming
    ``what`` unless the split divides."""
    t, rank = state.tensor_parallel_size, state.tensor_parallel_rank
    local = divide(full_shape[dim] * replicas, t, what)
    shard = ShardSpec(dim, rank // replicas * local, replicas)
    shape = list(full_shape)
    shape[dim] = local
    weight = nn.Parameter(torch.empty(shape, dtype=dtype, device=device))
    return mark_parameter(weight, shard=shard, std=init_std), shard


class TensorParallelModule(nn.Module):
    """A module holding ``weight``, this rank's shard of a ``full_shape`` weight split along
    ``dim`` over the tensor-parallel group (:func:`tensor_parallel_weight`; ``shard`` says where
    it sits), the group (``group``) and whether its activations are sequence-parallel."""

    def __init__(
        self, full_shape: tuple[int, int], dim: int, state: ParallelState, what: str, *,
        sequence_parallel: bool, init_std: float, replicas: int = 1,
        dtype: torch.dtype | None = None, device: torch.device | str | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        self.group, self.sequence_parallel = state.tp_group, sequence_parallel
        self.weight, self.shard = tensor_parallel_weight(
            full_shape, dim, state, what, init_std=init_std, replicas=replicas, dtype=dtype,
            device=device,
        )  # fmt: skip

    def zero_bias(self, rows: int, bias: bool, **marks: Any) -> nn.Parameter | None:
        """A bias of ``rows`` in the weight's dtype and device, marked to start at zero (and
        with ``marks``: :func:`~lightning_sp.parallel.init.mark_parameter`); None without
        ``bias``."""
        if not bias:
            return None
        weight = self.weight
        empty = torch.empty(rows, dtype=weight.dtype, device=weight.device)
        return mark_parameter(nn.Parameter(empty), init="zeros", **marks)


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
    ``[group][q_1 … q_r | k | v]``, SwiGLU's ``[gate | up]``), and the input saved as given;
    with LoRA adapters (:mod:`lightning_sp.parallel.lora`), one per weight or none, plus
    ``s · B A drop(x)`` on the same gathered input, interleaved like the weights.

    forward:  ``norm`` (optional) on x; sequence_parallel: gather ``[s/t, b, k] -> [s, b, k]``
              (g), then one matmul; otherwise matmul on the replicated x (f is the identity).
    backward: grad_in = grad_y W (+ the adapters' share), then reduce-scatter along s (ḡ of g)
              or all-reduce (f); grad_W = grad_yᵀ x_full (only for weights that need one: a
              frozen base has none), re-gathering x_full under sequence parallelism; with
              ``norm``, the norm is recomputed from x (with a graph) and back-propagated.
    saves:    x as given (the local shard under sequence parallelism, the norm's *input* with
              ``norm``), the norm's weight and bias, and the weights; with adapters their
              low-rank activation ``[s, b, Σr]`` and dropout masks. A frozen linear (no weight
              needing a gradient) without adapters and without ``norm`` keeps no ``x``, as
              autograd's own linear does: its input gradient needs only ``W``.
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
        adapters: tuple[LoRA | None, ...] | None,
        *params: Tensor | None,
    ) -> Tensor:
        n = len(adapters) if adapters is not None else len(params) // 2
        weights = [w for w in params[0 : 2 * n : 2] if w is not None]
        biases = list(params[1 : 2 * n : 2])
        ctx.norm, ctx.eps, ctx.groups = norm, eps, groups
        ctx.group, ctx.sequence_parallel = group, sequence_parallel
        ctx.has_bias = [b is not None for b in biases]
        ctx.adapters = adapters
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
        saved: list[Tensor | None] = []
        if adapters is not None:
            adapted = [a for a in adapters if a is not None]
            low, masks = column_low(full, adapted)  # [s, b, Σr]
            blocks = column_b_blocks(adapters, [w.shape[0] for w in weights], adapted[0].scaling)
            out = out + torch.matmul(low, interleave(blocks, groups).t())
            saved = [low, *masks]
        first = 9  # the index of the first weight among forward's inputs
        needs_x = (
            norm is not None
            or adapters is not None
            or any(ctx.needs_input_grad[first + 2 * i] for i in range(len(weights)))
        )  # a frozen linear without adapters needs only W for the input gradient
        kept = x if needs_x else None
        ctx.save_for_backward(kept, norm_weight, norm_bias, *saved, *weights)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, norm_weight, norm_bias, *rest = ctx.saved_tensors
        adapters: tuple[LoRA | None, ...] | None = ctx.adapters
        adapted = [a for a in adapters if a is not None] if adapters is not None else []
        low, masks = (rest[0], rest[1 : 1 + len(adapted)]) if adapted else (None, [])
        weights = rest[1 + len(adapted) :] if adapted else rest
        group, sp, groups = ctx.group, ctx.sequence_parallel, ctx.groups
        y, leaves = norm_with_graph(ctx.norm, ctx.eps, x, norm_weight, norm_bias)
        weight = interleave(weights, groups)
        sizes = [w.shape[0] for w in weights]
        first = 9  # the index of the first weight among forward's inputs
        need_w = [ctx.needs_input_grad[first + 2 * i] for i in range(len(weights))]
        full = None
        if any(need_w) or adapted:
            full = all_gather_sequence(y.detach(), group) if sp else y.detach()
        grad_full = torch.matmul(grad, weight)  # [s, b, k], a partial sum per rank
        lora_grads: list[Tensor] = []
        if adapted:
            assert adapters is not None and low is not None and full is not None
            blocks = column_b_blocks(adapters, sizes, adapted[0].scaling)
            grad_low = torch.matmul(grad, interleave(blocks, groups))  # [s, b, Σr]
            grad_in, grad_as = column_backward(grad_low, full, adapted, masks)
            grad_full = grad_full + grad_in
            scaled = deinterleave(weight_grad(grad, low), sizes, groups)
            grad_lora_bs = column_b_grads([g.mul_(adapted[0].scaling) for g in scaled], adapters)
            lora_grads = [g for pair in zip(grad_as, grad_lora_bs, strict=True) for g in pair]
        grad_y = reduce_scatter_sequence(grad_full, group) if sp else all_reduce(grad_full, group)
        grad_ws: list[Tensor | None] = [None] * len(sizes)
        if any(need_w):
            assert full is not None
            grad_ws = list(deinterleave(weight_grad(grad, full), sizes, groups))
            grad_ws = [g if need else None for g, need in zip(grad_ws, need_w, strict=True)]
        grad_bs: list[Tensor | None] = [None] * len(sizes)
        if any(ctx.has_bias):  # no reduction over every token for a bias-free model
            summed = deinterleave(grad.reshape(-1, grad.shape[-1]).sum(0), sizes, groups)
            grad_bs = [g if has else None for g, has in zip(summed, ctx.has_bias, strict=True)]
        grads = column_grads(y, leaves, grad_y, norm_bias is not None, grad_ws, grad_bs)
        return (*grads, *lora_grads)


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
    adapters: Sequence[LoRA | None] | None = None,
) -> Tensor:
    """Column-parallel linear (see :class:`_ColumnParallelFn`), optionally with several
    weights (interleaved per ``groups``), a norm applied first and recomputed in backward, and
    LoRA ``adapters`` (one per weight, ``None`` for a weight without one; one scaling).

    ``x``: ``[s/t, b, k]`` under sequence parallelism, else ``[s, b, k]``; returns ``[s, b,
    Σn/t]``.
    """
    weights = [weight] if isinstance(weight, Tensor) else list(weight)
    biases = [bias] * len(weights) if bias is None or isinstance(bias, Tensor) else list(bias)
    lora = tuple(adapters) if adapters is not None and any(adapters) else None
    if norm is None and len(weights) == 1 and group_size(group) == 1 and lora is None:
        return nn.functional.linear(x, weights[0], biases[0])
    params = [p for pair in zip(weights, biases, strict=True) for p in pair]
    if lora is not None:
        params += [p for a in lora if a is not None for p in adapter_tensors(a)]
    return _ColumnParallelFn.apply(
        x, norm_weight, norm_bias, norm, eps, groups, group, sequence_parallel, lora, *params
    )


class ColumnParallelLinear(TensorParallelModule):
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
        super().__init__((out_features, in_features), 0, state, "out_features * replicas",
                         sequence_parallel=sequence_parallel, init_std=init_std,
                         replicas=replicas, dtype=dtype, device=device)  # fmt: skip
        self.bias = self.zero_bias(self.weight.shape[0], bias, shard=self.shard)
        self.lora: LoRA | None = None
        """A LoRA adapter on this linear (:mod:`lightning_sp.parallel.lora`), if one is attached."""
        self.fp8: Recipe | None = None
        """Its GEMMs in float8 with this recipe (:mod:`lightning_sp.parallel.fp8_linears`)."""

    def forward(self, x: Tensor) -> Tensor:
        if self.fp8 is not None:
            return fp8_column_linear(
                x, [self.weight], [self.bias], self.group, self.sequence_parallel, self.fp8
            )
        return column_parallel_linear(
            x, self.weight, self.bias, self.group, self.sequence_parallel, adapters=[self.lora]
        )


class RowParallelLinear(TensorParallelModule):
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
        super().__init__((out_features, in_features), 1, state, "in_features",
                         sequence_parallel=sequence_parallel, init_std=init_std, dtype=dtype,
                         device=device)  # fmt: skip
        self.bias = self.zero_bias(out_features, bias, sequence_parallel=sequence_parallel)
        self.lora: LoRA | None = None
        """A LoRA adapter on this linear (:mod:`lightning_sp.parallel.lora`), if one is attached:
        its partial product joins the linear's before :meth:`reduce`."""
        self.fp8: Recipe | None = None
        """Its GEMMs in float8 with this recipe (:mod:`lightning_sp.parallel.fp8_linears`)."""

    def reduce(self, partial: Tensor) -> Tensor:
        """Sum this layer's partial products over the group (ḡ or f̄) and add the replicated
        bias: ``[s, b, out]`` per rank -> ``[s/t or s, b, out]``."""
        group = self.group
        out = g_bar(partial, group) if self.sequence_parallel else f_bar(partial, group)
        return out + self.bias if self.bias is not None else out

    def forward(self, x: Tensor) -> Tensor:
        if self.fp8 is not None:
            return self.reduce(fp8_row_matmul(x, self.weight, self.fp8, self.group))
        if self.lora is None:
            return self.reduce(torch.matmul(x, self.weight.t()))  # [s, b, out] partial per rank
        return self.reduce(
            _RowAdaptedFn.apply(x, self.weight, self.lora, *adapter_tensors(self.lora))
        )


class _RowAdaptedFn(torch.autograd.Function):
    """A row-parallel linear's partial product with its LoRA adapter's,
    ``x Wᵀ + s · B A drop(x)`` (:func:`~lightning_sp.parallel.lora.row_forward`); saves ``x``,
    ``W``, the low-rank activation ``[s, b, r]`` and the dropout mask; no weight-gradient GEMM
    for a frozen ``W``."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, adapter: LoRA, *pair: Tensor) -> Tensor:
        out, saved = row_forward(x, weight, adapter)
        ctx.adapter = adapter
        ctx.save_for_backward(x, weight, *saved)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, weight, low, mask = ctx.saved_tensors
        need_w = ctx.needs_input_grad[1]
        grad_x, grad_w, grad_a, grad_b = row_backward(
            grad, x, weight, need_w, ctx.adapter, low, mask
        )
        return grad_x, grad_w, None, grad_a, grad_b
