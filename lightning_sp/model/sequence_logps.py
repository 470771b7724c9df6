"""Per-sequence log-probabilities of answer tokens: what a preference loss (DPO) reads.

A preference batch ``[B, s]`` holds in each row one or more *sequences* (a prompt and one
answer: the chosen or the rejected one of a pair), packed as documents of the row
(block-causal attention, positions restarting: :class:`~lightning_sp.model.documents.
Packing`). Each label position carries its sequence's **slot** in the row (``0 … K-1``), or
``-1`` where the label is no answer token (prompt, padding, the first token of the next
document). The log-probability of sequence ``k`` of row ``r`` is

    log π(answer | prompt) = Σ_{i: slot[r, i] = k} log softmax(logits[r, i])[label[r, i]].

In every layout, without gathering anything but ``[s, b]`` scalars and ``[K, b]`` sums:

* **tensor parallelism** (vocabulary shards): the vocab-parallel cross entropy
  (:func:`~lightning_sp.parallel.vocab.vocab_parallel_cross_entropy`) gives ``-log p`` of
  each label from the ``[s, b, v/t]`` logits (three all-reduces of ``[s, b]`` tensors); its
  backward is local to each shard;
* **packed documents**: a scatter-add of the per-token terms into ``[K, b]`` by slot;
* **context parallelism**: each CP rank holds two chunks of every row, so its ``[K, b]`` are
  partial sums: all-reduced over the CP group (``f̄``: forward all-reduce, backward identity,
  each rank back-propagating into its own tokens; the CP gradient sum completes the
  parameters' gradients, as for the token-mean loss);
* **pipeline parallelism**: computed on the last stage, where the head is, inside the
  schedule's loss function (:class:`~lightning_sp.pipeline.stages.Pipeline`'s objective).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_sp.parallel.comm import f_bar
from lightning_sp.parallel.vocab import IGNORE_INDEX, vocab_parallel_cross_entropy


def sequence_logps(
    logits: Tensor,
    labels: Tensor,
    slots: Tensor,
    num_slots: int,
    *,
    vocab_start: int,
    vocab_size: int,
    tp_group: torch.distributed.ProcessGroup | None,
    cp_group: torch.distributed.ProcessGroup | None,
) -> Tensor:
    """Summed answer-token log-probabilities ``[b, K]`` (``K = num_slots``) of each sequence
    slot of each row, from this rank's vocabulary shard of the logits ``[s, b, v/t]``
    (``s``: this CP rank's tokens), ``labels`` ``[b, s]`` and ``slots`` ``[b, s]`` (``-1``:
    no answer token; :data:`IGNORE_INDEX` labels count nowhere either). Equal on the TP and
    CP ranks; a slot with no token is 0. fp32 for bf16/fp16 logits, else their dtype."""
    target = labels.t()  # [s, b]
    where = slots.t()  # [s, b]
    counted = (where >= 0) & (target != IGNORE_INDEX)
    losses = vocab_parallel_cross_entropy(  # [s, b]: -log p, 0 where not counted
        logits, target, vocab_start, vocab_size, tp_group, counted
    )
    index = where.clamp(min=0).to(torch.int64)
    sums = losses.new_zeros((num_slots, losses.shape[1]))  # [K, b]
    sums = sums.scatter_add(0, index, -losses)  # masked tokens add exactly 0
    return f_bar(sums, cp_group).t()  # [b, K], summed over the CP chunks


def slot_counts(labels: Tensor, slots: Tensor, num_slots: int) -> Tensor:
    """How many answer tokens each sequence slot holds: ``[B, K]`` (int64) of the **whole**
    rows ``labels``, ``slots`` ``[B, s]`` (before any context-parallel sharding)."""
    counted = (slots >= 0) & (labels != IGNORE_INDEX)
    index = slots.clamp(min=0).to(torch.int64)
    counts = torch.zeros((slots.shape[0], num_slots), dtype=torch.int64, device=slots.device)
    return counts.scatter_add(1, index, counted.to(torch.int64))


__all__ = ["sequence_logps", "slot_counts"]
