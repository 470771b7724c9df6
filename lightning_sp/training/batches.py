"""What :class:`~lightning_sp.training.gpt_module.GPTModule`'s steps read from a batch
``{"input_ids": [b, s], "labels": [b, s]}`` (with a ``loss_mask`` and document flags when the
data carries them), and the training loss it logs.

Under context parallelism (``c > 1``) every CP rank of a data-parallel replica holds the same
batch and feeds its model only its two load-balanced chunks ``[b, s/c]``
(:func:`~lightning_sp.parallel.context.shard_for_context_parallel`); the loss the model
returns is already equal on the CP, TP and PP ranks of a replica, so the logged loss is its
mean over the data-parallel replicas (:func:`replica_mean`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_sp.errors import ConfigError
from lightning_sp.model.documents import Packing
from lightning_sp.model.hooks import has_auxiliary_losses
from lightning_sp.parallel.context import shard_for_context_parallel
from lightning_sp.parallel.state import ParallelState
from lightning_sp.pipeline import Pipeline
from lightning_sp.pipeline.token_mean import apply_loss_mask


def labels_of(batch: dict[str, Tensor]) -> Tensor:
    """The batch's labels ``[b, s]``, with ``IGNORE_INDEX`` where its ``loss_mask`` (if it
    carries one) is false."""
    if "loss_mask" in batch:
        return apply_loss_mask(batch["labels"], batch["loss_mask"])
    return batch["labels"]


def step_inputs(batch: dict[str, Tensor], model: Pipeline) -> tuple[Tensor, Tensor, Packing]:
    """This rank's ``(input ids, labels, packing)`` of ``batch``: the context-parallel chunks
    ``[b, s/c]`` of the ids and labels, and the documents, positions and loss reduction the
    batch's flags state. Raises ``ConfigError`` for a loss mask with a mixture-of-experts
    model."""
    c, r = model.state.context_parallel_size, model.state.context_parallel_rank
    packing = Packing.of_batch(batch, model.state)  # documents, positions, reduction
    if packing.reduction == "sum" and has_auxiliary_losses(model):
        # the step's token mean rescales every gradient once the step's count is known;
        # the auxiliary losses' share would be rescaled with it
        raise ConfigError(
            "a per-token loss mask (chat data, eod_mask_loss) with a mixture-of-experts "
            "model is not supported yet; train it without loss masks"
        )
    # under context parallelism: this CP rank's two chunks [b, s/c] of the batch
    ids, labels = (
        shard_for_context_parallel(x, 1, c, r) for x in (batch["input_ids"], labels_of(batch))
    )
    return ids, labels, packing


def replica_mean(loss: Tensor, state: ParallelState) -> Tensor:
    """The mean of ``loss`` over the data-parallel replicas (the TP, CP and PP ranks of one
    already agree): the loss of the global batch, detached. Reduced here, since Lightning's
    ``sync_dist`` is a no-op under a strategy its accelerator connector does not know as
    distributed."""
    logged, group = loss.detach().clone(), state.dp_group
    if group is not None:
        torch.distributed.all_reduce(logged, group=group)
        logged /= state.data_parallel_size
    return logged
