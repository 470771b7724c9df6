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
from lightning_sp.model.hooks import auxiliary_losses_on, scale_auxiliary_losses
from lightning_sp.parallel.context import shard_for_context_parallel
from lightning_sp.parallel.state import ParallelState
from lightning_sp.pipeline import Pipeline
from lightning_sp.pipeline.token_mean import apply_loss_mask, counted_tokens


def labels_of(batch: dict[str, Tensor]) -> Tensor:
    """The batch's labels ``[b, s]``, with ``IGNORE_INDEX`` where its ``loss_mask`` (if it
    carries one) is false."""
    if "loss_mask" in batch:
        return apply_loss_mask(batch["labels"], batch["loss_mask"])
    return batch["labels"]


def step_inputs(batch: dict[str, Tensor], model: Pipeline) -> tuple[Tensor, Tensor, Packing]:
    """This rank's ``(input ids, labels, packing)`` of ``batch``: the context-parallel chunks
    ``[b, s/c]`` of the ids and labels, and the documents, positions and loss reduction the
    batch's flags state."""
    c, r = model.state.context_parallel_size, model.state.context_parallel_rank
    packing = Packing.of_batch(batch, model.state)  # documents, positions, reduction
    # under context parallelism: this CP rank's two chunks [b, s/c] of the batch
    ids, labels = (
        shard_for_context_parallel(x, 1, c, r) for x in (batch["input_ids"], labels_of(batch))
    )
    return ids, labels, packing


def check_masked_accumulation(accumulation: int) -> None:
    """A run whose batches carry loss masks and whose model adds auxiliary losses cannot
    accumulate batches (:func:`scale_auxiliary_losses_to_token_mean` needs the step's token
    count before its first backward): ``ConfigError`` (one line) for ``accumulation > 1``.
    Called before launch (``cli.checks``) and at the step."""
    if accumulation > 1:
        raise ConfigError(
            f"trainer.accumulate_grad_batches={accumulation} with per-token loss masks and "
            "auxiliary losses (moe.aux_loss_coef or moe.z_loss_coef > 0): the step's token "
            "count must be known before its first backward; use accumulate_grad_batches=1 "
            "(a larger data.batch_size, or num_microbatches with pipeline parallelism)"
        )


def scale_auxiliary_losses_to_token_mean(
    model: Pipeline, labels: Tensor, accumulation: int
) -> None:
    """At the start of a step whose batch carries loss masks (``labels``: this replica's
    whole batch, masked tokens ``IGNORE_INDEX``): the step's gradients are sums over the
    counted tokens, divided by their global count ``N`` once the step ends
    (:class:`~lightning_sp.pipeline.token_mean.TokenMean`), which divides the auxiliary losses'
    gradient too. So they are scaled by ``N / (d·n)`` here, before the first forward, and enter
    the step as without masks: the mean over its ``d·n`` micro-batches of each micro-batch's
    losses, computed over every token its router sees (transformers'
    ``load_balancing_loss_func`` counts the router's tokens whatever the labels; Megatron-Core's
    ``calculate_per_token_loss`` aims at the same ``1/(n·d)``, approximating ``N`` by the local
    token count). ``N`` is all-reduced over the data-parallel group (collective). It must be
    known before the step's first backward, so ``accumulation`` (Lightning's
    ``accumulate_grad_batches``, whose later batches are not read yet) must be 1:
    ``ConfigError`` (one line) otherwise. Nothing to do for a model without auxiliary
    losses."""
    if not auxiliary_losses_on(model):
        return
    check_masked_accumulation(accumulation)
    state = model.state
    count = torch.tensor(float(counted_tokens(labels)), dtype=torch.float64, device=state.device)
    if state.dp_group is not None:
        torch.distributed.all_reduce(count, group=state.dp_group)
    per_micro_batch = float(count) / (state.data_parallel_size * model.num_microbatches)
    scale_auxiliary_losses(model, per_micro_batch)


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
