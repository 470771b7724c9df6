"""The generic module hooks (``lightning_sp.model.hooks``): the walkers find every module of a
model that implements a hook, and only those, and call it; a model without such modules gives
nothing (no metrics, no collective). The MoE layer is the part that implements them today; the
values its hooks produce are checked against one process in ``test_moe_state.py``,
``test_moe_pipeline.py`` and ``test_moe_trainer.py``."""

from __future__ import annotations

import torch
from torch import nn

from lightning_sp import GPT, ParallelState
from lightning_sp.model.hooks import (
    AfterOptimizerStep,
    AuxiliaryLosses,
    CountsStepTotals,
    after_optimizer_step,
    has_auxiliary_losses,
    scale_auxiliary_losses,
    step_metrics,
)
from lightning_sp.model.moe.config import MoEConfig
from lightning_sp.model.moe.layer import MoE

from models import batch, loss_and_grads, tiny_config

MOE = MoEConfig(num_experts=4, top_k=2, expert_ffn_size=24, score="sigmoid", expert_bias=True,
                bias_update_rate=0.25)  # fmt: skip


def _model(moe: MoEConfig | None = MOE) -> GPT:
    config = tiny_config("llama", **({"feed_forward": "moe", "moe": moe} if moe else {}))
    return GPT(config, ParallelState.single(), dtype=torch.float64)


def _layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def test_the_moe_layer_implements_the_hooks_and_a_dense_model_none() -> None:
    moe, dense = _model(), _model(None)
    hooks = (AuxiliaryLosses, AfterOptimizerStep, CountsStepTotals)
    assert all(isinstance(m, h) for m in _layers(moe) for h in hooks), "MoE lacks a hook"
    hooked = [type(m).__name__ for m in dense.modules() if isinstance(m, hooks)]
    assert hooked == [], f"a dense model's modules claim hooks: {hooked}"
    assert has_auxiliary_losses(moe) and not has_auxiliary_losses(dense)
    assert step_metrics(dense, dense.state, dense.config) == {}, "a dense model has metrics"


def test_the_walkers_reach_every_layer() -> None:
    """The scale reaches every MoE layer; the step's sums are taken once (then zero); the
    after-step hook moves every router bias from the counts, and only with ``expert_bias``."""
    model = _model()
    scale_auxiliary_losses(model, 0.25)
    assert [m.aux_loss_scale for m in _layers(model)] == [0.25, 0.25]
    loss_and_grads(model, *batch(model.config))
    metrics = step_metrics(model, model.state, model.config)
    assert sorted(metrics) == [
        "moe/aux_loss", "moe/dropped_fraction", "moe/load_imbalance", "moe/z_loss",
    ]  # fmt: skip
    assert all(float(m.totals.abs().sum()) == 0 for m in _layers(model))  # type: ignore[union-attr]
    after_optimizer_step(model)
    biases = [m.router.expert_bias for m in _layers(model)]
    assert all(b is not None and float(b.abs().max()) == MOE.bias_update_rate for b in biases)

    plain = _model(MoEConfig(num_experts=4, top_k=2, expert_ffn_size=24))
    loss_and_grads(plain, *batch(plain.config))
    after_optimizer_step(plain)  # no expert_bias: nothing to move, no error
    assert all(m.router.expert_bias is None for m in _layers(plain))
