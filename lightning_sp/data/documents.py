"""What a packed sample carries about its documents (Megatron-LM's three reset flags).

The prepared token stream already records where documents end: every document is followed by
the end-of-document token (:mod:`lightning_sp.data.prepare`), so a sample's document ids are a
cumulative sum over its own ``s + 1`` tokens at load time (O(s), no pass over the corpus and no
extra file). Options:

* ``document_mask`` (``--reset-attention-mask``): the sample carries ``documents`` ``[s]``
  (int32 ids of its input tokens; a document ends at and includes its end-of-document token):
  attention is block-causal (:mod:`lightning_sp.model.documents`).
* ``reset_position_ids`` (``--reset-position-ids``): the sample carries ``positions`` ``[s]``,
  counting from 0 at each document's first token.
* ``eod_mask_loss`` (``--eod-mask-loss``): the sample carries ``loss_mask`` ``[s]``, false where
  the input token is the end-of-document token (its target is another document's first token),
  and the step's loss becomes the global token mean
  (:class:`~lightning_sp.pipeline.token_mean.TokenMean`).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from lightning_sp.model.documents import document_ids, positions_in_documents


@dataclass(frozen=True)
class DocumentOptions:
    """How a packed sample treats the documents inside it (all off: GPT-2's recipe)."""

    document_mask: bool = False
    """Attend within a document only (block-causal); the sample carries ``documents``."""
    reset_position_ids: bool = False
    """Positions restart at 0 at each document; the sample carries ``positions``."""
    eod_mask_loss: bool = False
    """No loss where the input token is the end-of-document token; the sample carries
    ``loss_mask``."""

    @property
    def any(self) -> bool:
        """Whether a sample carries anything beyond ``input_ids`` and ``labels``."""
        return self.document_mask or self.reset_position_ids or self.eod_mask_loss


def annotate(row: Tensor, eod_id: int, options: DocumentOptions) -> dict[str, Tensor]:
    """A sample's fields from its ``s + 1`` tokens ``row``: ``input_ids``, ``labels`` and what
    ``options`` ask for (see the module docstring), each ``[s]``."""
    inputs = row[:-1]
    sample = {"input_ids": inputs, "labels": row[1:]}
    if options.document_mask or options.reset_position_ids:
        documents = document_ids(inputs, eod_id)  # [s] int32
        if options.document_mask:
            sample["documents"] = documents
        if options.reset_position_ids:
            sample["positions"] = positions_in_documents(documents)
    if options.eod_mask_loss:
        sample["loss_mask"] = inputs != eod_id
    return sample


__all__ = ["DocumentOptions", "annotate"]
