"""Linears that recompute their producer in their own backward, so the producer's output is
never stored (the effect of Megatron's ``CheckpointWithoutOutput``, as autograd functions whose
saved tensors are exactly what the saved-tensor measurement sees).

* :func:`norm_column_linear`: LayerNorm -> column-parallel linear, saving the LayerNorm's
  *input* (which the layer keeps anyway as the residual); the normalised tensor is recomputed
  in backward. Drops the linear's ``2sbh`` input (``2sbh/t`` under sequence parallelism).
* :func:`gelu_row_linear`: GeLU -> row-parallel linear, saving the GeLU *input* (fc1's output,
  which the GeLU's own backward needs anyway); drops fc2's ``2sbf/t`` input.
* :func:`heads_row_linear`: the attention output projection fed directly with the attention
  core's ``[b·a/t, s, d]`` output, saving that tensor itself rather than a ``[s, b, h/t]`` copy
  (so under ``sdpa`` the projection and SDPA share one stored output).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from lightning_sp.parallel.comm import (
    Group,
    all_gather_sequence,
    all_reduce,
    f_bar,
    g_bar,
    reduce_scatter_sequence,
)
from lightning_sp.parallel.layers import ColumnParallelLinear, RowParallelLinear


def _weight_grad(grad: Tensor, x: Tensor) -> Tensor:
    """``gradᵀ x`` over all leading dims: ``[..., n], [..., k] -> [n, k]``."""
    return grad.reshape(-1, grad.shape[-1]).t().matmul(x.reshape(-1, x.shape[-1]))


class _NormColumnLinear(torch.autograd.Function):
    """``LayerNorm(x) Wᵀ + b`` column-parallel; saves ``x`` (not the normalised tensor)."""

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        norm_weight: Tensor,
        norm_bias: Tensor,
        eps: float,
        weight: Tensor,
        bias: Tensor | None,
        group: Group,
        sequence_parallel: bool,
    ) -> Tensor:
        ctx.eps, ctx.group, ctx.sequence_parallel = eps, group, sequence_parallel
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x, norm_weight, norm_bias, weight)
        y = nn.functional.layer_norm(x, x.shape[-1:], norm_weight, norm_bias, eps)
        full = all_gather_sequence(y, group) if sequence_parallel else y  # [s, b, h]
        out = torch.matmul(full, weight.t())  # [s, b, n/t]
        return out + bias if bias is not None else out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, norm_weight, norm_bias, weight = ctx.saved_tensors
        with torch.enable_grad():  # the LayerNorm again, this time with a graph
            leaves = [t.detach().requires_grad_(True) for t in (x, norm_weight, norm_bias)]
            y = nn.functional.layer_norm(leaves[0], x.shape[-1:], leaves[1], leaves[2], ctx.eps)
        group, sp = ctx.group, ctx.sequence_parallel
        grad_full = torch.matmul(grad, weight)  # [s, b, h], a partial sum per rank
        grad_y = reduce_scatter_sequence(grad_full, group) if sp else all_reduce(grad_full, group)
        full = all_gather_sequence(y.detach(), group) if sp else y.detach()
        grad_w = _weight_grad(grad, full)
        grad_b = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.has_bias else None
        grad_x, grad_nw, grad_nb = torch.autograd.grad(y, leaves, grad_y)
        return grad_x, grad_nw, grad_nb, None, grad_w, grad_b, None, None


def norm_column_linear(x: Tensor, norm: nn.LayerNorm, linear: ColumnParallelLinear) -> Tensor:
    """``linear(norm(x))`` storing ``x`` instead of ``norm(x)``: ``[s/t or s, b, h] -> [s, b,
    n/t]``. Same result and gradients as the two modules applied in turn."""
    return _NormColumnLinear.apply(
        x, norm.weight, norm.bias, norm.eps, linear.weight, linear.bias,
        linear.group, linear.sequence_parallel,
    )  # fmt: skip


def _row_parallel_output(partial: Tensor, linear: RowParallelLinear) -> Tensor:
    """Sum the row-parallel partial products (ḡ or f̄) and add the replicated bias."""
    group = linear.group
    out = g_bar(partial, group) if linear.sequence_parallel else f_bar(partial, group)
    return out + linear.bias if linear.bias is not None else out


class _GeluMatmul(torch.autograd.Function):
    """``gelu(z) Wᵀ`` (a row-parallel partial product); saves ``z``, not ``gelu(z)``."""

    @staticmethod
    def forward(ctx: Any, z: Tensor, weight: Tensor, approximate: str) -> Tensor:
        ctx.approximate = approximate
        ctx.save_for_backward(z, weight)
        return torch.matmul(nn.functional.gelu(z, approximate=approximate), weight.t())

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        z, weight = ctx.saved_tensors
        grad_w = _weight_grad(grad, nn.functional.gelu(z, approximate=ctx.approximate))
        grad_z = torch.ops.aten.gelu_backward(
            torch.matmul(grad, weight), z, approximate=ctx.approximate
        )
        return grad_z, grad_w, None


def gelu_row_linear(z: Tensor, linear: RowParallelLinear, approximate: str = "none") -> Tensor:
    """``linear(gelu(z))`` storing ``z`` instead of ``gelu(z)``: ``[s, b, f/t] -> [s/t or s,
    b, h]``. ``approximate``: ``"none"`` (exact erf) or ``"tanh"``, as ``F.gelu``."""
    return _row_parallel_output(_GeluMatmul.apply(z, linear.weight, approximate), linear)


class _HeadsMatmul(torch.autograd.Function):
    """``[b·a/t, s, d]`` heads times ``Wᵀ`` as ``[s, b, h/t] @ Wᵀ``; saves the heads tensor
    as given (its merged ``[s, b, h/t]`` view is a free view when the tensor is laid out
    ``[s, b·a/t, d]``, as SDPA's output is, else a transient copy)."""

    @staticmethod
    def forward(ctx: Any, heads: Tensor, weight: Tensor, b: int) -> Tensor:
        ctx.b = b
        ctx.save_for_backward(heads, weight)
        return torch.matmul(_merge(heads, b), weight.t())

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        heads, weight = ctx.saved_tensors
        grad_w = _weight_grad(grad, _merge(heads, ctx.b))
        n, s, d = heads.shape
        grad_heads = torch.matmul(grad, weight).view(s, n, d).transpose(0, 1)
        return grad_heads, grad_w, None


def _merge(heads: Tensor, b: int) -> Tensor:
    """``[b·a/t, s, d] -> [s, b, a/t·d]``."""
    n, s, d = heads.shape
    return heads.transpose(0, 1).reshape(s, b, n // b * d)


def heads_row_linear(heads: Tensor, linear: RowParallelLinear, b: int) -> Tensor:
    """``linear`` applied to the attention core's output ``[b·a/t, s, d]`` (heads merged to
    ``[s, b, h/t]``), storing that output itself: ``-> [s/t or s, b, h]``."""
    return _row_parallel_output(_HeadsMatmul.apply(heads, linear.weight, b), linear)
