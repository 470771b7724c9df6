"""The MoE routing metrics of a training step, global: every micro-batch of the step on every
data-parallel replica (and so every expert-parallel rank, folded into data x context), every
layer on every pipeline stage.

Each :class:`~lightning_sp.model.moe.layer.MoE` layer adds, per training forward, its micro-batch's
load-balancing loss, z-loss, dropped assignments, one forward and its choices per expert (all
already summed over the micro-batch's sequence- and context-parallel shards: the router's) into
:attr:`~lightning_sp.model.moe.layer.MoE.totals`. :func:`step_metrics` sums those over the
data-parallel group, places each layer at its global number, sums over the pipeline group,
and only then takes the ratios, so the values equal one process's over the same micro-batches:

* ``moe/aux_loss``, ``moe/z_loss``: the mean over the step's micro-batches of each one's loss
  (what the objective holds, before its coefficient), then over layers;
* ``moe/load_imbalance``: the largest over the mean of the choices per expert, counted over
  the whole global batch, then the mean over layers;
* ``moe/dropped_fraction``: assignments dropped by the capacity over all assignments.

A layer adds to its sums once per micro-batch, also under full recompute (the replay in
backward adds nothing: :func:`~lightning_sp.model.recompute.replaying`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_sp.model.config import GPTConfig
from lightning_sp.model.gpt import GPT
from lightning_sp.model.moe.layer import TOTALS, MoE
from lightning_sp.parallel.state import ParallelState


def _layers(module: nn.Module) -> list[tuple[int, Tensor]]:
    """``(global layer number, totals)`` of the MoE layers of ``module``'s GPT chunks."""
    found = []
    for chunk in (m for m in module.modules() if isinstance(m, GPT)):
        for name, m in chunk.named_modules():
            if isinstance(m, MoE) and m.totals is not None:  # name: layers.<i>.…
                found.append((int(chunk.global_name(name).split(".")[1]), m.totals))
    return found


def step_metrics(module: nn.Module, state: ParallelState, config: GPTConfig) -> dict[str, Tensor]:
    """The step's global routing metrics (module docstring) of ``module``, this rank's chunks
    of the model of ``config``, and every layer's totals reset. Collective over the data- and
    pipeline-parallel groups: every rank calls it. Empty without MoE layers."""
    if config.moe is None:
        return {}
    width = len(TOTALS) + config.moe.num_experts
    table = torch.zeros(config.num_layers, width, dtype=torch.float64, device=state.device)
    for number, totals in _layers(module):
        table[number] += totals.to(table.device)
        totals.zero_()
    for group in (state.dp_group, state.pp_group):
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(table, group=group)
    table = table[table[:, TOTALS.index("forwards")] > 0]  # the MoE layers
    forwards = table[:, TOTALS.index("forwards")]
    counts = table[:, len(TOTALS) :]  # [layers, E]
    return {
        "moe/aux_loss": (table[:, 0] / forwards).mean(),
        "moe/z_loss": (table[:, 1] / forwards).mean(),
        "moe/load_imbalance": (counts.max(1).values / counts.mean(1)).mean(),
        "moe/dropped_fraction": table[:, 2].sum() / counts.sum(),
    }
