"""Activation recomputation (paper §5) as one autograd function.

``recompute(fn, rng, *inputs)`` runs ``fn`` without building a graph, saves only its tensor
inputs (through ``save_for_backward``, so saved-tensor hooks see exactly what is kept), and
in backward re-runs ``fn`` with the dropout streams rewound to where they were, which replays
identical masks. Being our own Function, what it keeps is exactly what ``save_for_backward``
holds, which is what the saved-tensor measurement sees, and the dropout streams it rewinds are
ours (not torch's global RNG).

The policies built on it: ``selective`` wraps the attention core, ``full`` a whole layer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lightning_sp.parallel.random import RNGStreams


class _Recompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, fn: Callable[..., Tensor], rng: RNGStreams, *inputs: Tensor) -> Tensor:
        ctx.fn, ctx.rng = fn, rng
        ctx.rng_state = rng.get_state()
        ctx.save_for_backward(*inputs)
        return fn(*inputs)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        inputs = [x.detach().requires_grad_(x.requires_grad) for x in ctx.saved_tensors]
        after = ctx.rng.get_state()
        ctx.rng.set_state(ctx.rng_state)
        try:
            with torch.enable_grad():
                out = ctx.fn(*inputs)
        finally:
            ctx.rng.set_state(after)
        torch.autograd.backward(out, grad)
        return (None, None, *(x.grad if x.requires_grad else None for x in inputs))


def recompute(fn: Callable[..., Tensor], rng: RNGStreams, *inputs: Tensor) -> Tensor:
    """``fn(*inputs)``, storing only ``inputs`` for backward and recomputing the rest.

    ``fn`` must return one tensor and draw its randomness from ``rng``.
    """
    return _Recompute.apply(fn, rng, *inputs)
