"""LoRA adapters on tensor-parallel linears, sharded the way the linear is (the math; which
linears get one is :mod:`lightning_sp.model.lora`'s).

An adapter adds ``s · B A drop(x)`` to a linear ``y = W x``: ``A`` is ``[r, k]``, ``B`` is
``[n, r]``, ``s`` the scaling (``lora_alpha / r``, or ``lora_alpha / √r`` with rsLoRA), as
``peft``'s ``LoraLayer`` does. Under tensor parallelism:

* column-parallel weight ``[n/t, k]``: ``A [r, k]`` replicated, ``B [n/t, r]`` split like the
  weight (``replicas`` included). The adapter reads the input the linear already has (under
  sequence parallelism the gathered ``[s, b, k]``: no collective of its own) and its input
  gradient joins the linear's before the linear's reduce-scatter / all-reduce. ``A``'s
  gradient is a partial sum per TP rank (each rank back-propagates through its own rows of
  ``B``), so ``A`` is marked ``sequence_parallel``: summed over TP where the norms' are
  (:func:`~lightning_sp.parallel.grads.finalize_grads`).
* row-parallel weight ``[n, k/t]``: ``A [r, k/t]`` split like the weight, ``B [n, r]``
  replicated. ``A x_local`` is a partial sum over TP, so ``B A x_local`` is a partial
  product added to the linear's own *before* its all-reduce / reduce-scatter (no extra
  collective); ``B``'s gradient is a partial sum per TP rank (marked ``sequence_parallel``).

Both pieces of every linear run inside the linear's own autograd function, which saves, besides
what the linear saves, the low-rank activation ``A drop(x)`` (``[s, b, r]``, ``e·sbr`` bytes)
and, with ``lora_dropout``, the dropout's 1-byte mask of the adapter's input. A frozen base
weight (``requires_grad`` False) gets no weight-gradient GEMM.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor, nn

from lightning_sp.parallel.init import ShardSpec, mark_parameter
from lightning_sp.parallel.random import RNGStreams

Kind = Literal["column", "row"]


class LoRA(nn.Module):
    """One linear's adapter: parameters ``A`` and ``B``, its scaling and dropout (see the
    module docstring for the shapes per ``kind``)."""

    def __init__(
        self,
        kind: Kind,
        weight: Tensor,
        r: int,
        scaling: float,
        dropout: float,
        tensor_parallel_size: int,
    ) -> None:
        """``weight``: the linear's weight shard (its ``shard`` mark says where it sits)."""
        super().__init__()
        self.kind, self.r, self.scaling, self.dropout = kind, r, scaling, dropout
        self.rng: RNGStreams | None = None
        """The model's dropout streams (set by whoever attaches the adapter): column adapters
        draw from ``replicated`` (their input is the same on every TP rank), row adapters from
        ``sharded`` (each rank holds other features)."""
        shard: ShardSpec = getattr(weight, "shard", ShardSpec())
        n, k = weight.shape
        dtype, device = weight.dtype, weight.device
        if kind == "column":  # A [r, k] replicated, B [n/t, r] split like the weight
            fan_in = k
            a_shard, b_shard = ShardSpec(), ShardSpec(0, shard.start, shard.replicas)
            a_partial, b_partial = True, False
        else:  # A [r, k/t] split like the weight, B [n, r] replicated
            fan_in = shard.full_size(k, tensor_parallel_size)
            a_shard, b_shard = ShardSpec(1, shard.start), ShardSpec()
            a_partial, b_partial = False, True
        # peft draws A by kaiming_uniform_(a=√5): U(-1/√fan_in, 1/√fan_in); B starts at zero
        a = nn.Parameter(torch.empty(r, k, dtype=dtype, device=device))
        b = nn.Parameter(torch.empty(n, r, dtype=dtype, device=device))
        bound = 1.0 / math.sqrt(fan_in)
        self.A = mark_parameter(
            a, shard=a_shard, init="uniform", std=bound, sequence_parallel=a_partial
        )
        self.B = mark_parameter(b, shard=b_shard, init="zeros", sequence_parallel=b_partial)
        for p in (self.A, self.B):
            p.lora = True  # type: ignore[attr-defined]

    def extra_repr(self) -> str:
        return f"{self.kind}, r={self.r}, scaling={self.scaling:g}, dropout={self.dropout:g}"

    def mask(self, like: Tensor) -> Tensor | None:
        """The dropout keep-mask (bool, 1 byte per element) of an input ``like``, drawn from
        this adapter's stream; ``None`` without dropout or outside training."""
        if self.dropout == 0.0 or not self.training:
            return None
        if self.rng is None:
            raise RuntimeError("a LoRA adapter with dropout needs the model's RNG streams")
        generator = self.rng.replicated if self.kind == "column" else self.rng.sharded
        keep = torch.empty(like.shape, dtype=torch.bool, device=like.device)
        return keep.bernoulli_(1.0 - self.dropout, generator=generator)

    def dropped(self, x: Tensor, mask: Tensor | None) -> Tensor:
        """``x`` through this adapter's dropout (``mask`` from :meth:`mask`)."""
        return x if mask is None else torch.mul(x, mask).mul_(1.0 / (1.0 - self.dropout))


def _gradient_product(grad: Tensor, x: Tensor) -> Tensor:
    """``Σ gradᵀ x`` over every leading dim: ``[..., n], [..., k] -> [n, k]``."""
    return torch.mm(grad.flatten(0, -2).t(), x.flatten(0, -2))


# -- column-parallel: one or more weights interleaved per group, one adapter per weight ------


def column_low(full: Tensor, adapters: Sequence[LoRA]) -> tuple[Tensor, list[Tensor | None]]:
    """The low-rank activations of ``adapters`` on the gathered input ``full`` (``[s, b, k]``),
    concatenated: ``[s, b, Σr]``, and each adapter's dropout mask."""
    masks = [a.mask(full) for a in adapters]
    lows = [torch.matmul(a.dropped(full, m), a.A.t()) for a, m in zip(adapters, masks, strict=True)]
    return (lows[0] if len(lows) == 1 else torch.cat(lows, dim=-1)), masks


def column_b_blocks(
    adapters: Sequence[LoRA | None], sizes: Sequence[int], scaling: float = 1.0
) -> list[Tensor]:
    """Per weight ``j`` (``sizes[j]`` local rows), its rows of the joint ``B``: ``[n_j, Σr]``,
    ``scaling · B_j`` in the columns of its adapter's slot (zero for a weight without one).
    Interleaved like the weights, they map the joint low-rank activation to the output."""
    adapted = [a for a in adapters if a is not None]
    total = sum(a.r for a in adapted)
    blocks, slot = [], 0
    ref = adapted[0].B
    for adapter, n in zip(adapters, sizes, strict=True):
        block = ref.new_zeros((n, total))
        if adapter is not None:
            block[:, slot : slot + adapter.r] = adapter.B * scaling
            slot += adapter.r
        blocks.append(block)
    return blocks


def column_backward(
    grad_low: Tensor,
    full: Tensor,
    adapters: Sequence[LoRA],
    masks: Sequence[Tensor | None],
) -> tuple[Tensor, list[Tensor]]:
    """Given ``grad_low`` (``[s, b, Σr]``, the gradient of the joint low-rank activation, a
    partial sum per TP rank), the adapters' share of the input gradient (``[s, b, k]``, partial
    like the linear's) and each ``A``'s gradient (partial: summed over TP later)."""
    grad_full: Tensor | None = None
    grad_as = []
    for adapter, mask, g in zip(
        adapters, masks, grad_low.split([a.r for a in adapters], dim=-1), strict=True
    ):
        grad_as.append(_gradient_product(g, adapter.dropped(full, mask)))
        grad_in = adapter.dropped(torch.matmul(g, adapter.A), mask)
        grad_full = grad_in if grad_full is None else grad_full + grad_in
    assert grad_full is not None
    return grad_full, grad_as


def column_b_grads(block_grads: Sequence[Tensor], adapters: Sequence[LoRA | None]) -> list[Tensor]:
    """Each adapter's ``B`` gradient from the joint ``B``'s per-weight row blocks' gradients
    (of :func:`column_b_blocks` with ``scaling`` applied by the caller)."""
    grads, slot = [], 0
    for adapter, block in zip(adapters, block_grads, strict=True):
        if adapter is not None:
            grads.append(block[:, slot : slot + adapter.r])
            slot += adapter.r
    return grads


# -- row-parallel: a partial product added before the linear's reduction ---------------------


def row_forward(
    x: Tensor, weight: Tensor, adapter: LoRA | None
) -> tuple[Tensor, list[Tensor | None]]:
    """``x Wᵀ + s · B A drop(x)`` on a rank's input shard ``x`` (``[s, b, k/t]``): the partial
    product ``[s, b, n]`` to reduce over TP, and what its backward needs besides ``x`` and
    ``W``: with an adapter, the low-rank activation ``[s, b, r]`` and the dropout mask (or
    ``None``); without, nothing."""
    out = torch.matmul(x, weight.t())
    if adapter is None:
        return out, []
    mask = adapter.mask(x)
    low = torch.matmul(adapter.dropped(x, mask), adapter.A.t())  # [s, b, r], a partial sum
    return out.add_(torch.matmul(low, adapter.B.t()), alpha=adapter.scaling), [low, mask]


def row_backward(
    grad: Tensor,
    x: Tensor,
    weight: Tensor,
    need_weight: bool,
    adapter: LoRA | None = None,
    low: Tensor | None = None,
    mask: Tensor | None = None,
) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """The backward of :func:`row_forward`: ``x``'s gradient, ``W``'s (only if
    ``need_weight``: none for a frozen base), ``A``'s and ``B``'s (``B``'s a partial sum per
    TP rank)."""
    grad_x = torch.matmul(grad, weight)
    grad_w = _gradient_product(grad, x) if need_weight else None
    if adapter is None or low is None:
        return grad_x, grad_w, None, None
    grad_low = torch.matmul(grad, adapter.B).mul_(adapter.scaling)  # [s, b, r]
    grad_b = _gradient_product(grad, low).mul_(adapter.scaling)
    dropped = adapter.dropped(x, mask)
    grad_a = _gradient_product(grad_low, dropped)
    grad_x = grad_x + adapter.dropped(torch.matmul(grad_low, adapter.A), mask)
    return grad_x, grad_w, grad_a, grad_b


def adapter_tensors(adapter: LoRA | None) -> tuple[Tensor, ...]:
    """``(A, B)`` of an adapter, ``()`` without one: the extra inputs of the autograd
    functions that run a row-parallel linear, so autograd routes their gradients."""
    return () if adapter is None else (adapter.A, adapter.B)
