"""What a pipeline rank's stages are made of (:mod:`lightning_sp.pipeline.steps` runs them):
its model chunks (:class:`Chunks`, each a :class:`~lightning_sp.model.gpt.GPT` built with its
``layer_range``), the module ``PipelineStage`` runs for one chunk (:class:`StageModule`), and
what the last stage may compute instead of the loss (:data:`Objective`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import cast, overload

from torch import Tensor, nn

from lightning_sp.model.gpt import GPT

Objective = Callable[[GPT, Tensor, Tensor], Tensor]
"""What the last stage computes instead of :meth:`GPT.loss`: ``(last chunk, hidden state
[s/t or s, b, h], target [b, s, ...]) -> a tensor``, one call per micro-batch in order; the
target is the step's ``labels`` argument split into micro-batches along dim 0 (any trailing
dims: a preference loss's slots and rows, :mod:`lightning_sp.training.preference`). In a
training step the result is the micro-batch's loss (backward runs on it, undivided); in
:meth:`~lightning_sp.pipeline.steps.PipelineSteps.outputs` any tensor, returned per micro-batch."""


# -- stage modules --------------------------------------------------------------------------------


class StageModule(nn.Module):
    """What ``PipelineStage`` runs for one chunk: ids ``[b, s]`` (first virtual stage) or the
    hidden state ``[s/t or s, b, h]`` in, the hidden state out. The last stage's head and loss
    run in the schedule's loss function (:meth:`GPT.loss`), where the labels are."""

    def __init__(self, chunk: GPT) -> None:
        super().__init__()
        self.chunk = chunk

    def forward(
        self, x: Tensor, documents: Tensor | None = None, positions: Tensor | None = None
    ) -> Tensor:
        if self.chunk.has_embedding:
            x = self.chunk.embed(x, positions=positions)  # [b, s] -> [s/t or s, b, h]
        return self.chunk.forward_layers(x, documents, positions)  # [s/t or s, b, h]


class Chunks(nn.ModuleList):
    """A rank's model chunks: an ``nn.ModuleList`` of :class:`GPT` (typed as such)."""

    @overload
    def __getitem__(self, index: slice) -> Chunks: ...

    @overload
    def __getitem__(self, index: int) -> GPT: ...

    def __getitem__(self, index: int | slice) -> GPT | Chunks:
        return cast("GPT | Chunks", super().__getitem__(index))  # it holds GPTs only

    def __iter__(self) -> Iterator[GPT]:
        return (self[i] for i in range(len(self)))
