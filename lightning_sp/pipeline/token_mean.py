"""The global token mean of a step whose tokens carry loss masks.

Once some tokens are masked (labels :data:`~lightning_sp.parallel.vocab.IGNORE_INDEX`: prompt
tokens in supervised fine-tuning, masked ends of documents), the mean per micro-batch is no
longer the mean over the step: averaging per micro-batch, then over micro-batches, replicas and
accumulated batches weights the tokens of sparse micro-batches up (the gradient-accumulation bug
transformers fixed in 2024 with ``num_items_in_batch``). The step's loss must be

    L = Σ_{unmasked tokens of the global batch} loss_i / N,   N = their number,

for every t, p, c, d, micro-batch count ``n`` and accumulation ``k``.

How (Megatron-Core's ``calculate_per_token_loss``): every micro-batch's backward runs on the
**sum** of its counted tokens' losses (:meth:`lightning_sp.pipeline.Pipeline.train_step` with
``reduction="sum"``; under context parallelism the sum is all-reduced in forward and each CP
rank backs its own share, which the CP gradient sum completes). :class:`TokenMean` counts the
tokens of every batch the step sees (from the labels, before any forward: the full ``[B, s]``
batch, so the CP and PP ranks of a replica count the same), and at the end of the step (after
the data-parallel mean of the gradients) all-reduces ``(Σ loss, N)`` over the data-parallel
group and multiplies every gradient by ``d · k / N``: ``d`` undoes the data-parallel mean (so
the replicas' gradients are summed), ``k`` a division of each backward by ``k`` that the caller
applied (Lightning's ``accumulate_grad_batches``). A step with no counted token at all gets
zero gradients and loss 0 (never NaN); a micro-batch with none adds exactly 0 to both sums.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_sp.parallel.grads import grad_of
from lightning_sp.parallel.state import ParallelState
from lightning_sp.parallel.vocab import IGNORE_INDEX


def counted_tokens(labels: Tensor) -> int:
    """How many tokens of ``labels`` count in the loss (not :data:`IGNORE_INDEX`)."""
    return int((labels != IGNORE_INDEX).sum())


def apply_loss_mask(labels: Tensor, loss_mask: Tensor) -> Tensor:
    """``labels`` with :data:`IGNORE_INDEX` where ``loss_mask`` (same shape, bool or 0/1) is
    false: the one representation of a masked token past the data path."""
    if loss_mask.shape != labels.shape:
        raise ValueError(
            f"loss_mask shape {tuple(loss_mask.shape)} differs from labels {tuple(labels.shape)}"
        )
    return labels.masked_fill(~loss_mask.bool(), IGNORE_INDEX)


class TokenMean:
    """Accumulates one step's counted tokens and loss sums on this rank (see module docstring).

    Call :meth:`add` once per batch the step trains on (with the full batch's labels of this
    data-parallel replica and the summed loss its backward ran on), then :meth:`finish` once,
    after the gradients are finalised and before clipping and the optimizer.
    """

    def __init__(self, state: ParallelState) -> None:
        self.state = state
        self.tokens = 0
        """Counted tokens of this replica's batches so far in the step."""
        self.loss_sum = 0.0
        """Their summed loss (float, summed in float64)."""
        self.finished_tokens: int | None = None
        """The global count ``N`` of the last :meth:`finish` (None before one)."""

    def add(self, labels: Tensor, loss_sum: Tensor | float) -> None:
        """One batch: ``labels`` ``[B, s]`` (this replica's whole batch, before any context
        parallel sharding) and the sum of its counted tokens' losses (equal on the replica's
        TP, CP and PP ranks, as :meth:`Pipeline.train_step` returns it)."""
        self.tokens += counted_tokens(labels)
        self.loss_sum += float(loss_sum.detach() if isinstance(loss_sum, Tensor) else loss_sum)

    def add_count(self, count: int, loss_sum: Tensor | float) -> None:
        """One batch whose loss is a sum over ``count`` items the caller counted (pairs, for
        a preference loss: :mod:`lightning_sp.training.preference`); the step's loss is then
        the mean over the items of every batch and replica."""
        self.tokens += count
        self.loss_sum += float(loss_sum.detach() if isinstance(loss_sum, Tensor) else loss_sum)

    def reset(self) -> None:
        """Forget what was added (a step that was skipped before :meth:`finish`)."""
        self.tokens, self.loss_sum = 0, 0.0

    def finish(self, module: nn.Module, accumulation: int = 1) -> Tensor:
        """Scale every gradient of ``module`` (``main_grad`` or ``grad``) by ``d · accumulation /
        N`` and return the step's mean loss ``Σ loss / N`` (float64 scalar, identical on every
        rank; 0 when ``N = 0``, with gradients zeroed). Resets the counts for the next step.

        ``accumulation``: the number ``k`` each backward's loss was divided by (1 unless a
        caller such as Lightning's ``accumulate_grad_batches`` divided it).
        """
        totals = torch.tensor([self.loss_sum, float(self.tokens)], dtype=torch.float64)
        group = self.state.dp_group
        if group is not None:
            totals = totals.to(self.state.device)
            dist.all_reduce(totals, group=group)
            totals = totals.cpu()
        loss_sum, tokens = totals.tolist()
        self.reset()
        self.finished_tokens = int(tokens)
        d = self.state.data_parallel_size
        factor = d * accumulation / tokens if tokens > 0 else 0.0
        for param in module.parameters():
            grad = grad_of(param)
            if grad is not None:
                grad.mul_(factor)
        return torch.tensor(loss_sum / tokens if tokens > 0 else 0.0, dtype=torch.float64)


__all__ = ["TokenMean", "apply_loss_mask", "counted_tokens"]
