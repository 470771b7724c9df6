"""The experts' grouped GEMMs in float8 (:mod:`lightning_sp.parallel.fp8`'s recipes): each
expert is its own ``Float8Linear``.

``x`` ``[N, k]`` in consecutive row groups (``counts[i]`` rows for local expert ``i``), ``W``
``[E, n, k]``: expert ``i``'s rows ``x_i`` run through its weight ``W_i`` with the scales
torchao's recipe computes for that weight and those tokens, as ``Float8Linear`` applied to
``x_i`` alone would: ``tensorwise``, one scale for ``x_i``, one for ``W_i``, one for ``∇y_i``;
``rowwise``, per token of ``x_i`` and per feature of ``W_i`` (forward), and so on per GEMM.
A fused weight (the experts' ``[gate; up]`` rows) is ``splits`` weights stacked along ``n``,
one float8 GEMM each with its own weight and gradient scales and the input's cast shared (the
dense layers' granularity, :mod:`lightning_sp.parallel.fp8_linears`; torchtitan's ``w1``,
``w3``).

Under expert tensor parallelism each rank holds a slice of every expert, column parallel
(``gate_up``: rows of ``W_i``, the layout ``"column"``) or row parallel (``down``: columns,
``"row"``), and runs the TP group's gathered rows, the same ``counts`` on every rank of the
group: the scales whose amax spans the slices are agreed over ``group`` exactly as the dense
layers agree theirs (:data:`~lightning_sp.parallel.fp8.LAYOUTS`), so each rank's float8
operands are slices of the unsharded expert's. An expert with no rows runs no GEMM (the same on
every rank of the group: the counts are the group's).

The GEMMs run as a loop over the experts of ``torch._scaled_mm`` (through torchao's float8
tensor; its emulation with ``emulate``): ``torch._scaled_grouped_mm`` is CUDA-only (no CPU
kernel in torch 2.13, so nothing here could check it) and takes rowwise scales only.

What it keeps for backward: with a recipe that keeps its float8 input
(:func:`~lightning_sp.parallel.fp8.keeps_float8_input`, ``tensorwise``) the experts' casts of
``x``, ``[N, k]`` at 1 byte an element, and their scales, ``[E]`` fp32 (``4E`` bytes; an
expert with no rows keeps 1.0); else ``x`` (or a producer's ``source``) as given.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_sp.parallel.comm import Group
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
from lightning_sp.parallel.fp8_linears import Producer


def _weights(weight: Tensor, splits: int) -> list[list[Tensor]]:
    """Each expert's ``splits`` weights ``[n/splits, k]`` of ``weight`` ``[E, n, k]``."""
    return [list(w.chunk(splits, dim=0)) for w in weight]


class _FP8GroupedFn(torch.autograd.Function):
    """``y_i = x_i W_iᵀ`` per row group in float8, ``x = producer(source)`` (or ``source``);
    see the module docstring for the scales and what it saves."""

    @staticmethod
    def forward(
        ctx: Any,
        source: Tensor,
        weight: Tensor,
        counts: list[int],
        splits: int,
        recipe: Recipe,
        group: Group,
        layout: str,
        producer: Producer | None,
    ) -> Tensor:
        ctx.counts, ctx.splits, ctx.recipe, ctx.group, ctx.layout = (
            counts, splits, recipe, group, layout
        )  # fmt: skip
        ctx.producer = producer
        x = producer.forward(source) if producer is not None else source  # [N, k]
        ctx.dtype = x.dtype
        keep = producer is None and keeps_float8_input(recipe)  # one scale per expert
        outs, data, scales = [], [], []
        for rows, ws in zip(x.split(counts), _weights(weight, splits), strict=True):
            if not rows.shape[0]:
                outs.append(x.new_empty((0, weight.shape[1])))
                scales.append(torch.ones((), device=x.device))
                continue
            a = cast_input(rows, recipe, group, LAYOUTS[layout][0])  # [m_i, k]
            outs.append(torch.cat([forward_gemm(a, w, recipe, group, layout) for w in ws], 1))
            if keep:
                data.append(a._data)
                scales.append(a._scale.reshape(()))
        if keep:
            kept = torch.cat(data) if data else x.new_empty(x.shape, dtype=torch.float8_e4m3fn)
            ctx.save_for_backward(None, kept, torch.stack(scales), weight)
        else:
            ctx.save_for_backward(source, None, None, weight)
        return torch.cat(outs)  # [N, n]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        source, data, scales, weight = ctx.saved_tensors
        recipe, group, layout, producer = ctx.recipe, ctx.group, ctx.layout, ctx.producer
        counts, splits = ctx.counts, ctx.splits
        need_w = ctx.needs_input_grad[1]
        x = None  # the input again, for a weight gradient without a kept float8 cast
        if data is None and need_w:
            x = producer.forward(source) if producer is not None else source  # [N, k]
        grad = grad.contiguous()
        k = weight.shape[2]
        grad_xs, grad_ws = [], []
        for i, (g, ws) in enumerate(zip(grad.split(counts), _weights(weight, splits), strict=True)):
            if not g.shape[0]:
                grad_xs.append(grad.new_empty((0, k)))
                grad_ws.append(torch.zeros_like(weight[i]))
                continue
            start = sum(counts[:i])
            parts = g.chunk(splits, dim=1)  # [m_i, n/splits] each
            grad_x = input_grad_gemm(parts[0], ws[0], recipe, group, layout)
            for p, w in zip(parts[1:], ws[1:], strict=True):
                grad_x = grad_x + input_grad_gemm(p, w, recipe, group, layout)
            grad_xs.append(grad_x)  # [m_i, k] (a partial sum over the group: column)
            if need_w:
                rows, kept, stop = None, None, start + g.shape[0]
                if data is not None:
                    kept = float8_input(data[start:stop], scales[i], ctx.dtype, recipe)
                else:
                    assert x is not None
                    rows = x[start:stop]
                    if keeps_float8_input(recipe):
                        kept = cast_input(rows, recipe, group, LAYOUTS[layout][0])
                grad_ws.append(torch.cat([
                    weight_grad_gemm(p, rows, kept, recipe, group, layout) for p in parts
                ]).to(weight.dtype))  # fmt: skip
        grad_in = torch.cat(grad_xs).to(ctx.dtype)
        grad_source = producer.backward(grad_in, source) if producer is not None else grad_in
        grad_w = torch.stack(grad_ws) if need_w else None
        return grad_source, grad_w, None, None, None, None, None, None


def fp8_grouped_linear(
    source: Tensor,
    weight: Tensor,
    counts: list[int],
    recipe: Recipe,
    group: Group,
    layout: str,
    *,
    splits: int = 1,
    producer: Producer | None = None,
) -> Tensor:
    """Per-expert linears in float8 (module docstring): ``producer(source)`` (or ``source``)
    ``[N, k]`` in ``len(counts)`` row groups, ``weight`` ``[E, n, k]`` (``splits`` weights
    stacked along ``n`` per expert; this rank's slice as ``layout`` holds it over ``group``)
    -> ``[N, n]``."""
    return _FP8GroupedFn.apply(source, weight, counts, splits, recipe, group, layout, producer)
