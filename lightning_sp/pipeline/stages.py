"""Pipeline parallelism: GPT stages run by ``torch.distributed.pipelining`` (paper §4.4).

Each rank holds the model chunks :func:`~lightning_sp.pipeline.split.chunk_layer_ranges`
gives it (chunk ``c`` of pipeline rank ``r`` is virtual stage ``c·p + r``; the layout and
its checks are in :mod:`lightning_sp.pipeline.split`). Each chunk is a
:class:`~lightning_sp.model.gpt.GPT` built with its ``layer_range``, so tensor and sequence
parallelism (their collectives on the TP group) run unchanged inside every stage. Virtual
stage 0 holds the embedding, virtual stage ``p·m − 1`` the final LayerNorm, the output layer
(a copy of the tied embedding) and the loss.

The steps (forward and backward of every micro-batch through torch's schedules, the layout
that crosses a stage boundary, the gradients they leave) are
:class:`~lightning_sp.pipeline.steps.PipelineSteps`, this class's base; here the chunks are
built, the tied embedding's two copies summed, the gradients finalised and the RNG streams
saved.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_sp.model.config import GPTConfig
from lightning_sp.model.documents import Reduction
from lightning_sp.model.gpt import GPT
from lightning_sp.model.hooks import scale_auxiliary_losses
from lightning_sp.parallel import grads as grad_utils
from lightning_sp.parallel.buffer import GradBuffer
from lightning_sp.parallel.state import DEFAULT_TIMEOUT, ParallelState
from lightning_sp.pipeline.chunks import Chunks, Objective, StageModule
from lightning_sp.pipeline.split import (
    ScheduleName,
    check_pipeline,
    chunk_layer_ranges,
)
from lightning_sp.pipeline.steps import PipelineSteps


class Pipeline(PipelineSteps):
    """One rank's model chunks and the pipeline schedule that trains them.

    Every rank of a pipeline (all ``tp`` and ``pp`` ranks of one data-parallel replica) calls
    :meth:`train_step` / :meth:`eval_step` with the same batch: the first stage reads the token
    ids, the last stage the labels, and every stage the batch's shape.

    Args:
        config: The model. ``config.recompute`` must be resolved (not ``auto``).
        state: This rank's parallel state; ``pipeline_parallel_size`` is ``p``.
        num_microbatches: Micro-batches per step (``n``); the batch given to a step must be
            divisible by it.
        virtual_pipeline_size: Model chunks per pipeline rank (``m``); ``m > 1`` interleaves.
        dtype, device: Of the parameters (default: torch's default dtype, ``state.device``).
        schedule: ``"auto"`` (1F1B for ``m = 1``, interleaved for ``m > 1``), ``"1f1b"`` or
            ``"interleaved"``.
        timeout: Of the process group that sums the tied embedding's gradient (``p > 2``).

    Attributes:
        chunks: This rank's ``m`` :class:`GPT` chunks in virtual-stage order (state-dict keys
            ``chunks.<c>.<GPT parameter name>``).
    """

    def __init__(
        self,
        config: GPTConfig,
        state: ParallelState,
        *,
        num_microbatches: int,
        virtual_pipeline_size: int = 1,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        schedule: ScheduleName = "auto",
        timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    ) -> None:
        super().__init__()
        p, m = state.pipeline_parallel_size, virtual_pipeline_size
        self.schedule_name = check_pipeline(config.num_layers, p, m, num_microbatches, schedule)
        self.config, self.state = config, state
        self.num_microbatches = num_microbatches
        self.virtual_pipeline_size = m
        ranges = chunk_layer_ranges(config.num_layers, p, m, state.pipeline_parallel_rank)
        # registered here: parameters ``chunks.<c>.…``
        self.chunks: Chunks = Chunks(GPT(config, state, layer_range=r, dtype=dtype, device=device)
                             for r in ranges)  # fmt: skip
        # each micro-batch's loss is divided by n: so are its layers' auxiliary losses
        scale_auxiliary_losses(self.chunks, 1 / num_microbatches)
        self.stage_indices = [c * p + state.pipeline_parallel_rank for c in range(m)]
        self.has_embedding = self.chunks[0].has_embedding
        self.has_head = self.chunks[-1].has_head
        if p > 1 and self.has_head and config.tie_embeddings:
            # the output layer's copy of the tied embedding: its gradient is summed with stage
            # 0's, and the global norm counts the original only
            self.chunks[-1].word_embeddings.weight.pipeline_copy = True  # type: ignore[attr-defined]
        # plain lists, so the chunks are registered once (under ``chunks``)
        self._stage_modules = [StageModule(chunk) for chunk in self.chunks]
        self._schedules = {}  # built on first use (PipelineSteps._schedule)
        self._embedding_group = self._make_embedding_group(timeout)
        self._reduction: Reduction = "mean"  # of the step running (train_step, eval_step)
        self._objective: Objective | None = None  # replaces GPT.loss for the step running

    # -- layout --------------------------------------------------------------------------------

    def _make_embedding_group(self, timeout: datetime.timedelta) -> dist.ProcessGroup | None:
        """The group of the two ranks (first and last stage, same dp/cp/tp coordinates) that hold
        a copy of the tied embedding; ``None`` on other ranks and without pipelining."""
        state = self.state
        p = state.pipeline_parallel_size
        if p == 1 or not self.config.tie_embeddings:
            return None
        if p == 2:
            return state.pp_group
        assert state.mesh is not None
        ranks = state.mesh.mesh.reshape(p, -1)  # [pp, (dp, cp, tp)] -> global rank
        mine = None
        # every rank creates every group, in the same order (new_group is collective)
        for column in range(ranks.shape[1]):
            pair = [int(ranks[0, column]), int(ranks[p - 1, column])]
            group = dist.new_group(pair, timeout=timeout)
            if dist.get_rank() in pair:
                mine = group
        return mine if (self.has_embedding or self.has_head) else None

    # -- gradients and state -------------------------------------------------------------------

    def allreduce_tied_embedding_grads(self) -> None:
        """Sum the gradients of the two copies of the tied embedding (first stage: the input
        embedding; last stage: the output layer), so both copies take the same update."""
        if self._embedding_group is None:
            return
        chunk = self.chunks[0] if self.has_embedding else self.chunks[-1]
        weight = chunk.word_embeddings.weight
        grad = grad_utils.grad_of(weight)
        if grad is None:
            weight.grad = grad = torch.zeros_like(weight)
        dist.all_reduce(grad, group=self._embedding_group)

    def tied_embedding_weights(self) -> list[Tensor]:
        """This rank's copy of the tied embedding when it is summed over stages (else none):
        a gradient buffer reduces it over data parallelism only after that sum."""
        if self._embedding_group is None:
            return []
        chunk = self.chunks[0] if self.has_embedding else self.chunks[-1]
        return [chunk.word_embeddings.weight]

    def finalize_grads(self, buffer: GradBuffer | None = None) -> None:
        """Every reduction between the last backward and the optimizer step: the tied
        embedding over the first and last stage, then sequence-parallel gradients over the
        TP group and the mean over data-parallel replicas
        (:func:`lightning_sp.parallel.grads.finalize_grads`, through ``buffer`` if given)."""
        self.allreduce_tied_embedding_grads()
        grad_utils.finalize_grads(self, self.state, buffer)

    def rng_state_dict(self) -> dict[str, dict[str, Tensor]]:
        """The dropout streams of every chunk, keyed by chunk index (for checkpoints)."""
        return {str(c): chunk.rng.state_dict() for c, chunk in enumerate(self.chunks)}

    def load_rng_state_dict(self, state_dict: dict[str, dict[str, Tensor]]) -> None:
        """Restore :meth:`rng_state_dict`."""
        for c, chunk in enumerate(self.chunks):
            chunk.rng.load_state_dict(state_dict[str(c)])

    def global_name(self, name: str) -> str:
        """A parameter's name (``chunks.<c>.…``) in the unsplit, unsharded model."""
        _, c, rest = name.split(".", 2)
        return self.chunks[int(c)].global_name(rest)
