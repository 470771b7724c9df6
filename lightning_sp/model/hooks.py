"""The generic module hooks: what the training loop, the pipeline and checkpoints ask of a
model's modules besides their forward, without knowing which part built them.

A module opts in by having the method of a protocol below (structural: it imports nothing
from here); the walkers find every such module of a model (one :class:`GPT`, a pipeline's
chunks, any module holding them) and call it:

* :class:`AuxiliaryLosses`: a module whose forward adds terms to the training objective
  through its output's backward (an MoE layer's load-balancing losses). The loop sets their
  scale to the main loss's (``1 / micro-batches per step``): :func:`scale_auxiliary_losses`.
  :func:`has_auxiliary_losses` says whether a model has any, :func:`auxiliary_losses_on`
  whether they reach this run's gradient (a step that rescales every gradient afterwards, a
  token mean over loss masks, scales them up front to cancel it);
* :class:`AfterOptimizerStep`: state moved once after every optimizer step from what the
  step's forwards counted (an MoE router's auxiliary-loss-free bias):
  :func:`after_optimizer_step`, collective over the ranks of a stage;
* :class:`CountsStepTotals`: sums over a step's training forwards from which the step's
  metrics are made; the part that builds the module declares their width and the metrics
  (:meth:`~lightning_sp.model.parts.base.Part.step_totals`), so every rank knows the table
  whatever layers it holds: :func:`step_metrics`, collective over the data- and
  pipeline-parallel groups;
* persistent state: a persistent buffer (``register_buffer(..., persistent=True)``, the same
  on every rank that holds the layer: an MoE router's ``expert_bias``). Checkpoints save every
  persistent buffer whole under its global name and load it into any layout
  (:func:`~lightning_sp.checkpoint.shards.buffer_shards`); no method is needed.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_sp.model.config import GPTConfig
from lightning_sp.model.gpt import GPT
from lightning_sp.parallel.state import ParallelState


@runtime_checkable
class AuxiliaryLosses(Protocol):
    """A module whose forward adds auxiliary losses to the objective's gradient."""

    def set_auxiliary_loss_scale(self, scale: float) -> None:
        """Multiply the auxiliary losses' gradient by ``scale`` from the next forward on."""

    def adds_auxiliary_losses(self) -> bool:
        """Whether its settings add any auxiliary loss to the gradient (a coefficient > 0)."""


@runtime_checkable
class AfterOptimizerStep(Protocol):
    """A module with state updated after each optimizer step."""

    def after_optimizer_step(self) -> None:
        """Update the state from what the forwards since the last call counted. Collective:
        every rank holding the module calls it (a no-op where the module's settings have no
        such state)."""

    def stepped_state(self) -> list[Tensor]:
        """The tensors :meth:`after_optimizer_step` moves (none where its settings move
        nothing): the non-finite guard checks them at the next step, before its update."""


@runtime_checkable
class CountsStepTotals(Protocol):
    """A module that sums, over a step's training forwards, what the step's metrics are made
    of (:class:`~lightning_sp.model.parts.base.StepTotals` of the part that built it)."""

    def take_step_totals(self) -> Tensor | None:
        """The sums since the last call (``[width]`` float64, this rank's share), reset to
        zero; ``None`` if no training forward ran."""


def _modules(module: nn.Module, kind: type) -> list[nn.Module]:
    return [m for m in module.modules() if isinstance(m, kind)]


def has_auxiliary_losses(module: nn.Module) -> bool:
    """Whether ``module`` holds a module whose auxiliary losses can join the loss's gradient
    (whatever their coefficients)."""
    return bool(_modules(module, AuxiliaryLosses))


def auxiliary_losses_on(module: nn.Module) -> bool:
    """Whether some module of ``module`` adds auxiliary losses to this run's gradient (its
    settings give them a coefficient > 0)."""
    return any(m.adds_auxiliary_losses() for m in _modules(module, AuxiliaryLosses))  # type: ignore[operator]


def scale_auxiliary_losses(module: nn.Module, scale: float) -> None:
    """Scale every auxiliary loss of ``module`` by ``scale``: the factor the main loss of one
    micro-batch carries (``1 / micro-batches per step``), so that the auxiliary losses enter
    the step's gradient as the mean over its micro-batches, as the loss does."""
    for m in _modules(module, AuxiliaryLosses):
        m.set_auxiliary_loss_scale(scale)  # type: ignore[operator]


def stepped_modules(module: nn.Module) -> list[nn.Module]:
    """The modules of ``module`` with state moved per step (:class:`AfterOptimizerStep`): a
    walk of every module with a protocol check each (~0.1 ms per layer on a CPU host), so
    found once and handed to :func:`after_optimizer_step` at every step."""
    return _modules(module, AfterOptimizerStep)


def after_optimizer_step(module: nn.Module, stepped: list[nn.Module] | None = None) -> None:
    """After an optimizer step: every module of ``module`` with state moved per step updates
    it (``stepped``: those modules, from :func:`stepped_modules`). Collective: every rank of
    the stage calls it."""
    for m in stepped if stepped is not None else stepped_modules(module):
        m.after_optimizer_step()  # type: ignore[operator]


def stepped_state(stepped: list[nn.Module]) -> list[Tensor]:
    """The tensors the modules ``stepped`` (from :func:`stepped_modules`) move after each
    optimizer step."""
    return [t for m in stepped for t in m.stepped_state()]  # type: ignore[operator]


def step_metrics(module: nn.Module, state: ParallelState, config: GPTConfig) -> dict[str, Tensor]:
    """The step's metrics of ``module`` (this rank's chunks of the model of ``config``) over
    every micro-batch, replica and stage, and every layer's sums reset: each part that counts
    (:meth:`~lightning_sp.model.parts.base.Part.step_totals`) gets a ``[num_layers, width]``
    table of its modules' sums at their global layer numbers, summed over the data- and
    pipeline-parallel groups, and makes its metrics of it. Collective over those groups:
    every rank calls it. Empty (no collective) when no part counts."""
    counted = [
        (sub.name, totals)
        for sub in config.block().sublayers
        if (totals := sub.mixer.step_totals()) is not None
    ]
    if not counted:
        return {}
    starts, width = {}, 0
    for name, totals in counted:
        starts[name], width = width, width + totals.width
    table = torch.zeros(config.num_layers, width, dtype=torch.float64, device=state.device)
    for chunk in (m for m in module.modules() if isinstance(m, GPT)):
        for number, layer in zip(chunk.layer_range, chunk.layers, strict=True):  # global numbers
            for name, totals in counted:
                sums = getattr(layer, name).take_step_totals()
                if sums is not None:
                    columns = slice(starts[name], starts[name] + totals.width)
                    table[number, columns] += sums.to(table.device)
    for group in (state.dp_group, state.pp_group):
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(table, group=group)
    metrics: dict[str, Tensor] = {}
    for name, totals in counted:
        metrics.update(totals.metrics(table[:, starts[name] : starts[name] + totals.width]))
    return metrics
