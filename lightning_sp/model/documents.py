"""Packed documents: per-token document ids, the block-causal mask they define, and positions
that restart per document.

A training sequence may hold several documents back to back (pretraining windows cut from a
concatenated corpus, or conversations packed for fine-tuning). Megatron-LM's three options, as
this package spells them:

* ``--reset-attention-mask``: a token attends only to earlier tokens **of its own document**
  (block-causal attention). The model takes ``documents``: ``[b, s]`` integer ids, equal for
  the tokens of one document (any values; only equality matters), for the **whole** sequence
  even under context parallelism (each CP rank needs the ids of the keys it gathers).
* ``--reset-position-ids``: positions count from 0 at each document's first token
  (:func:`positions_in_documents`); the model takes ``positions`` ``[b, s]`` (the local
  chunks' under context parallelism).
* ``--eod-mask-loss``: the loss at the end-of-document token is masked (a label of
  :data:`~lightning_sp.parallel.vocab.IGNORE_INDEX`; the data path does it).

**Bytes.** The mask is never stored: what travels with a micro-batch is its document ids, one
int32 per token, ``4·b·s`` bytes, one tensor shared by every layer (held by reference, not
copied, by the cores and by recomputation) and the only per-sequence state the mask needs.
Each core builds its boolean block of the mask transiently (``math``: the additive bias of its
scores, ``[b·g/t, s, s]`` elements of the activation dtype, which it builds for the causal mask
anyway; ``sdpa``: a boolean ``[b·g/t, s, s]`` attention mask; CP: ``[b·g/t, L, (i+1)L]`` per
local chunk). An ``s x s`` boolean kept per layer would cost ``b·s²`` bytes per layer: at
``s = 8192``, ``b = 1`` that is 64 MiB per layer against 32 KiB of ids per micro-batch.
What is saved for backward: ``math`` nothing more; ``sdpa`` the concatenated context its
projection keeps, ``e·sb·a·d/t`` per layer (the attention part's ``document_context``); the
positions, ``8·b·s/c``, and under RoPE one pair of per-token tables per micro-batch and model
chunk (:func:`packed_bytes`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from lightning_sp.model.shape import ActivationShape
from lightning_sp.parallel.context import shard_for_context_parallel
from lightning_sp.parallel.state import ParallelState

Reduction = Literal["mean", "sum"]
"""How the loss reduces the per-token losses: their mean over the counted tokens, or their sum
(for a token mean taken later over a whole step:
:class:`~lightning_sp.pipeline.token_mean.TokenMean`)."""

DOCUMENT_ID_BYTES = 4
"""Bytes per token of the document ids (int32) a micro-batch carries."""

POSITION_BYTES = 8
"""Bytes per token of the positions (int64, :func:`positions_in_documents`) a micro-batch
carries."""


def document_id_bytes(batch: int, seq_length: int) -> int:
    """Bytes of one micro-batch's document ids ``[b, s]`` (int32), shared by every layer."""
    return DOCUMENT_ID_BYTES * batch * seq_length


@dataclass(frozen=True)
class PackedBytes:
    """What packed documents add to one rank's memory per micro-batch, outside the layers'
    saved terms (the layers' own: the attention part's ``document_context``)."""

    ids: float
    """The micro-batch's document ids, ``4·b·s`` (the whole sequences on every rank, also
    under CP), and its positions, ``8·b·s/c`` (this CP rank's tokens): held with the batch
    for the whole step, by every rank of a replica (each pipeline stage is given the batch)."""
    tables: float
    """RoPE's cos and sin at the per-token positions, ``2·e·b·(s/c)·d`` on every TP rank
    (the QKV output is the whole local sequence): made once per micro-batch by each model
    chunk (:meth:`~lightning_sp.model.attention.Rotary.per_token`) and kept until the last
    of its layers' backward; 0 with learned positions (an index into the table)."""


def packed_bytes(
    shape: ActivationShape, *, document_mask: bool, reset_position_ids: bool, rotary: bool
) -> PackedBytes:
    """:class:`PackedBytes` of one micro-batch of ``shape`` (``b``, the whole ``s``, ``c``,
    ``d``, ``e``) under the data options ``document_mask`` / ``reset_position_ids`` and
    rotary (``rotary``) or learned positions."""
    local = shape.s // shape.c * shape.b  # tokens of this rank
    ids = DOCUMENT_ID_BYTES * shape.b * shape.s if document_mask else 0
    ids += POSITION_BYTES * local if reset_position_ids else 0
    tables = 2 * shape.activation_bytes * local * shape.head_dim
    return PackedBytes(float(ids), float(tables) if reset_position_ids and rotary else 0.0)


def document_ids(tokens: Tensor, eod_id: int) -> Tensor:
    """Per-token document ids (int32, ``[..., s]``) of ``tokens`` ``[..., s]``: a document ends
    at (and includes) each ``eod_id`` token; ids count from 0 along each sequence."""
    eod = (tokens == eod_id).to(torch.int32)
    return (eod.cumsum(-1, dtype=torch.int32) - eod).to(torch.int32)


def positions_in_documents(documents: Tensor) -> Tensor:
    """Each token's position within its document (int64, ``documents``' shape ``[..., s]``):
    0 at a document's first token (where the id differs from the previous token's)."""
    s = documents.shape[-1]
    index = torch.arange(s, device=documents.device).expand_as(documents)
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[..., 1:] = documents[..., 1:] != documents[..., :-1]
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(-1).values
    return index - first


@dataclass(frozen=True)
class Packing:
    """What a batch carries besides its token ids and labels, built once from the batch
    (:meth:`of_batch`) and passed whole through :meth:`GPT.forward
    <lightning_sp.model.gpt.GPT.forward>` and :class:`~lightning_sp.pipeline.stages.Pipeline`'s
    ``forward`` / ``train_step`` / ``eval_step``. The default is an unpacked batch whose loss is
    the mean over its counted tokens."""

    documents: Tensor | None = None
    """``[B, s]`` document ids of the **whole** sequences (also under context parallelism):
    block-causal attention; None: causal over the whole sequence."""
    positions: Tensor | None = None
    """``[B, s]`` position of each given token (this CP rank's chunks under context
    parallelism), e.g. restarting per document; None: ``0 … s-1`` (each CP chunk's own)."""
    reduction: Reduction = "mean"
    """``mean``: the loss is the mean over the counted tokens; ``sum``: their sum (a batch with
    a loss mask, whose step divides by the global count)."""

    @classmethod
    def of(cls, packing: Packing | Reduction) -> Packing:
        """``packing`` itself, or a reduction name as shorthand for an unpacked batch's."""
        return packing if isinstance(packing, Packing) else cls(reduction=packing)

    @classmethod
    def of_batch(cls, batch: Mapping[str, Tensor], state: ParallelState) -> Packing:
        """From a data-path batch (``documents``, ``positions``, ``loss_mask``: those the data
        options gave, :mod:`lightning_sp.data.documents`): the positions of this CP rank's
        chunks, the documents of the whole sequences, ``sum`` when a loss mask is present."""
        positions = batch.get("positions")
        if positions is not None:
            c, r = state.context_parallel_size, state.context_parallel_rank
            positions = shard_for_context_parallel(positions, 1, c, r)  # [B, s/c]
        reduction: Reduction = "sum" if "loss_mask" in batch else "mean"
        return cls(batch.get("documents"), positions, reduction)

    def sequence(self) -> dict[str, Tensor]:
        """The per-token tensors given, by keyword (``documents``, ``positions``): what each
        pipeline stage receives, split into micro-batches by the schedule."""
        given = {"documents": self.documents, "positions": self.positions}
        return {k: v for k, v in given.items() if v is not None}


def same_document(query_documents: Tensor, key_documents: Tensor, rows: int) -> Tensor:
    """Boolean ``[rows, Lq, Lk]``: query ``i`` and key ``j`` lie in one document.

    ``query_documents [b, Lq]``, ``key_documents [b, Lk]``; ``rows = b·n`` repeats each
    sequence's block ``n`` times (the cores' batch ``B = b·g/t`` runs the key/value groups of a
    sequence next to each other)."""
    same = query_documents.unsqueeze(-1) == key_documents.unsqueeze(-2)  # [b, Lq, Lk]
    repeat = rows // same.shape[0]
    if repeat * same.shape[0] != rows:
        raise ValueError(
            f"documents for {same.shape[0]} sequences cannot cover {rows} attention rows"
        )
    return same.repeat_interleave(repeat, dim=0) if repeat > 1 else same


__all__ = [
    "DOCUMENT_ID_BYTES",
    "POSITION_BYTES",
    "PackedBytes",
    "Packing",
    "Reduction",
    "document_id_bytes",
    "document_ids",
    "packed_bytes",
    "positions_in_documents",
    "same_document",
]
