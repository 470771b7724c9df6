"""DPO in :class:`~lightning_sp.training.gpt_module.GPTModule` (``GPTModule(dpo=DPOConfig)``):
the reference forward, the policy's step with the preference objective, the step's pair mean
and TRL's metrics (:mod:`lightning_sp.training.preference`). ``GPTModule`` calls
:class:`PreferenceSteps` from its hooks; the pipeline, the layouts and the optimizer are the
module's own.

**The reference** (``dpo.reference``):

* ``adapters`` (the default with LoRA): the policy's own model with its adapters detached
  (:func:`~lightning_sp.model.lora.adapters_disabled`), in eval mode, without a graph: the
  frozen base, no second copy of any weight;
* ``copy`` (the default without LoRA, as TRL's): a frozen copy of the starting weights
  (seeded initialisation or ``init_from``) built in the same layout, held outside the module
  (no optimizer state, not in checkpoints: a resumed run rebuilds it from the same start);
  it costs a second set of weights and one forward per batch;
* ``precomputed``: the batch carries ``reference_logps`` ``[B, K]`` (TRL's
  ``precompute_ref_log_probs``): no reference weights or forward in the step. Before training,
  :meth:`PreferenceSteps.precompute` runs the starting policy (adapters off) once over every
  prepared sample of the data module and stores the log-probabilities beside the prepared
  tokens (:func:`~lightning_sp.data.preference.store_reference`); the samples then carry them.
  One process only for now (a parallel layout is refused in one line).

Each reference forward runs in eval mode (no dropout, so the dropout streams the policy draws
from are untouched) and gives ``[B, K]`` on the last pipeline stage.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from torch.utils.data import default_collate

from lightning_sp.data.preference import REFERENCE, store_reference
from lightning_sp.data.tokens import PackedSamples
from lightning_sp.errors import ConfigError
from lightning_sp.interop.hf import load_hf_weights
from lightning_sp.model.documents import Packing
from lightning_sp.model.gpt import GPT
from lightning_sp.model.hooks import has_auxiliary_losses
from lightning_sp.model.lora import adapters_disabled
from lightning_sp.model.recompute import NO_RECOMPUTE
from lightning_sp.parallel.context import shard_for_context_parallel
from lightning_sp.parallel.state import ParallelState
from lightning_sp.pipeline import Pipeline
from lightning_sp.pipeline.token_mean import TokenMean
from lightning_sp.training.batches import labels_of
from lightning_sp.training.preference import (
    DPOConfig,
    DPOObjective,
    PairSums,
    PreferenceTargets,
    SequenceLogps,
    preference_targets,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from lightning_sp.model.config import GPTConfig

SEQUENCES = "sequences"
"""The batch field of each label's sequence slot in its row (``-1``: no answer token)."""


def check_dpo(config: DPOConfig, model: GPTConfig, lora: bool) -> None:
    """Everything a DPO run checks before any work: the settings, and a model without
    auxiliary losses (a mixture-of-experts layer's: the step rescales every gradient by the
    global pair count once known, which would rescale their share too; a one-layer model on
    the ``meta`` device answers)."""
    config.validate(lora)
    one = dataclasses.replace(model, num_layers=1, recompute=NO_RECOMPUTE, sequence_parallel=False)
    if has_auxiliary_losses(GPT(one, ParallelState.single(), device="meta")):
        raise ConfigError(
            "dpo with a mixture-of-experts model is not supported (its auxiliary losses "
            "cannot join the pair mean); unset model.dpo or use a dense model"
        )


def reference_copy(config: GPTConfig, policy: Pipeline, init_from: str | None) -> Pipeline:
    """A frozen copy of the policy's starting weights in its layout: the seeded
    initialisation of ``config``, then ``init_from``'s weights if given."""
    reference = Pipeline(
        config, policy.state,
        num_microbatches=policy.num_microbatches,
        virtual_pipeline_size=policy.virtual_pipeline_size,
        dtype=next(policy.parameters()).dtype, device=policy.state.device,
        timeout=policy.state.timeout,
    )  # fmt: skip
    if init_from is not None:
        for chunk in reference.chunks:
            load_hf_weights(chunk, init_from)
    return reference.requires_grad_(False).eval()


@contextmanager
def _evaluating(model: Pipeline) -> Iterator[None]:
    """``model`` in eval mode inside, its mode restored after."""
    was = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was)


class PreferenceSteps:
    """What :class:`GPTModule` runs for a DPO run (see the module docstring)."""

    def __init__(self, config: DPOConfig, lora: bool) -> None:
        self.config = config
        self.kind = config.resolved_reference(lora)
        self.copy: list[Pipeline] = []  # the frozen copy (a list: not a submodule)
        self.train_sums, self.val_sums = PairSums(), PairSums()

    def configure(
        self, config: GPTConfig, policy: Pipeline, init_from: str | None, data: object = None
    ) -> None:
        """Build the frozen copy (``copy``), as the policy was built before training; or
        (``precomputed``) store the reference log-probabilities of ``data``'s samples."""
        if self.kind == "copy" and not self.copy:
            self.use_copy(reference_copy(config, policy, init_from))
        if self.kind == "precomputed" and data is not None:  # in the loaders' batch size
            self.precompute(policy, data, int(getattr(data, "batch_size", 8)))

    def precompute(self, policy: Pipeline, data: object, batch_size: int = 8) -> None:
        """Run the starting ``policy`` (adapters off, eval mode, no graph) once over every
        sample of ``data``'s prepared training and validation splits (a
        :class:`~lightning_sp.data.TextDataModule` with preference data, set up) and store
        each split's ``[samples, K]`` log-probabilities with its prepared tokens."""
        state = policy.state
        if state.world_size > 1:
            raise ConfigError(
                f"dpo.reference='precomputed' computes the reference in one process, not "
                f"{state.world_size} ranks; use 'copy' or 'adapters', or one device"
            )
        found = [getattr(data, "train_dataset", None), getattr(data, "val_dataset", None)]
        datasets = [d for d in found if isinstance(d, PackedSamples)]
        if len(datasets) < 2 or not all(s.preference for d in datasets for s in d.streams):
            raise ConfigError(
                "dpo.reference='precomputed' needs the prepared preference data "
                "(data.preference: true); use 'copy' or 'adapters'"
            )
        step = batch_size * policy.num_microbatches
        for dataset in datasets:
            for k, stream in enumerate(dataset.streams):
                start, stop = int(dataset.offsets[k]), int(dataset.offsets[k + 1])
                rows: list[Tensor] = []
                for first in range(start, stop, step):
                    index = [min(i, stop - 1) for i in range(first, first + step)]  # padded
                    batch = default_collate([dataset[i] for i in index])
                    batch.pop(REFERENCE, None)
                    targets, ids, target, packing = self._inputs(batch, state)
                    with adapters_disabled(policy), _evaluating(policy), torch.no_grad():
                        out = policy.outputs(ids, target, packing, SequenceLogps(targets.num_slots))
                    rows += list(torch.cat(out)[: stop - first].double())
                width = max((len(r) for r in rows), default=0)
                table = torch.zeros(len(rows), width, dtype=torch.float64)
                for j, row in enumerate(rows):
                    table[j, : len(row)] = row
                store_reference(stream.directory, table.numpy())
                stream._reference = None  # read the new file

    def use_copy(self, reference: Pipeline) -> None:
        """Take ``reference`` (frozen, in the policy's layout) as the ``copy`` reference."""
        reference.requires_grad_(False)
        reference.eval()
        self.copy[:] = [reference]

    # -- one batch ----------------------------------------------------------------------------

    def _inputs(
        self, batch: dict[str, Tensor], state: ParallelState
    ) -> tuple[PreferenceTargets, Tensor, Tensor, Packing]:
        """The batch's targets (whole rows), this CP rank's ids and target chunks, packing."""
        if SEQUENCES not in batch:
            raise ConfigError(
                "model.dpo needs preference data (batches with 'sequences': "
                "data.preference: true with prompt/chosen/rejected rows)"
            )
        targets = preference_targets(labels_of(batch), batch[SEQUENCES])
        c, r = state.context_parallel_size, state.context_parallel_rank
        ids = shard_for_context_parallel(batch["input_ids"], 1, c, r)  # [B, s/c]
        target = shard_for_context_parallel(targets.target, 1, c, r)  # [B, s/c, 3]
        return targets, ids, target, Packing.of_batch(batch, state)

    def _reference(
        self,
        policy: Pipeline,
        batch: dict[str, Tensor],
        targets: PreferenceTargets,
        inputs: tuple[Tensor, Tensor, Packing],
    ) -> Tensor:
        """The reference log-probabilities ``[B, K]`` of the batch (on the last stage; zeros
        elsewhere)."""
        k = targets.num_slots
        if self.kind == "precomputed":
            given = batch.get(REFERENCE)
            if given is None:
                raise ConfigError(
                    "dpo.reference='precomputed' needs batches with reference_logps (data "
                    "prepared with them); use 'copy' or 'adapters'"
                )
            out = given.new_zeros((given.shape[0], k))
            width = min(k, given.shape[1])
            out[:, :width] = given[:, :width]
            return out
        objective = SequenceLogps(k)
        if self.kind == "copy":
            outputs = self.copy[0].outputs(*inputs, objective)
        else:
            with adapters_disabled(policy), _evaluating(policy):
                outputs = policy.outputs(*inputs, objective)
        if outputs:
            return torch.cat(outputs).detach()
        return torch.zeros(targets.tokens.shape, dtype=torch.float64)

    def run(
        self, model: Pipeline, batch: dict[str, Tensor], sums: PairSums, train: bool = True
    ) -> tuple[Tensor, int]:
        """One batch through ``model`` (this rank's policy): the reference forward, then the
        policy's on the summed pair losses; returns that sum and the batch's pair count.
        ``train``: with ``p = 1`` the loss keeps its graph for the caller's backward, with
        ``p > 1`` the schedule has run backward too; else forward only (validation). The
        pairs' losses and metrics are added to ``sums``."""
        targets, ids, target, packing = self._inputs(batch, model.state)
        reference = self._reference(model, batch, targets, (ids, target, packing))
        objective = DPOObjective(self.config, targets, reference, sums)
        pairs = int(targets.pairs.sum())
        if not train:
            losses = model.outputs(ids, target, packing, objective)
            return torch.stack(losses).sum() if losses else torch.zeros(()), pairs
        if not model.runs_backward:
            return model(ids, target, packing, objective=objective), pairs
        return model.train_step(ids, target, packing, objective), pairs

    def training_step(
        self,
        model: Pipeline,
        batch: dict[str, Tensor],
        mean: TokenMean,
        zero_grad: Callable[[], None],
    ) -> Tensor:
        """One batch of a step (:meth:`run`), its pairs counted in the step's ``mean``;
        ``zero_grad`` runs first under pipeline parallelism (the schedule runs backward)."""
        if model.runs_backward:
            zero_grad()
        loss, pairs = self.run(model, batch, self.train_sums)
        mean.add_count(pairs, loss)
        return loss

    def step_metrics(self, state: ParallelState) -> dict[str, float]:
        """TRL's metrics over the step's pairs (every micro-batch, replica and accumulated
        batch), to log as ``train/<name>``; resets them."""
        means = self.train_sums.reduce(state)
        means.pop("loss"), means.pop("pairs")
        return means

    def validation_step(self, model: Pipeline, batch: dict[str, Tensor]) -> None:
        """One validation batch: its pairs' losses and metrics added to the epoch's sums."""
        self.run(model, batch, self.val_sums, train=False)

    def validation_metrics(self, state: ParallelState) -> dict[str, float]:
        """The epoch's loss and TRL's metrics, means over every validation pair."""
        means = self.val_sums.reduce(state)
        means.pop("pairs")
        return means


__all__ = ["REFERENCE", "SEQUENCES", "PreferenceSteps", "check_dpo", "reference_copy"]
