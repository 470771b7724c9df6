"""The norm fused before a column-parallel linear (:mod:`lightning_sp.parallel.layers`,
:mod:`lightning_sp.parallel.fp8_linears`): its function type, its recomputation in backward
(the forward keeps only the norm's input) and the gradients the fused function returns."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

NormFn = Callable[[Tensor, Tensor, Tensor | None, float], Tensor]
"""``norm(x, weight, bias, eps)``, differentiable by autograd (LayerNorm, RMSNorm)."""


def norm_with_graph(
    norm: NormFn | None, eps: float, x: Tensor, weight: Tensor | None, bias: Tensor | None
) -> tuple[Tensor, list[Tensor]]:
    """In backward, the norm again, this time with a graph: ``(y, leaves)``, ``leaves`` the
    detached ``x``, ``weight`` and ``bias`` (those given) that :func:`column_grads`
    differentiates ``y`` by; without ``norm``, ``(x, [])``."""
    if norm is None:
        return x, []
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(True) for t in (x, weight, bias) if t is not None]
        return norm(leaves[0], leaves[1], leaves[2] if bias is not None else None, eps), leaves


def column_grads(
    y: Tensor, leaves: list[Tensor], grad_y: Tensor, norm_bias: bool,
    grad_ws: Sequence[Tensor | None], grad_bs: Sequence[Tensor | None],
) -> tuple[Tensor | None, ...]:  # fmt: skip
    """What a fused column-parallel function's backward returns for its inputs ``(x,
    norm_weight, norm_bias, norm, eps, groups, group, sequence_parallel, <one more>, W₁, b₁,
    W₂, b₂, ...)``: ``grad_y`` (the gradient of the linear's input ``y``) back through the
    recomputed norm (:func:`norm_with_graph`'s ``leaves``; ``norm_bias``: whether it has a
    bias), then each weight's and bias's gradient."""
    params = [g for pair in zip(grad_ws, grad_bs, strict=True) for g in pair]
    grad_x, grad_nw, grad_nb = grad_y, None, None
    if leaves:
        grads = torch.autograd.grad(y, leaves, grad_y)
        grad_x, grad_nw = grads[0], grads[1]
        grad_nb = grads[2] if norm_bias else None
    return (grad_x, grad_nw, grad_nb, None, None, None, None, None, None, *params)
