"""Pipeline parallelism: GPT stages run by ``torch.distributed.pipelining`` (paper §4.4).

Each rank holds the model chunks :func:`~lightning_sp.pipeline.split.chunk_layer_ranges`
gives it (chunk ``c`` of pipeline rank ``r`` is virtual stage ``c·p + r``; the layout and
its checks are in :mod:`lightning_sp.pipeline.split`). Each chunk is a
:class:`~lightning_sp.model.gpt.GPT` built with its ``layer_range``, so tensor and sequence
parallelism (their collectives on the TP group) run unchanged inside every stage. Virtual
stage 0 holds the embedding, virtual stage ``p·m − 1`` the final LayerNorm, the output layer
(a copy of the tied embedding) and the loss.

What crosses a stage boundary is the hidden state in the layout the layers use: the sequence
shard ``[s/t, b, h]`` under sequence parallelism, else ``[s, b, h]`` (batch on dim 1). The
global batch ``[B, s]`` is split into ``n`` micro-batches along dim 0. Under context
parallelism the batch given is the CP rank's chunks ``[B, s/c]`` (``s`` below is that local
length), so stages pass ``[s/(c·t), b, h]``; the loss function's token mean over the CP group
and the attention's K/V exchanges are collectives of the CP ranks of one stage, which run the
same schedule in the same order.

Schedules are torch's: :class:`~torch.distributed.pipelining.Schedule1F1B` for ``m = 1`` and
:class:`~torch.distributed.pipelining.ScheduleInterleaved1F1B` for ``m > 1``. Stage shapes are
given statically (no metadata-inference pass, which would run a real forward and backward and
draw dropout masks), so a schedule is built per micro-batch shape on first use and cached.

Gradients: each micro-batch's loss is divided by ``n`` inside the loss function and the
schedule's own gradient scaling is off (``scale_grads=False``: it divides ``param.grad``
only, which misses gradients that hooks have already moved into fp32 ``main_grad``). After
:meth:`Pipeline.train_step` every parameter holds the gradient of the mean loss over the
whole batch, exactly as one process computing the batch at once would.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeAlias

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_sp.model.config import GPTConfig
from lightning_sp.model.documents import Packing, Reduction
from lightning_sp.model.gpt import GPT
from lightning_sp.model.hooks import scale_auxiliary_losses
from lightning_sp.parallel import grads as grad_utils
from lightning_sp.parallel.buffer import GradBuffer
from lightning_sp.parallel.state import DEFAULT_TIMEOUT, ParallelState
from lightning_sp.pipeline.chunks import Chunks, Objective, StageModule
from lightning_sp.pipeline.split import (
    ScheduleName,
    check_batch,
    check_pipeline,
    chunk_layer_ranges,
)

if TYPE_CHECKING:  # imported where a schedule is built: it loads torch._dynamo (~2 s a process)
    from torch.distributed.pipelining import Schedule1F1B, ScheduleInterleaved1F1B

_Schedule: TypeAlias = "Schedule1F1B | ScheduleInterleaved1F1B"


class Pipeline(nn.Module):
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
        self._schedules: dict[tuple[int, int, torch.dtype], _Schedule] = {}
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

    @property
    def _device(self) -> torch.device:
        return next(self.chunks[0].parameters()).device

    @property
    def _loss_dtype(self) -> torch.dtype:
        """fp32 for bf16/fp16 models (the cross entropy runs in fp32), else the model's."""
        return torch.promote_types(next(self.chunks[0].parameters()).dtype, torch.float32)

    def _hidden_shape(self, micro_batch: int, seq: int) -> tuple[int, int, int]:
        t = self.state.tensor_parallel_size
        s_local = seq // t if self.config.sequence_parallel else seq
        return (s_local, micro_batch, self.config.hidden_size)  # [s/t or s, b, h]

    def _check_inputs(self, input_ids: Tensor, labels: Tensor | None) -> int:
        """Validate a batch ``[B, s]``; return the micro-batch size ``B / n``."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
        if labels is not None and labels.shape[:2] != input_ids.shape:
            raise ValueError(
                f"labels shape {tuple(labels.shape)} differs from input_ids "
                f"{tuple(input_ids.shape)}"
            )
        batch, seq = input_ids.shape
        micro = check_batch(batch, self.num_microbatches)
        self.chunks[0].check_sequence(seq)
        return micro

    def _loss_fn(self, output: Tensor, target: Tensor) -> Tensor:
        """Head and loss of one micro-batch. ``reduction="mean"``: its mean divided by ``n``,
        so that summed over micro-batches this is the mean loss of the batch, and its gradients
        those of the mean. ``"sum"``: the sum over its counted tokens, undivided. With an
        objective (:data:`Objective`), its result."""
        if self._objective is not None:
            return self._objective(self.chunks[-1], output, target)
        if self._reduction == "sum":
            return self.chunks[-1].loss(output, target, "sum")
        return self.chunks[-1].loss(output, target) / self.num_microbatches

    def _schedule(self, input_ids: Tensor) -> _Schedule:
        """The schedule (and its stages) for the micro-batch shape of ``input_ids``, built on
        first use. Shapes are static, so no stage runs a metadata-inference pass."""
        micro_batch, seq = input_ids.shape[0] // self.num_microbatches, input_ids.shape[1]
        key = (micro_batch, seq, input_ids.dtype)
        if key in self._schedules:
            return self._schedules[key]
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleInterleaved1F1B,
        )

        p, m = self.state.pipeline_parallel_size, self.virtual_pipeline_size
        param = next(self.chunks[0].parameters())
        hidden = torch.empty(  # what every stage sends on: [s/t or s, b, h]
            self._hidden_shape(micro_batch, seq),
            dtype=param.dtype,
            requires_grad=True,
            device="meta",
        )
        ids = torch.empty((micro_batch, seq), dtype=input_ids.dtype, device="meta")  # [b, s]
        stages = [
            PipelineStage(
                module,
                index,
                p * m,
                param.device,
                input_args=ids if index == 0 else hidden,
                output_args=hidden,
                group=self.state.pp_group,
            )
            for module, index in zip(self._stage_modules, self.stage_indices, strict=True)
        ]
        n, loss_fn = self.num_microbatches, self._loss_fn
        schedule: _Schedule = (
            Schedule1F1B(stages[0], n, loss_fn=loss_fn, scale_grads=False)
            if self.schedule_name == "1f1b"
            else ScheduleInterleaved1F1B([*stages], n, loss_fn=loss_fn, scale_grads=False)
        )
        self._schedules[key] = schedule
        return schedule

    # -- steps ---------------------------------------------------------------------------------

    @property
    def runs_backward(self) -> bool:
        """Whether :meth:`train_step` runs the backward passes itself (a schedule over
        ``p > 1`` stages). When ``False`` (``p = 1``) the caller may instead take the loss from
        :meth:`forward` and run backward itself (Lightning's automatic optimisation)."""
        return self.schedule_name != "none"

    def forward(
        self,
        input_ids: Tensor,
        labels: Tensor,
        packing: Packing | Reduction = "mean",
        objective: Objective | None = None,
    ) -> Tensor:
        """``p = 1`` only: the mean (or sum: ``packing.reduction``) loss of the batch with its
        graph (the whole model is this rank's one chunk), for the caller to run backward;
        with an ``objective``, its result on the whole batch (``labels``: its target)."""
        if self.runs_backward:
            raise RuntimeError("with pipeline_parallel_size > 1 the schedule runs: use train_step")
        if objective is None:
            return self.chunks[0](input_ids, labels, packing)
        packing = Packing.of(packing)
        self._check_inputs(input_ids, labels)
        chunk = self.chunks[0]
        x = chunk.embed(input_ids, positions=packing.positions)
        x = chunk.forward_layers(x, packing.documents, packing.positions)
        return objective(chunk, x, labels)

    @contextmanager
    def _running(self, packing: Packing, objective: Objective | None) -> Iterator[None]:
        """The step's reduction and objective, for the loss function; the objective is
        forgotten after the step."""
        self._reduction, self._objective = packing.reduction, objective
        try:
            yield
        finally:
            self._objective = None

    def train_step(
        self,
        input_ids: Tensor,
        labels: Tensor,
        packing: Packing | Reduction = "mean",
        objective: Objective | None = None,
    ) -> Tensor:
        """Forward and backward of all ``n`` micro-batches of ``input_ids``/``labels`` ``[B, s]``.

        Gradients are accumulated into the parameters (``grad``, or ``main_grad`` through the
        optimizer's hooks): their sum over micro-batches is the gradient of the mean loss over
        the batch. They are not yet reduced: call :meth:`finalize_grads` before the optimizer.
        Returns the mean loss (a detached scalar, fp32 for bf16/fp16 models) on every rank of
        the pipeline. ``packing.reduction="sum"``: the loss and its gradients are instead the
        sum over the counted tokens (labels not :data:`~lightning_sp.parallel.vocab.
        IGNORE_INDEX`) of all micro-batches, for :class:`~lightning_sp.pipeline.token_mean.
        TokenMean` to divide by the step's global count. ``packing.documents`` (``[B, s]`` ids
        of the whole sequences) and ``packing.positions`` (``[B, s]`` of the given tokens):
        packed documents (:meth:`GPT.forward`); every stage receives its micro-batch's rows.
        ``objective`` (:data:`Objective`): each micro-batch's loss is its result instead
        (``labels``: its target), and the returned loss their sum.
        """
        packing = Packing.of(packing)
        self._check_inputs(input_ids, labels)
        extra: dict[str, Any] = packing.sequence()
        with self._running(packing, objective):
            if self.schedule_name == "none":
                return self._accumulate(input_ids, labels, backward=True, **extra)
            schedule = self._schedule(input_ids)
            losses: list[Tensor] = []
            with torch.enable_grad():
                schedule.step(
                    *((input_ids,) if self.has_embedding else ()),
                    target=labels if self.has_head else None,
                    losses=losses,
                    return_outputs=False,
                    **extra,
                )
        return self._broadcast_loss(losses)

    @torch.no_grad()
    def outputs(
        self, input_ids: Tensor, target: Tensor, packing: Packing | Reduction, objective: Objective
    ) -> list[Tensor]:
        """Forward of all micro-batches (no graph, no gradient) and ``objective``'s result
        for each, in micro-batch order, on the last stage (an empty list on the others): a
        reference model's per-sequence log-probabilities, a validation's sums. The caller
        sets train/eval mode."""
        packing = Packing.of(packing)
        self._check_inputs(input_ids, target)
        extra: dict[str, Any] = packing.sequence()
        with self._running(packing, objective):
            if self.schedule_name == "none":
                chunk, n = self.chunks[0], self.num_microbatches
                parts = {k: v.chunk(n) for k, v in extra.items()}
                results = []
                for i, (ids, part) in enumerate(
                    zip(input_ids.chunk(n), target.chunk(n), strict=True)
                ):
                    micro = {k: v[i] for k, v in parts.items()}
                    x = chunk.embed(ids, positions=micro.get("positions"))
                    results.append(objective(chunk, chunk.forward_layers(x, **micro), part))
                return results
            results = []
            self._schedule(input_ids).eval(
                *((input_ids,) if self.has_embedding else ()),
                target=target if self.has_head else None,
                losses=results,
                **extra,
            )
        return results if self.has_head else []

    @torch.no_grad()
    def eval_step(
        self, input_ids: Tensor, labels: Tensor, packing: Packing | Reduction = "mean"
    ) -> Tensor:
        """Forward of all micro-batches (validation; no graph is built, no gradient touched).

        The caller sets train/eval mode (dropout) as for any module. Returns the mean (or sum)
        loss (as :meth:`train_step`) on every rank of the pipeline.
        """
        packing = Packing.of(packing)
        self._check_inputs(input_ids, labels)
        self._reduction = packing.reduction
        extra: dict[str, Any] = packing.sequence()
        if self.schedule_name == "none":
            return self._accumulate(input_ids, labels, backward=False, **extra)
        schedule = self._schedule(input_ids)
        losses: list[Tensor] = []
        schedule.eval(
            *((input_ids,) if self.has_embedding else ()),
            target=labels if self.has_head else None,
            losses=losses,
            **extra,
        )
        return self._broadcast_loss(losses)

    def _accumulate(
        self, input_ids: Tensor, labels: Tensor, backward: bool, **extra: Tensor
    ) -> Tensor:
        """``p = 1``: the micro-batches one after another (gradient accumulation)."""
        chunk, n = self.chunks[0], self.num_microbatches
        total = torch.zeros((), dtype=self._loss_dtype, device=self._device)
        parts = {k: v.chunk(n) for k, v in extra.items()}
        for i, (ids, target) in enumerate(zip(input_ids.chunk(n), labels.chunk(n), strict=True)):
            micro = {k: v[i] for k, v in parts.items()}
            positions = micro.get("positions")
            x = chunk.forward_layers(chunk.embed(ids, positions=positions), **micro)
            loss = self._loss_fn(x, target)
            if backward:
                loss.backward()
            total += loss.detach()
        return total

    def _broadcast_loss(self, losses: list[Tensor]) -> Tensor:
        """The mean loss from the last stage (sum of the ``loss / n``), sent to every stage."""
        if self.has_head:
            loss = torch.stack([x.detach() for x in losses]).sum()
        else:
            loss = torch.zeros((), dtype=self._loss_dtype, device=self._device)
        last = self.state.pipeline_parallel_size - 1
        dist.broadcast(loss, group=self.state.pp_group, group_src=last)
        return loss

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
