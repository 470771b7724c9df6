"""The steps of a :class:`~lightning_sp.pipeline.stages.Pipeline`: forward and backward (or
forward only) of every micro-batch of a batch, on one rank's model chunks.

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
With ``p = 1`` the micro-batches run one after another (gradient accumulation).

Gradients: each micro-batch's loss is divided by ``n`` inside the loss function and the
schedule's own gradient scaling is off (``scale_grads=False``: it divides ``param.grad``
only, which misses gradients that hooks have already moved into fp32 ``main_grad``). After
:meth:`PipelineSteps.train_step` every parameter holds the gradient of the mean loss over the
whole batch, exactly as one process computing the batch at once would.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeAlias

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_sp.model.config import GPTConfig
from lightning_sp.model.documents import Packing, Reduction
from lightning_sp.parallel.state import ParallelState
from lightning_sp.pipeline.chunks import Chunks, Objective, StageModule
from lightning_sp.pipeline.split import check_batch

if TYPE_CHECKING:  # imported where a schedule is built: it loads torch._dynamo (~2 s a process)
    from torch.distributed.pipelining import Schedule1F1B, ScheduleInterleaved1F1B

_Schedule: TypeAlias = "Schedule1F1B | ScheduleInterleaved1F1B"


class PipelineSteps(nn.Module):
    """The steps of one rank's model chunks (``Pipeline``, which builds the attributes
    below)."""

    config: GPTConfig
    state: ParallelState
    chunks: Chunks
    num_microbatches: int
    virtual_pipeline_size: int
    schedule_name: str
    stage_indices: list[int]
    has_embedding: bool
    has_head: bool
    _stage_modules: list[StageModule]
    _schedules: dict[tuple[int, int, torch.dtype], _Schedule]
    _reduction: Reduction
    _objective: Objective | None

    # -- layout --------------------------------------------------------------------------------

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
