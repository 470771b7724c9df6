"""An MoE reference whose auxiliary losses do not go through the mechanism under test.

The model's own auxiliary losses ride on the layer output's backward (``_AttachLoss``, scaled by
the ``AuxiliaryLosses`` hook): a reference built the same way would share any scaling bug. Here
the reference model runs with both coefficients 0 (nothing attached), and :class:`RouterLosses`
recomputes each layer's losses from its router's input and weight, with their graph, as
transformers computes the load-balancing loss (``load_balancing_loss_func`` on the layer's
router logits) and as ST-MoE states the z-loss (the mean of ``logsumexp(logits)²``); the test
adds them to its objective with the weights it states by hand.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from lightning_sp import GPT
from lightning_sp.model.config import GPTConfig
from lightning_sp.model.moe.layer import MoE

from models import reference_model

transformers = __import__("pytest").importorskip("transformers")
_load_balancing = transformers.models.mixtral.modeling_mixtral.load_balancing_loss_func


def without_auxiliary_losses(config: GPTConfig) -> GPTConfig:
    """``config`` with the load-balancing and z coefficients 0 (the same weights)."""
    assert config.moe is not None
    moe = dataclasses.replace(config.moe, aux_loss_coef=0.0, z_loss_coef=0.0)
    return dataclasses.replace(config, moe=moe)


class RouterLosses:
    """Forward hooks on every router of ``model``: :meth:`take` returns ``Σ_layers (aux_coef ·
    aux + z_coef · z)`` of the forwards since the last call, each computed over every token
    its router saw (masked labels or not), with graph."""

    def __init__(self, model: GPT, config: GPTConfig) -> None:
        assert config.moe is not None and config.moe.router_dtype == "fp64"
        self.moe = config.moe
        self.terms: list[Tensor] = []
        for module in model.modules():
            if isinstance(module, MoE):
                module.router.register_forward_hook(self._hook)

    def _hook(self, router: torch.nn.Module, args: tuple, output: object) -> None:
        tokens = args[0]  # [T, h]
        logits = torch.nn.functional.linear(tokens, router.weight).double()  # [T, E]
        moe = self.moe
        aux = _load_balancing((logits,), moe.num_experts, moe.top_k)
        z = torch.logsumexp(logits, dim=-1).square().mean()
        self.terms.append(moe.aux_loss_coef * aux + moe.z_loss_coef * z)

    def take(self) -> Tensor:
        total = torch.stack(self.terms).sum()
        self.terms = []
        return total


def reference_with_router_losses(config: GPTConfig) -> tuple[GPT, RouterLosses]:
    """The float64 one-process model of ``config`` without attached losses, and its hooks."""
    model = reference_model(without_auxiliary_losses(config))
    return model, RouterLosses(model, config)
