"""Linears that recompute their producer in their own backward, so the producer's output is
never stored (the effect of Megatron's ``CheckpointWithoutOutput``, as autograd functions whose
saved tensors are exactly what the saved-tensor measurement sees), and the MLP activation
saving only its input.

* :func:`norm_column_linear`: norm (LayerNorm or RMSNorm) -> column-parallel linear(s),
  saving the norm's *input* (which the layer keeps anyway as the residual); the normalised
  tensor is recomputed in backward. Drops the linear's ``2sbh`` input (``2sbh/t`` under
  sequence parallelism). The one column-parallel backward is
  :func:`lightning_sp.parallel.layers.column_parallel_linear`'s.
* :func:`activate`: the MLP activation saving its input ``z`` only (SwiGLU's ``[gate | up]``).
* :func:`act_row_linear`: activation -> row-parallel linear, saving the activation's *input*
  (``z``, which its own backward needs anyway); drops fc2's ``2sbf/t`` input.
* :func:`heads_row_linear`: the attention output projection fed directly with the attention
  core's ``[B, r, s, d]`` output, saving that tensor itself rather than a ``[s, b, h/t]`` copy
  (so under ``sdpa`` the projection and SDPA share one stored output).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_sp.model.spec import ActivationKind, NormKind, NormModule
from lightning_sp.parallel.fp8_linears import fp8_column_linear, fp8_row_matmul
from lightning_sp.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    column_parallel_linear,
)
from lightning_sp.parallel.lora import LoRA, adapter_tensors, row_backward, row_forward


def fused_column_linear(
    x: Tensor,
    linears: Sequence[ColumnParallelLinear],
    groups: int = 1,
    norm: NormModule | None = None,
    kind: NormKind | None = None,
) -> Tensor:
    """``[linear(norm(x)) for linear in linears]`` as one matmul, rows interleaved per
    ``groups`` (:func:`~lightning_sp.parallel.layers.interleave`): ``[s/t or s, b, h] -> [s, b,
    Σn/t]``. With ``norm`` (of descriptor ``kind``), ``x`` is the norm's input and is what is
    saved; the norm is recomputed in backward. Same result and gradients as the modules applied
    in turn."""
    first = linears[0]
    weights, biases = [linear.weight for linear in linears], [linear.bias for linear in linears]
    normed: dict[str, Any] = {
        "norm": kind.functional if norm is not None and kind is not None else None,
        "norm_weight": norm.weight if norm is not None else None,
        "norm_bias": norm.bias if norm is not None else None,
        "eps": norm.eps if norm is not None else 0.0,
        "groups": groups,
    }
    if first.fp8 is not None:  # float8 GEMMs, one per weight (no adapters: refused with FP8)
        return fp8_column_linear(
            x, weights, biases, first.group, first.sequence_parallel, first.fp8, **normed
        )
    adapters = [linear.lora for linear in linears]
    return column_parallel_linear(
        x, weights, biases, first.group, first.sequence_parallel, **normed, adapters=adapters
    )


class _Activate(torch.autograd.Function):
    """``act(z)`` saving ``z`` only (its backward recomputes what it needs from ``z``)."""

    @staticmethod
    def forward(ctx: Any, z: Tensor, kind: ActivationKind) -> Tensor:
        ctx.kind = kind
        ctx.save_for_backward(z)
        return kind.forward(z)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        (z,) = ctx.saved_tensors
        return ctx.kind.backward(grad, z), None


def activate(z: Tensor, kind: ActivationKind) -> Tensor:
    """The MLP activation ``kind`` on ``z`` (``[s, b, f/t]``, or ``[gate | up]`` of ``2f/t``),
    saving ``z`` only: ``-> [s, b, f/t]``."""
    if torch.is_grad_enabled() and z.requires_grad:
        return _Activate.apply(z, kind)
    return kind.forward(z)


class _ActMatmul(torch.autograd.Function):
    """``act(z) Wᵀ`` (a row-parallel partial product, with its LoRA adapter's when it has
    one: :func:`~lightning_sp.parallel.lora.row_forward`); saves ``z``, not ``act(z)`` (and the
    adapter's low-rank activation and mask); no weight-gradient GEMM for a frozen ``W``."""

    @staticmethod
    def forward(
        ctx: Any, z: Tensor, weight: Tensor, kind: ActivationKind, adapter: LoRA | None,
        *pair: Tensor,
    ) -> Tensor:  # fmt: skip
        ctx.kind, ctx.adapter = kind, adapter
        out, lora = row_forward(kind.forward(z), weight, adapter)
        ctx.save_for_backward(z, weight, *lora)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        z, weight, *lora = ctx.saved_tensors
        kind: ActivationKind = ctx.kind
        grad_y, grad_w, grad_a, grad_b = row_backward(
            grad, kind.forward(z), weight, ctx.needs_input_grad[1], ctx.adapter, *lora
        )
        grad_z = kind.backward(grad_y, z)
        return grad_z, grad_w, None, None, *((grad_a, grad_b) if lora else ())


def act_row_linear(z: Tensor, linear: RowParallelLinear, kind: ActivationKind) -> Tensor:
    """``linear(act(z))`` storing ``z`` instead of ``act(z)``: ``[s, b, f/t]`` (gated: ``[s, b,
    2f/t]``) ``-> [s/t or s, b, h]``."""
    if linear.fp8 is not None:
        return linear.reduce(fp8_row_matmul(z, linear.weight, linear.fp8, linear.group, _Act(kind)))
    adapter = linear.lora
    return linear.reduce(
        _ActMatmul.apply(z, linear.weight, kind, adapter, *adapter_tensors(adapter))
    )


class _HeadsMatmul(torch.autograd.Function):
    """The attention core's ``[B, r, s, d]`` context (``B = b·g/t``) times ``Wᵀ`` as
    ``[s, b, h/t] @ Wᵀ`` (with the LoRA adapter's partial product when it has one); saves the
    context tensor as given (its merged ``[s, b, h/t]`` view is a free view when the tensor is
    laid out ``[s, B, r, d]``, as SDPA's output is for ``r = 1``, else a transient copy), and the
    adapter's low-rank activation and mask; no weight-gradient GEMM for a frozen ``W``."""

    @staticmethod
    def forward(
        ctx: Any, heads: Tensor, weight: Tensor, b: int, adapter: LoRA | None, *pair: Tensor
    ) -> Tensor:
        ctx.b, ctx.adapter = b, adapter
        out, lora = row_forward(_merge(heads, b), weight, adapter)
        ctx.save_for_backward(heads, weight, *lora)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        heads, weight, *lora = ctx.saved_tensors
        grad_x, grad_w, grad_a, grad_b = row_backward(
            grad, _merge(heads, ctx.b), weight, ctx.needs_input_grad[1], ctx.adapter, *lora
        )
        n, r, s, d = heads.shape
        grad_heads = grad_x.view(s, n, r, d).permute(1, 2, 0, 3)
        return grad_heads, grad_w, None, None, *((grad_a, grad_b) if lora else ())


def _merge(heads: Tensor, b: int) -> Tensor:
    """``[B, r, s, d] -> [s, b, B/b·r·d]`` (heads in ``[group][query head]`` order)."""
    n, r, s, d = heads.shape
    return heads.permute(2, 0, 1, 3).reshape(s, b, n // b * r * d)


def heads_row_linear(heads: Tensor, linear: RowParallelLinear, b: int) -> Tensor:
    """``linear`` applied to the attention core's context ``[B, r, s, d]`` (heads merged to
    ``[s, b, h/t]``), storing that context itself: ``-> [s/t or s, b, h]``."""
    if linear.fp8 is not None:
        merge = _Heads(b)
        return linear.reduce(fp8_row_matmul(heads, linear.weight, linear.fp8, linear.group, merge))
    adapter = linear.lora
    return linear.reduce(
        _HeadsMatmul.apply(heads, linear.weight, b, adapter, *adapter_tensors(adapter))
    )


class _Act:
    """The MLP activation as a float8 row linear's producer (its input ``z`` kept)."""

    def __init__(self, kind: ActivationKind) -> None:
        self.kind = kind

    def forward(self, source: Tensor) -> Tensor:
        return self.kind.forward(source)

    def backward(self, grad: Tensor, source: Tensor) -> Tensor:
        return self.kind.backward(grad, source)


class _Heads:
    """The attention heads' merge ``[B, r, s, d] -> [s, b, h/t]`` as a float8 row linear's
    producer (the core's context kept as given, as :class:`_HeadsMatmul` keeps it)."""

    def __init__(self, b: int) -> None:
        self.b = b

    def forward(self, source: Tensor) -> Tensor:
        return _merge(source, self.b)

    def backward(self, grad: Tensor, source: Tensor) -> Tensor:
        n, r, s, d = source.shape
        return grad.view(s, n, r, d).permute(1, 2, 0, 3)
