"""Vocabulary-parallel layers (Megatron-LM's, paper §4.2): the embedding table and the cross
entropy over logits, both split along the (padded) vocabulary over the tensor-parallel group.

Layouts are ``[s, b, h]`` as in :mod:`lightning_sp.parallel.layers`: the embedding takes token
ids ``[s, b]`` and returns ``[s, b, h]``, or the sequence shard ``[s/t, b, h]`` under sequence
parallelism; the cross entropy takes this rank's logits ``[s, b, v/t]`` and returns the
per-token loss ``[s, b]`` without gathering them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_sp.parallel.comm import Group, f_bar, g_bar, group_size
from lightning_sp.parallel.layers import TensorParallelModule
from lightning_sp.parallel.state import ParallelState


class VocabParallelEmbedding(TensorParallelModule):
    """An embedding table whose rows (the vocabulary) are split over the tensor-parallel group.

    Input token ids ``[s, b]``; each rank looks up the ids in its row range and zeroes the
    rest; the partial embeddings are summed by f̄ (output ``[s, b, h]``) or, with
    ``sequence_parallel``, by ḡ (output ``[s/t, b, h]``).
    """

    def __init__(
        self,
        padded_vocab_size: int,
        hidden_size: int,
        state: ParallelState,
        *,
        sequence_parallel: bool,
        init_std: float = 0.02,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__((padded_vocab_size, hidden_size), 0, state, "padded_vocab_size",
                         sequence_parallel=sequence_parallel, init_std=init_std, dtype=dtype,
                         device=device)  # fmt: skip
        self.vocab_start = self.shard.start
        self.vocab_end = self.shard.start + self.weight.shape[0]

    def forward(self, ids: Tensor) -> Tensor:
        if group_size(self.group) == 1:
            out = nn.functional.embedding(ids, self.weight)
        else:
            outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
            local_ids = (ids - self.vocab_start).masked_fill_(outside, 0)
            out = nn.functional.embedding(local_ids, self.weight)
            out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return g_bar(out, self.group) if self.sequence_parallel else f_bar(out, self.group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross entropy over logits sharded along the vocabulary; the logits are never gathered.

    forward:  three all-reduces over the group of ``[s, b]`` tensors (max, sum of exp, target
              logit); columns at or past ``vocab_size`` (padding) get probability zero and
              take no part in the max, so no output depends on the padding rows.
    backward: ``softmax - one_hot(target)`` on the local shard, no communication.
    saves:    the local softmax (fp32) and the local target positions.
    """

    @staticmethod
    def forward(
        ctx: Any,
        logits: Tensor,
        target: Tensor,
        vocab_start: int,
        vocab_size: int,
        group: Group,
    ) -> Tensor:
        ctx.input_dtype = logits.dtype
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()  # [s, b, v/t], softmax in fp32
        local_vocab = logits.shape[-1]
        padding = vocab_size - vocab_start  # local columns from here on are padding
        # padding columns take no part, not even in the max: no output depends on padding rows
        # (their number depends on t), so a checkpoint can leave them out
        valid = logits if padding >= local_vocab else logits[..., : max(padding, 0)]
        logits_max = (
            valid.max(dim=-1).values
            if valid.shape[-1]
            else logits.new_full(logits.shape[:-1], float("-inf"))
        )
        if group is not None:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - logits_max.unsqueeze(-1)
        exp = shifted.exp()
        if padding < local_vocab:
            exp[..., max(padding, 0) :] = 0.0
        sum_exp = exp.sum(dim=-1)
        local_target = target - vocab_start
        outside = (local_target < 0) | (local_target >= local_vocab)
        local_target = local_target.masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        target_logit = target_logit.masked_fill(outside, 0.0)
        if group is not None:
            reduced = torch.stack([sum_exp, target_logit])
            dist.all_reduce(reduced, group=group)
            sum_exp, target_logit = reduced.unbind(0)
        loss = sum_exp.log() - target_logit
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside)
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor) -> tuple[Tensor | None, ...]:
        softmax, local_target, outside = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(
            -1, local_target.unsqueeze(-1), (outside.to(grad.dtype) - 1).unsqueeze(-1)
        )
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.input_dtype), None, None, None, None


IGNORE_INDEX = -100
"""A label that takes no part in the loss (Hugging Face's and PyTorch's convention): a token
whose loss is masked (a prompt token in supervised fine-tuning, a masked end of document)."""


def vocab_parallel_cross_entropy(
    logits: Tensor,
    target: Tensor,
    vocab_start: int,
    vocab_size: int,
    group: Group,
    mask: Tensor | None = None,
) -> Tensor:
    """Per-token cross entropy ``[s, b]`` (fp32) from vocabulary-sharded logits ``[s, b, v/t]``.

    ``vocab_start`` is the global index of this shard's first column; ``vocab_size`` the true
    (unpadded) vocabulary, so padded columns never receive probability. ``mask`` (``[s, b]``
    bool, ``True`` where a token counts): a masked token's loss is exactly 0 and its logits get
    exactly zero gradient, whatever its target (e.g. :data:`IGNORE_INDEX`).
    """
    if mask is None:
        return _VocabParallelCrossEntropy.apply(logits, target, vocab_start, vocab_size, group)
    target = target.masked_fill(~mask, 0)  # any in-vocabulary index: the loss is dropped
    losses = _VocabParallelCrossEntropy.apply(logits, target, vocab_start, vocab_size, group)
    return losses.masked_fill(~mask, 0.0)  # backward: zero where masked
