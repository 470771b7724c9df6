"""The GPT's own tensor-parallel linears in float8 (:mod:`lightning_sp.parallel.fp8`'s recipes):
the fused column-parallel linear (several weights interleaved per group, an optional norm
recomputed in backward, sequence parallelism's all-gather) and the row-parallel partial product
(its input made by an optional producer: the MLP activation, the attention heads' merge).

Granularity is torchao's ``Float8Linear`` on each weight: a fused QKV (or SwiGLU's
``[gate | up]``) runs one float8 GEMM per weight, each with its own weight and output-gradient
scales, as ``Float8Linear`` on separate ``q_proj``, ``k_proj``, ``v_proj`` does (torchtitan's
layers); the input's cast is shared (the same ``x``, the same scale).

What a linear keeps for backward: with a recipe whose forward cast of ``x`` is also its
weight-gradient cast (``tensorwise``: :func:`~lightning_sp.parallel.fp8.keeps_float8_input`),
the float8 cast itself, 1 byte an element and a 4-byte scale, instead of the 2-byte ``x``; under
sequence parallelism that is this rank's shard ``[s/t, b, h]`` cast with the scale agreed over
the group (the unsharded tensor's), and the all-gather moves float8 bytes, in forward and again
in backward. ``rowwise`` keeps ``x`` as the high-precision linears do. A linear that recomputes
its input (a norm, an activation) keeps that producer's input, as in high precision, and casts
again in backward (the same values: the cast is deterministic).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

from lightning_sp.parallel.comm import (
    Group,
    all_gather_sequence,
    all_reduce,
    reduce_scatter_sequence,
)
from lightning_sp.parallel.fp8 import (
    LAYOUTS,
    Recipe,
    cast_input,
    float8_input,
    forward_gemm,
    input_grad_gemm,
    keeps_float8_input,
    weight_grad_gemm,
)
from lightning_sp.parallel.fused_norm import NormFn, column_grads, norm_with_graph


def _gathered_input(
    y: Tensor, recipe: Recipe, group: Group, sp: bool
) -> tuple[Any, tuple[Tensor, Tensor] | None]:
    """The column linear's whole input ``[s·b, k]`` cast for the forward GEMM, and (when the
    recipe keeps its float8 input) this rank's float8 shard and scale. Under sequence
    parallelism with a kept input the shard is cast first (amax agreed over the group) and the
    float8 bytes are gathered; otherwise the high-precision input is gathered and cast."""
    k = y.shape[-1]
    if not keeps_float8_input(recipe):
        full = all_gather_sequence(y, group) if sp else y  # [s, b, k]
        return cast_input(full.reshape(-1, k), recipe, group, None), None
    local = cast_input(y.reshape(-1, k), recipe, group, 0 if sp else None)
    data, scale = local._data, local._scale  # [s/t·b, k] float8, a scalar
    full = _gather_float8(data.view(y.shape), group) if sp else data
    return float8_input(full.reshape(-1, k), scale, y.dtype, recipe), (data, scale)


def _gather_float8(data: Tensor, group: Group) -> Tensor:
    """All-gather float8 ``[s/t, ...]`` along dim 0 (as bytes: collectives take no float8)."""
    return all_gather_sequence(data.view(torch.uint8), group).view(data.dtype)


def _interleave_columns(outs: Sequence[Tensor], groups: int) -> Tensor:
    """The GEMMs' outputs ``[m, nᵢ]`` side by side as the fused linear's ``[m, Σnᵢ]``, columns
    interleaved per group as :func:`~lightning_sp.parallel.layers.interleave` does rows."""
    if len(outs) == 1:
        return outs[0]
    m = outs[0].shape[0]
    joined = torch.cat([o.reshape(m, groups, -1) for o in outs], dim=2)
    return joined.reshape(m, -1)


def _split_columns(whole: Tensor, sizes: Sequence[int], groups: int) -> list[Tensor]:
    """The inverse of :func:`_interleave_columns`: ``[m, Σnᵢ]`` -> ``[m, nᵢ]`` each
    (contiguous)."""
    if len(sizes) == 1:
        return [whole]
    m = whole.shape[0]
    view = whole.reshape(m, groups, -1)
    parts = view.split([n // groups for n in sizes], dim=2)
    return [p.reshape(m, -1) for p in parts]


def _weight_grad_input(
    y: Tensor | None,
    data: Tensor | None,
    scale: Tensor | None,
    recipe: Recipe,
    group: Group,
    sp: bool,
    b: int,
    dtype: torch.dtype,
) -> tuple[Tensor | None, Any]:
    """The column linear's whole input for its weight-gradient GEMM: ``(None, float8)`` from
    the kept shard (gathered again under SP) or from ``y`` cast again (a recomputed norm), or
    ``(x [s·b, k], None)`` in high precision for a recipe that casts it anew."""
    if data is not None:
        assert scale is not None
        k = data.shape[-1]
        full = _gather_float8(data.view(-1, b, k), group) if sp else data
        return None, float8_input(full.reshape(-1, k), scale, dtype, recipe)
    assert y is not None
    if keeps_float8_input(recipe):
        return None, _gathered_input(y, recipe, group, sp)[0]
    full = all_gather_sequence(y, group) if sp else y
    return full.reshape(-1, full.shape[-1]), None


class _FP8ColumnFn(torch.autograd.Function):
    """``norm(x) Wᵀ + b`` in float8 with ``W`` one or more column shards interleaved per group
    (:func:`~lightning_sp.parallel.layers.interleave`), one GEMM per weight.

    forward:  ``norm`` (optional); cast (and under SP gather) the input; per weight
              ``x Wᵢᵀ`` in float8; outputs interleaved; biases added.
    backward: per weight ``∇yᵢ Wᵢ`` summed (a partial sum: reduce-scatter or all-reduce) and
              ``∇yᵢᵀ x``; the norm recomputed with a graph and back-propagated.
    saves:    ``x`` as given with ``norm``; else the float8 shard and its scale (a recipe that
              keeps its float8 input) or ``x`` as given; the norm's weight and bias; the
              weights.
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
        recipe: Recipe,
        *params: Tensor | None,
    ) -> Tensor:
        weights = [w for w in params[0::2] if w is not None]
        biases = list(params[1::2])
        ctx.norm, ctx.eps, ctx.groups, ctx.recipe = norm, eps, groups, recipe
        ctx.group, ctx.sequence_parallel = group, sequence_parallel
        ctx.has_bias = [b is not None for b in biases]
        y = x
        if norm is not None and norm_weight is not None:
            y = norm(x, norm_weight, norm_bias, eps)
        ctx.dtype = y.dtype
        a, kept = _gathered_input(y, recipe, group, sequence_parallel)
        outs = [forward_gemm(a, w, recipe, group, "column") for w in weights]  # [s·b, nᵢ/t]
        out = _interleave_columns(outs, groups)  # [s·b, Σn/t]
        present = [b for b in biases if b is not None]
        if present:
            out = out + _interleave_columns([b[None] for b in present], groups)
        s = a.shape[0] // y.shape[1]  # the whole sequence (gathered under SP)
        data, scale = kept if kept is not None and norm is None else (None, None)
        ctx.save_for_backward(
            x if data is None else None, norm_weight, norm_bias, data, scale, *weights
        )
        return out.reshape(s, y.shape[1], out.shape[-1])  # [s, b, Σn/t]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, norm_weight, norm_bias, data, scale, *weights = ctx.saved_tensors
        recipe, group, sp, groups = ctx.recipe, ctx.group, ctx.sequence_parallel, ctx.groups
        y, leaves = norm_with_graph(ctx.norm, ctx.eps, x, norm_weight, norm_bias)
        sizes = [w.shape[0] for w in weights]
        g2 = grad.reshape(-1, grad.shape[-1])  # [s·b, Σn/t]
        parts = _split_columns(g2, sizes, groups)  # [s·b, nᵢ/t] each
        grad_full = input_grad_gemm(parts[0], weights[0], recipe, group, "column")
        for p, w in zip(parts[1:], weights[1:], strict=True):
            grad_full = grad_full + input_grad_gemm(p, w, recipe, group, "column")
        # [s·b, k], a partial sum per rank
        first = 9  # the index of the first weight among forward's inputs
        need_w = [ctx.needs_input_grad[first + 2 * i] for i in range(len(weights))]
        grad_ws: list[Tensor | None] = [None] * len(weights)
        if any(need_w):
            given = None if y is None else y.detach()
            x2, kept = _weight_grad_input(
                given, data, scale, recipe, group, sp, grad.shape[1], ctx.dtype
            )
            grad_ws = [
                weight_grad_gemm(p, x2, kept, recipe, group, "column").to(w.dtype) if need else None
                for p, w, need in zip(parts, weights, need_w, strict=True)
            ]
        grad_full = grad_full.reshape(grad.shape[0], grad.shape[1], -1)  # [s, b, k]
        grad_y = reduce_scatter_sequence(grad_full, group) if sp else all_reduce(grad_full, group)
        grad_bs: list[Tensor | None] = [None] * len(weights)
        if any(ctx.has_bias):
            summed = [p[0] for p in _split_columns(g2.sum(0)[None], sizes, groups)]
            grad_bs = [g if has else None for g, has in zip(summed, ctx.has_bias, strict=True)]
        return column_grads(y, leaves, grad_y, norm_bias is not None, grad_ws, grad_bs)


def fp8_column_linear(
    x: Tensor,
    weights: Sequence[Tensor],
    biases: Sequence[Tensor | None],
    group: Group,
    sequence_parallel: bool,
    recipe: Recipe,
    *,
    norm: NormFn | None = None,
    norm_weight: Tensor | None = None,
    norm_bias: Tensor | None = None,
    eps: float = 0.0,
    groups: int = 1,
) -> Tensor:
    """The column-parallel linear (:func:`~lightning_sp.parallel.layers.column_parallel_linear`'s
    contract, without adapters) with its GEMMs in float8 (see :class:`_FP8ColumnFn`):
    ``x`` ``[s/t, b, k]`` (SP) or ``[s, b, k]`` -> ``[s, b, Σn/t]``."""
    params = [p for pair in zip(weights, biases, strict=True) for p in pair]
    return _FP8ColumnFn.apply(
        x, norm_weight, norm_bias, norm, eps, groups, group, sequence_parallel, recipe, *params
    )


class Producer(Protocol):
    """What makes a row-parallel linear's input from the tensor it keeps instead (the MLP
    activation from its input ``z``; the attention heads' merge from the core's context)."""

    def forward(self, source: Tensor) -> Tensor:
        """``source`` -> the linear's input ``[..., k/t]``."""

    def backward(self, grad: Tensor, source: Tensor) -> Tensor:
        """The gradient of the input -> that of ``source``."""


class _FP8RowFn(torch.autograd.Function):
    """A row-parallel partial product ``x Wᵀ`` in float8, ``x = producer(source)`` (or
    ``source`` itself).

    saves: ``source`` with a producer (the input is made and cast again in backward); else the
    float8 cast of ``x`` and its scale (a recipe that keeps its float8 input) or ``x``; ``W``."""

    @staticmethod
    def forward(
        ctx: Any,
        source: Tensor,
        weight: Tensor,
        recipe: Recipe,
        group: Group,
        producer: Producer | None,
    ) -> Tensor:
        ctx.recipe, ctx.group, ctx.producer = recipe, group, producer
        x = producer.forward(source) if producer is not None else source  # [..., k/t]
        ctx.shape, ctx.dtype = x.shape, x.dtype
        a = cast_input(x.reshape(-1, x.shape[-1]), recipe, group, LAYOUTS["row"][0])
        out = forward_gemm(a, weight, recipe, group, "row")  # [m, n]
        if producer is None and keeps_float8_input(recipe):
            ctx.save_for_backward(None, a._data, a._scale, weight)
        else:
            ctx.save_for_backward(source, None, None, weight)
        return out.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        source, data, scale, weight = ctx.saved_tensors
        recipe, group, producer = ctx.recipe, ctx.group, ctx.producer
        g2 = grad.reshape(-1, grad.shape[-1])  # [m, n]
        grad_x = input_grad_gemm(g2, weight, recipe, group, "row").reshape(ctx.shape)
        grad_w = None
        if ctx.needs_input_grad[1]:
            x2, kept = None, None
            if data is not None:
                kept = float8_input(data, scale, ctx.dtype, recipe)
            else:
                x = producer.forward(source) if producer is not None else source
                x2 = x.reshape(-1, x.shape[-1])
                if keeps_float8_input(recipe):
                    kept = cast_input(x2, recipe, group, LAYOUTS["row"][0])
            grad_w = weight_grad_gemm(g2, x2, kept, recipe, group, "row").to(weight.dtype)
        grad_source = producer.backward(grad_x, source) if producer is not None else grad_x
        return grad_source, grad_w, None, None, None


def fp8_row_matmul(
    source: Tensor,
    weight: Tensor,
    recipe: Recipe,
    group: Group,
    producer: Producer | None = None,
) -> Tensor:
    """The row-parallel linear's partial product in float8 (see :class:`_FP8RowFn`):
    ``producer(source)`` (or ``source``) ``[..., k/t]``, ``weight`` ``[n, k/t]`` ->
    ``[..., n]``, summed over the group by the caller (f̄ or ḡ)."""
    return _FP8RowFn.apply(source, weight, recipe, group, producer)
