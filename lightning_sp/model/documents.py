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
  :data:`~lightning_sp.parallel.layers.IGNORE_INDEX`; the data path does it).

**Bytes.** The mask is never stored: what travels with a micro-batch is its document ids, one
int32 per token, ``4·b·s`` bytes, one tensor shared by every layer (held by reference, not
copied, by the cores and by recomputation) and the only per-sequence state the mask needs.
Each core builds its boolean block of the mask transiently (``math``: the additive bias of its
scores, ``[b·g/t, s, s]`` elements of the activation dtype, which it builds for the causal mask
anyway; ``sdpa``: a boolean ``[b·g/t, s, s]`` attention mask; CP: ``[b·g/t, L, (i+1)L]`` per
local chunk). An ``s x s`` boolean kept per layer would cost ``b·s²`` bytes per layer: at
``s = 8192``, ``b = 1`` that is 64 MiB per layer against 32 KiB of ids per micro-batch.
"""

from __future__ import annotations

import torch
from torch import Tensor

DOCUMENT_ID_BYTES = 4
"""Bytes per token of the document ids (int32) a micro-batch carries."""


def document_id_bytes(batch: int, seq_length: int) -> int:
    """Bytes of one micro-batch's document ids ``[b, s]`` (int32), shared by every layer."""
    return DOCUMENT_ID_BYTES * batch * seq_length


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
    "document_id_bytes",
    "document_ids",
    "positions_in_documents",
    "same_document",
]
