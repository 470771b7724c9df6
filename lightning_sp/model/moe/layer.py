"""The mixture-of-experts feed-forward layer: router, token dispatch over the expert-parallel
group, grouped SwiGLU experts, combine, optional shared experts.

``[s/t or s, b, h]`` in and out (the residual stream's layout; sequence parallelism is required
for ``t > 1``, :meth:`~lightning_sp.model.moe.config.MoEConfig.check_layout`). Each rank routes
its own ``T = s_local·b`` tokens; the load-balancing terms are the micro-batch's
(:mod:`lightning_sp.model.moe.router`).

Under expert tensor parallelism (``t_e = t``, each expert's ``f_e`` split over the TP group)
the order is Megatron-Core's, dispatch first: every rank routes its own sequence shard as at
``t_e = 1`` (the load-balancing terms count each token once, summed over the TP group),
dispatches its rows over EP, then the TP group all-gathers the rows its ranks received
(:func:`~lightning_sp.parallel.expert_rows.gather_rows`, uneven counts), each TP rank runs its
``f_e/t`` slice of the local experts on all of them, and the partial sums are reduce-scattered
back to the rows' TP rank (:func:`~lightning_sp.parallel.expert_rows.scatter_rows`) before the
combine returns them over EP. With ``t_e = 1`` both exchanges are the identity: one code path.
The shared experts are a TP MLP on the layer's sequence shard either way.

The load-balancing terms enter the training loss without changing any signature:
:func:`attach_loss` adds their gradient to the layer output's backward (Megatron's
``MoEAuxLossAutoScaler``), so a pipeline stage carries them with the activations; their
detached values are kept for logging in :attr:`MoE.metrics`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from lightning_sp.model.fused import act_row_linear, activate, fused_column_linear
from lightning_sp.model.moe.config import MoEConfig
from lightning_sp.model.moe.experts import SWIGLU, Experts
from lightning_sp.model.moe.router import Router
from lightning_sp.model.parts.build import BuildContext
from lightning_sp.model.recompute import replaying
from lightning_sp.model.spec import NormModule
from lightning_sp.parallel.dispatch import combine, dispatch
from lightning_sp.parallel.expert_rows import gather_rows, plan_rows, scatter_rows
from lightning_sp.parallel.init import initialize_parameter
from lightning_sp.parallel.layers import ColumnParallelLinear, RowParallelLinear

TOTALS = ("aux_loss", "z_loss", "dropped", "forwards")
"""The first entries of :attr:`MoE.totals`; the choices per expert ``[E]`` follow."""


def _totals(aux_loss: Tensor, z_loss: Tensor, dropped: int, counts: Tensor) -> Tensor:
    """One forward's contribution to :attr:`MoE.totals` (float64 on the counts' device; no
    device sync)."""
    head = torch.stack([aux_loss.detach().double(), z_loss.detach().double()])
    extra = torch.tensor([float(dropped), 1.0], dtype=torch.float64, device=counts.device)
    return torch.cat([head, extra, counts.detach().double()])


class _AttachLoss(torch.autograd.Function):
    """Forward: ``out`` unchanged. Backward: ``out``'s gradient, and ``scale`` for ``loss``
    (as if ``scale · loss`` had been added to the objective)."""

    @staticmethod
    def forward(ctx: Any, out: Tensor, loss: Tensor, scale: float) -> Tensor:
        ctx.scale, ctx.like = scale, loss
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        return grad, torch.full_like(ctx.like, ctx.scale), None


def attach_loss(out: Tensor, loss: Tensor, scale: float = 1.0) -> Tensor:
    """``out``, whose backward also back-propagates ``scale · loss`` (a scalar)."""
    if not loss.requires_grad or not torch.is_grad_enabled():
        return out
    return _AttachLoss.apply(out, loss, scale)


class SharedExperts(nn.Module):
    """The shared experts as one SwiGLU MLP of width ``f_s``, tensor parallel like the dense
    MLP (``gate``/``up`` column parallel, ``fc2`` row parallel)."""

    def __init__(self, ctx: BuildContext, ffn_size: int) -> None:
        super().__init__()
        c, sp = ctx.config, ctx.sequence_parallel
        for name in SWIGLU.inputs:
            self.add_module(name, ColumnParallelLinear(
                c.hidden_size, ffn_size, ctx.state, sequence_parallel=sp, bias=False,
                init_std=c.init_std, **ctx.kwargs,
            ))  # fmt: skip
        self.fc2 = RowParallelLinear(
            ffn_size, c.hidden_size, ctx.state, sequence_parallel=sp, bias=False,
            init_std=c.output_init_std, **ctx.kwargs,
        )  # fmt: skip

    def forward(self, x: Tensor, recompute_act: bool = False) -> Tensor:
        z = fused_column_linear(x, [getattr(self, n) for n in SWIGLU.inputs])  # [s, b, 2f_s/t]
        if recompute_act:  # fc2 saves z and replays SwiGLU in its backward
            return act_row_linear(z, self.fc2, SWIGLU)
        return self.fc2(activate(z, SWIGLU))  # [s/t or s, b, h]


class MoE(nn.Module):
    """One rank's share of an MoE layer: the router (replicated), ``E/e`` experts (this EP
    rank's block), the shared experts' TP shard. ``aux_loss_scale`` multiplies the
    load-balancing terms' gradient (set it to the main loss's scale, e.g. ``1 / micro-batches``
    under gradient accumulation).

    It implements the generic module hooks (:mod:`lightning_sp.model.hooks`) the training
    loop and the pipeline call: the auxiliary losses' scale, the router bias update after each
    optimizer step, the step's routing sums; the router's ``expert_bias`` is a persistent
    buffer, which checkpoints save."""

    def __init__(self, ctx: BuildContext, config: MoEConfig) -> None:
        """Built from ``ctx`` whole (the layer's sizes, initialisation, layout and ``mlp_act``
        recompute module) with the part's ``config``."""
        super().__init__()
        state, sequence_parallel = ctx.state, ctx.sequence_parallel
        t_e = state.expert_tensor_parallel_size
        self.recompute_act = ctx.recomputes("mlp_act")
        """The ``mlp_act`` recompute module: the experts' and shared experts' down projections
        save SwiGLU's input and replay it in backward."""
        self.config = config
        self.expert_tp_group = state.tp_group if t_e > 1 else None
        """The TP group that shares each expert's ``f_e`` under expert tensor parallelism, over
        which the dispatched rows are gathered and scattered, else ``None``."""
        self.group = state.micro_batch_group(sequence_parallel)
        self.ep_group = state.ep_group
        self.reduce_groups = (state.tp_group if sequence_parallel else None, state.gradient_group)
        self.router = Router(ctx, config)
        self.experts = Experts(ctx, config)
        self.shared: SharedExperts | None = None
        if config.num_shared_experts:
            self.shared = SharedExperts(ctx, config.shared_ffn_size)
        self.aux_loss_scale = 1.0
        self.metrics: dict[str, Tensor] = {}
        """The last forward's micro-batch values: ``aux_loss``, ``z_loss`` (unscaled),
        ``load_imbalance`` (max over mean choices per expert) and ``dropped``."""
        self.totals: Tensor | None = None
        """The sums of the training forwards since the last :meth:`take_step_totals`
        (:data:`TOTALS`, then the choices
        per expert ``[E]``; float64; a full-recompute replay adds nothing): what the step's
        logged metrics are made of."""

    def reset_parameters(self, seed: int, prefix: str = "") -> None:
        """Initialise every parameter from ``seed`` as a model would (names ``prefix`` +
        the parameter's name in this module)."""
        for name, param in self.named_parameters():
            initialize_parameter(param, prefix + name, seed)

    def forward(self, x: Tensor, norm: NormModule | None = None) -> Tensor:
        """``x``: the normalised input, or with ``norm`` the layer input, normalised here (the
        ``layernorm`` recompute module drops no MoE term: ``moe_input`` is stored either way).
        ``[s/t or s, b, h]`` in and out."""
        if norm is not None:
            x = norm(x)
        s, b, h = x.shape  # [s/(c·t) or s/c, b, h]: this rank's sequence shard
        tokens = x.reshape(s * b, h)  # [T, h]
        routed = self.router(tokens, self.group)
        cfg = self.config
        balanced = (
            cfg.force_balanced and routed.keep is None and not s * b * cfg.top_k % cfg.num_experts
        )
        rows, routing = dispatch(
            tokens, routed.experts, routed.keep, cfg.num_experts, self.ep_group, balanced
        )  # [N_local, h], expert-major
        plan = plan_rows(routing.counts, self.expert_tp_group, balanced, rows.device)
        rows = gather_rows(rows, plan)  # expert TP: [Σ_TP N_local, h], expert-major
        y = self.experts(rows, plan.counts, self.recompute_act)  # partial sums under expert TP
        y = scatter_rows(y, plan)  # expert TP: summed over the TP group -> [N_local, h]
        out = combine(y, routed.weights, routing, self.ep_group).view(s, b, h)
        if self.shared is not None:
            out = out + self.shared(x, self.recompute_act)
        self.metrics = {  # detached tensors: no device sync here
            "aux_loss": routed.aux_loss.detach(),
            "z_loss": routed.z_loss.detach(),
            "load_imbalance": routed.counts.max() / routed.counts.mean(),
            "dropped": torch.tensor(routed.dropped),
        }
        if self.training and not replaying():  # once per micro-batch under full recompute
            added = _totals(routed.aux_loss, routed.z_loss, routed.dropped, routed.counts)
            self.totals = added if self.totals is None else self.totals + added
        loss = cfg.aux_loss_coef * routed.aux_loss + cfg.z_loss_coef * routed.z_loss
        if cfg.aux_loss_coef or cfg.z_loss_coef:
            out = attach_loss(out, loss, self.aux_loss_scale)
        return out

    # -- the generic module hooks (lightning_sp.model.hooks) ---------------------------------

    def set_auxiliary_loss_scale(self, scale: float) -> None:
        """Set :attr:`aux_loss_scale` (the hook :class:`~lightning_sp.model.hooks.
        AuxiliaryLosses`): the load-balancing and z losses' gradient factor."""
        self.aux_loss_scale = scale

    def adds_auxiliary_losses(self) -> bool:
        """Whether the load-balancing or z loss has a coefficient > 0 (the hook
        :class:`~lightning_sp.model.hooks.AuxiliaryLosses`)."""
        return self.config.adds_auxiliary_losses

    def after_optimizer_step(self) -> None:
        """The auxiliary-loss-free bias update with ``expert_bias`` (:meth:`update_expert_bias`;
        the hook :class:`~lightning_sp.model.hooks.AfterOptimizerStep`), else nothing."""
        if self.config.expert_bias:
            self.update_expert_bias()

    def stepped_state(self) -> list[Tensor]:
        """The router's expert biases where ``expert_bias`` moves them (the hook
        :class:`~lightning_sp.model.hooks.AfterOptimizerStep`), else none."""
        bias = self.router.expert_bias
        return [bias] if bias is not None else []

    def take_step_totals(self) -> Tensor | None:
        """:attr:`totals`, then reset to zero (the hook :class:`~lightning_sp.model.hooks.
        CountsStepTotals`; the part declares their width and metrics:
        :func:`~lightning_sp.model.moe.metrics.routing_metrics`)."""
        if self.totals is None:
            return None
        totals = self.totals.clone()
        self.totals.zero_()
        return totals

    def update_expert_bias(self) -> None:
        """After an optimizer step: DeepSeek-V3's bias update from the loads every rank of
        this layer counted (summed over the TP group under SP, then data x context)."""
        self.router.update_expert_bias(self.reduce_groups)
