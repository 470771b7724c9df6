"""Direct Preference Optimization (Rafailov et al., 2023): the settings, TRL's losses and
metrics, and the objective the last pipeline stage computes for every micro-batch.

A preference batch (:mod:`lightning_sp.data.preference`) holds in each row one or more
*pairs*: the prompt + chosen answer and the prompt + rejected answer as two documents of the
row, slots ``2j`` and ``2j + 1``, so a pair's halves always meet in one micro-batch, on one
data-parallel rank and one CP group. For pair ``i`` with answer log-probabilities
``π_c, π_r`` (the policy) and ``ρ_c, ρ_r`` (the reference), ``Δ = (π_c − ρ_c) − (π_r −
ρ_r)`` and, as TRL 1.16's ``DPOTrainer`` computes them (``loss_type``):

* ``sigmoid``: ``−log σ(β Δ)``;
* ``robust`` (TRL's label-smoothed DPO): ``(−(1−ε) log σ(βΔ) + ε log σ(−βΔ)) / (1 − 2ε)``;
* ``ipo``: ``(Δ' − 1/(2β))²`` with ``Δ'`` the difference of the length-normalised log
  ratios (each divided by its answer's token count).

The step's loss is the mean over the **global** batch's pairs (every micro-batch, data-parallel
rank and accumulated batch): each micro-batch's backward runs on the *sum* of its pairs'
losses, and the step divides every gradient by the global pair count
(:class:`~lightning_sp.pipeline.token_mean.TokenMean`, counting pairs), never a mean of
per-rank means. The metrics are TRL's, means over the same pairs: ``rewards/chosen`` (β(π_c −
ρ_c)), ``rewards/rejected``, ``rewards/accuracies`` (chosen reward > rejected),
``rewards/margins``, ``logps/chosen``, ``logps/rejected``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from lightning_sp.errors import ConfigError
from lightning_sp.model.gpt import GPT
from lightning_sp.model.sequence_logps import sequence_logps, slot_counts
from lightning_sp.parallel.state import ParallelState

LossType = Literal["sigmoid", "robust", "ipo"]
LOSS_TYPES: tuple[str, ...] = ("sigmoid", "robust", "ipo")
ReferenceKind = Literal["auto", "adapters", "copy", "precomputed"]
REFERENCES: tuple[str, ...] = ("auto", "adapters", "copy", "precomputed")
METRICS: tuple[str, ...] = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)
"""TRL's metric names, in the order of :class:`PairSums`' columns."""


@dataclass
class DPOConfig:
    """Direct Preference Optimization: the loss and where the reference comes from."""

    loss_type: str = "sigmoid"
    """TRL's ``loss_type``: ``sigmoid`` (DPO), ``robust`` (label-smoothed DPO, with
    ``label_smoothing``) or ``ipo`` (length-normalised IPO)."""

    beta: float = 0.1
    """β: how far the policy may move from the reference (IPO's τ), > 0."""

    label_smoothing: float = 0.0
    """``robust``: the probability that a preference label is flipped, in [0, 0.5). TRL 1.16
    reads it for ``robust`` only (its ``sigmoid`` ignores it): here it must be 0 for the
    other loss types."""

    reference: str = "auto"
    """The reference model: ``adapters`` (the base with LoRA adapters off: no second copy;
    needs ``lora``), ``copy`` (a frozen copy of the starting weights in the same layout),
    ``precomputed`` (log-probabilities the data carries, computed once before training), or
    ``auto``: ``adapters`` with LoRA, else ``copy`` (as TRL: no data pass, valid for any
    data; ``precomputed`` saves the copy's memory and forward)."""

    def validate(self, lora: bool = False) -> None:
        """:class:`ConfigError` (one line naming the field) for a value out of range;
        ``lora``: whether the run trains LoRA adapters."""
        if self.loss_type not in LOSS_TYPES:
            raise ConfigError(
                f"dpo.loss_type={self.loss_type!r} is invalid; valid: {', '.join(LOSS_TYPES)}"
            )
        beta = self.beta
        if isinstance(beta, bool) or not isinstance(beta, int | float):
            raise ConfigError(f"dpo.beta={beta!r} must be a positive finite number")
        if not math.isfinite(beta) or beta <= 0:
            raise ConfigError(f"dpo.beta={beta!r} must be a positive finite number")
        eps = self.label_smoothing
        if isinstance(eps, bool) or not isinstance(eps, int | float) or not math.isfinite(eps):
            raise ConfigError(f"dpo.label_smoothing={eps!r} must be a finite number in [0, 0.5)")
        if self.loss_type == "robust" and not 0.0 <= eps < 0.5:
            raise ConfigError(f"dpo.label_smoothing={eps!r} must be in [0, 0.5) for 'robust'")
        if self.loss_type != "robust" and eps != 0.0:
            raise ConfigError(
                f"dpo.label_smoothing={eps!r} applies to loss_type 'robust' only (TRL 1.16's "
                f"{self.loss_type!r} ignores it); set 0 or loss_type: robust"
            )
        if self.reference not in REFERENCES:
            raise ConfigError(
                f"dpo.reference={self.reference!r} is invalid; valid: {', '.join(REFERENCES)}"
            )
        if self.reference == "adapters" and not lora:
            raise ConfigError(
                "dpo.reference='adapters' needs LoRA adapters (model.lora); without them use "
                "'copy' or 'precomputed'"
            )

    def resolved_reference(self, lora: bool) -> ReferenceKind:
        """The reference this run uses (``auto`` resolved)."""
        if self.reference == "auto":
            return "adapters" if lora else "copy"
        return self.reference  # type: ignore[return-value]


def dpo_losses(
    config: DPOConfig,
    chosen: Tensor,
    rejected: Tensor,
    ref_chosen: Tensor,
    ref_rejected: Tensor,
    chosen_tokens: Tensor,
    rejected_tokens: Tensor,
) -> Tensor:
    """Per-pair losses (``chosen`` etc.: per-pair tensors of one shape), as TRL 1.16's
    ``DPOTrainer`` computes them (see the module docstring); ``*_tokens``: the answers'
    token counts (``ipo``)."""
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    beta = config.beta
    if config.loss_type == "ipo":
        delta = chosen_ratio / chosen_tokens.clamp(min=1) - rejected_ratio / rejected_tokens.clamp(
            min=1
        )
        return (delta - 1 / (2 * beta)) ** 2
    delta = chosen_ratio - rejected_ratio
    if config.loss_type == "robust":
        eps = config.label_smoothing
        clean = -(1 - eps) * F.logsigmoid(beta * delta)
        flipped = -eps * F.logsigmoid(-beta * delta)
        return (clean - flipped) / (1 - 2 * eps)
    return -F.logsigmoid(beta * delta)


def pair_metrics(
    beta: float, chosen: Tensor, rejected: Tensor, ref_chosen: Tensor, ref_rejected: Tensor
) -> Tensor:
    """Per-pair values of :data:`METRICS`, ``[..., 6]`` (detached)."""
    with torch.no_grad():
        reward_chosen = beta * (chosen - ref_chosen)
        reward_rejected = beta * (rejected - ref_rejected)
        accurate = (reward_chosen > reward_rejected).to(chosen.dtype)
        return torch.stack(
            [reward_chosen, reward_rejected, accurate, reward_chosen - reward_rejected,
             chosen, rejected], dim=-1,
        )  # fmt: skip


class PairSums:
    """Sums over pairs of the loss and of each metric, and the pair count, accumulated over
    the micro-batches and batches of a step (or a validation epoch) on this rank, then
    reduced over the pipeline and data-parallel groups (:meth:`reduce`)."""

    def __init__(self) -> None:
        self.values = [0.0] * (2 + len(METRICS))
        """``[loss sum, pairs, metric sums...]`` (Python floats: float64, kept off any
        device and outside autograd and inference mode)."""

    def add(self, losses: Tensor, metrics: Tensor) -> None:
        """One micro-batch's per-pair losses ``[P]`` and metrics ``[P, 6]`` (valid pairs)."""
        row = [float(losses.detach().double().sum()), float(losses.numel())]
        row += metrics.double().sum(0).tolist()
        self.values = [a + b for a, b in zip(self.values, row, strict=True)]

    def reduce(self, state: ParallelState) -> dict[str, float]:
        """The means over every pair the data-parallel replicas counted (``loss`` and
        :data:`METRICS`; 0 when none), identical on every rank; the sums are on the last
        pipeline stage (broadcast from it here). Resets the sums."""
        values = torch.tensor(self.values, dtype=torch.float64, device=state.device)
        if state.pipeline_parallel_size > 1:
            last = state.pipeline_parallel_size - 1
            dist.broadcast(values, group=state.pp_group, group_src=last)
        if state.dp_group is not None:
            dist.all_reduce(values, group=state.dp_group)
        values = values.cpu()
        self.values = [0.0] * len(self.values)
        pairs = float(values[1])
        means = (values / pairs if pairs else torch.zeros_like(values)).tolist()
        return {"loss": means[0], "pairs": pairs, **dict(zip(METRICS, means[2:], strict=True))}


@dataclass
class PreferenceTargets:
    """What the last stage needs besides the labels for one batch ``[B, s]``, built once per
    batch from its whole rows (equal on every rank of a replica)."""

    target: Tensor
    """``[B, s, 3]`` int64: label, slot (``-1``: no answer token), row index: the schedule's
    target, split into micro-batches along rows (and into CP chunks along tokens)."""
    tokens: Tensor
    """``[B, K]`` answer tokens per slot (``K`` even: chosen ``2j``, rejected ``2j + 1``)."""

    @property
    def num_slots(self) -> int:
        """``K``: sequence slots per row."""
        return int(self.tokens.shape[1])

    @property
    def pairs(self) -> Tensor:
        """``[B, K/2]`` bool: the pair slots that hold a pair."""
        return self.tokens[:, 0::2] > 0


class SequenceLogps:
    """The objective of a reference forward: each micro-batch's ``[b, K]`` answer
    log-probabilities (:func:`~lightning_sp.model.sequence_logps.sequence_logps`)."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots

    def __call__(self, chunk: GPT, hidden: Tensor, target: Tensor) -> Tensor:
        labels, slots, _ = target.unbind(-1)  # [b, s] each (this CP rank's tokens)
        return sequence_logps(
            chunk.logits(hidden), labels, slots, self.num_slots,
            vocab_start=chunk.vocab_start, vocab_size=chunk.config.vocab_size,
            tp_group=chunk.tp_group, cp_group=chunk.state.cp_group,
        )  # fmt: skip


class DPOObjective(SequenceLogps):
    """The policy's objective on the last stage: each micro-batch's summed pair losses (what
    its backward runs on), its pairs' losses and metrics added to ``sums``."""

    def __init__(
        self, config: DPOConfig, targets: PreferenceTargets, reference: Tensor, sums: PairSums
    ) -> None:
        super().__init__(targets.num_slots)
        self.config, self.targets, self.sums = config, targets, sums
        self.reference = reference
        """``[B, K]`` the reference's log-probabilities of the batch (on the last stage)."""

    def __call__(self, chunk: GPT, hidden: Tensor, target: Tensor) -> Tensor:
        logps = super().__call__(chunk, hidden, target)  # [b, K]
        rows = target[:, 0, 2]  # [b]: this micro-batch's rows of the batch
        reference = self.reference.to(logps.device)[rows].to(logps.dtype)  # [b, K]
        tokens = self.targets.tokens.to(logps.device)[rows]  # [b, K]
        valid = tokens[:, 0::2] > 0  # [b, K/2]
        pick = (logps[:, 0::2], logps[:, 1::2], reference[:, 0::2], reference[:, 1::2])
        chosen, rejected, ref_chosen, ref_rejected = (x[valid] for x in pick)  # [P] each
        losses = dpo_losses(
            self.config, chosen, rejected, ref_chosen, ref_rejected,
            tokens[:, 0::2][valid], tokens[:, 1::2][valid],
        )  # fmt: skip
        self.sums.add(losses, pair_metrics(self.config.beta, *(x.detach() for x in
                                                               (chosen, rejected, ref_chosen,
                                                                ref_rejected))))  # fmt: skip
        return losses.sum()


def preference_targets(labels: Tensor, slots: Tensor) -> PreferenceTargets:
    """:class:`PreferenceTargets` of a batch's whole rows: ``labels`` ``[B, s]``
    (:data:`~lightning_sp.parallel.vocab.IGNORE_INDEX` where masked), ``slots`` ``[B, s]``
    (each label's sequence slot in its row, ``-1`` for none)."""
    batch, seq = labels.shape
    highest = int(slots.max()) if slots.numel() else -1
    num_slots = max(2, 2 * ((highest + 2) // 2))  # even: whole pairs
    rows = torch.arange(batch, device=labels.device).unsqueeze(1).expand(batch, seq)
    target = torch.stack([labels, slots.to(labels.dtype), rows.to(labels.dtype)], dim=-1)
    return PreferenceTargets(target, slot_counts(labels, slots, num_slots))


__all__ = [
    "LOSS_TYPES",
    "METRICS",
    "REFERENCES",
    "DPOConfig",
    "DPOObjective",
    "PairSums",
    "PreferenceTargets",
    "SequenceLogps",
    "dpo_losses",
    "pair_metrics",
    "preference_targets",
]
