"""Predicted against measured step time on the device at hand (``lightning-sp step-check``,
:mod:`lightning_sp.cli.step_check`).

For a one-device layout (t = p = d = 1, one micro-batch of ``--micro_batch_size``) of
``--config``'s model (``--smoke``: the calibration's tiny one), for each recompute policy:

* **predicted**: the step-time model's forward + backward (recompute included) of that layout,
  :func:`lightning_sp.planner.steptime.step_time`'s ``pipeline`` part, on ``--cluster`` (a
  preset, or the YAML ``lightning-sp calibrate`` wrote on this device, whose measured
  kernels the model then uses);
* **measured**: forward + backward of our ``GPT`` on ``--device`` (bf16 on a GPU, fp32 on a CPU
  as the calibration measures it), median seconds (:func:`lightning_sp.planner.calibrate.time_it`);

and their ratio, measured / predicted: the model's error on this card for this config. It is a
benchmark: nothing is asserted about the ratio. On a CPU it checks the plumbing only (the
model's memory-bound terms assume 2-byte activations; the CPU runs fp32). ``--out`` writes the
rows as JSON.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from lightning_sp.model.config import RECOMPUTE_POLICIES, GPTConfig
from lightning_sp.model.gpt import GPT
from lightning_sp.model.recompute import RecomputePolicy
from lightning_sp.parallel.init import materialize
from lightning_sp.parallel.state import ParallelState
from lightning_sp.planner.calibrate import dtype_for, time_it
from lightning_sp.planner.cluster import Cluster
from lightning_sp.planner.layout import Layout
from lightning_sp.planner.steptime import step_time


def predicted_seconds(config: GPTConfig, micro_batch: int, cluster: Cluster) -> float:
    """Forward + backward of one micro-batch on one device, by the step-time model."""
    layout = Layout(config=config, micro_batch_size=micro_batch)
    return step_time(layout, cluster).parts["pipeline"]


def build_model(config: GPTConfig, device: torch.device, like: GPT | None = None) -> GPT:
    """Our ``GPT`` of ``config`` on ``device`` (:func:`dtype_for`), in training mode. The first
    is drawn from ``config.seed`` (on the CPU, row by row: 17.6 s for the 1.2B config on an
    H200's host); with ``like``, the model is built on ``meta``, materialised on ``device`` and
    given ``like``'s weights and buffers by device copies: a policy after the first costs no
    draw."""
    state = ParallelState.single(device)
    if like is None:
        model = GPT(config, state, dtype=dtype_for(device), device=device)
    else:
        model = GPT(config, state, dtype=dtype_for(device), device="meta")
        materialize(model, device)
        sources = dict(like.named_parameters()) | dict(like.named_buffers())
        with torch.no_grad():  # buffers too: a non-persistent one is not in a state_dict
            for name, tensor in (*model.named_parameters(), *model.named_buffers()):
                tensor.copy_(sources[name])
    return model.train()


def measured_seconds(model: GPT, micro_batch: int, seconds: float) -> float:
    """Median seconds of forward + backward of ``model`` on its device, over a seeded batch."""
    config, device = model.config, model.output_weight.device
    torch.manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (micro_batch, config.seq_length + 1))
    ids, labels = tokens[:, :-1].to(device), tokens[:, 1:].to(device)

    def step() -> None:
        model(ids, labels).backward()
        model.zero_grad(set_to_none=True)

    return time_it(step, device, seconds)


def check(
    config: GPTConfig, micro_batch: int, cluster: Cluster, device: torch.device, seconds: float
) -> list[dict[str, Any]]:
    """One row per recompute policy: predicted, measured, measured / predicted."""
    rows, first = [], None
    for policy in RECOMPUTE_POLICIES:
        policy_config = dataclasses.replace(
            config, recompute=RecomputePolicy.parse(policy), sequence_parallel=False
        )
        predicted = predicted_seconds(policy_config, micro_batch, cluster)
        model = build_model(policy_config, device, like=first)
        measured = measured_seconds(model, micro_batch, seconds)
        first = model if first is None else first
        del model
        rows.append(
            {
                "recompute": policy,
                "predicted_seconds": predicted,
                "measured_seconds": measured,
                "ratio": measured / predicted,
            }
        )
    return rows
