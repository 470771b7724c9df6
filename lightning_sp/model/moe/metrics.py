"""The MoE routing metrics of a training step, global: every micro-batch of the step on every
data-parallel replica (and so every expert-parallel rank, folded into data x context), every
layer on every pipeline stage.

Each :class:`~lightning_sp.model.moe.layer.MoE` layer adds, per training forward, its micro-batch's
load-balancing loss, z-loss, dropped assignments, one forward and its choices per expert (all
already summed over the micro-batch's sequence- and context-parallel shards: the router's) into
:attr:`~lightning_sp.model.moe.layer.MoE.totals`. The generic
:func:`~lightning_sp.model.hooks.step_metrics` places each layer's at its global number, sums
them over the data-parallel and the pipeline group, and only then :func:`routing_metrics`
takes the ratios (the part declares both: :meth:`~lightning_sp.model.moe.part.MoEFeedForward.
step_totals`), so the values equal one process's over the same micro-batches:

* ``moe/aux_loss``, ``moe/z_loss``: the mean over the step's micro-batches of each one's loss
  (what the objective holds, before its coefficient), then over layers;
* ``moe/load_imbalance``: the largest over the mean of the choices per expert, counted over
  the whole global batch, then the mean over layers;
* ``moe/dropped_fraction``: assignments dropped by the capacity over all assignments.

A layer adds to its sums once per micro-batch, also under full recompute (the replay in
backward adds nothing: :func:`~lightning_sp.model.recompute.replaying`).
"""

from __future__ import annotations

from torch import Tensor

from lightning_sp.model.moe.layer import TOTALS

FORWARDS = TOTALS.index("forwards")


def routing_metrics(table: Tensor) -> dict[str, Tensor]:
    """The step's global routing metrics (module docstring) of ``table``, ``[num_layers,
    len(TOTALS) + E]``: each layer's :attr:`~lightning_sp.model.moe.layer.MoE.totals` at its
    global number, summed over the data-parallel replicas and the pipeline stages (by
    :func:`~lightning_sp.model.hooks.step_metrics`; rows of layers without MoE are zero)."""
    table = table[table[:, FORWARDS] > 0]  # the MoE layers
    forwards = table[:, FORWARDS]
    counts = table[:, len(TOTALS) :]  # [layers, E]
    return {
        "moe/aux_loss": (table[:, 0] / forwards).mean(),
        "moe/z_loss": (table[:, 1] / forwards).mean(),
        "moe/load_imbalance": (counts.max(1).values / counts.mean(1)).mean(),
        "moe/dropped_fraction": table[:, 2].sum() / counts.sum(),
    }
