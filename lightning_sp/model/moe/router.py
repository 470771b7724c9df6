"""The MoE router: ``h -> E`` logits in the router dtype, softmax or sigmoid scores, the top-k
choice (optionally biased, DeepSeek-V3), the combine weights, capacity dropping, and the
load-balancing terms, all computed over the whole micro-batch.

A rank may hold only a shard of a micro-batch's tokens (its sequence shard under sequence
parallelism, its chunks under context parallelism). Every quantity that depends on the whole
micro-batch (token counts per expert, mean probabilities, the z-loss mean, the capacity choice)
is summed or gathered over ``group``, the ranks holding the other shards
(:meth:`~lightning_sp.parallel.state.ParallelState.micro_batch_group`): the losses equal one
process's on the same micro-batch, on every rank of the group. Their backward gives each rank
the gradient of its own tokens' share (the sums are :func:`~lightning_sp.parallel.comm.f_bar`:
all-reduce forward, identity backward), so the router's weight gradient is a partial sum over
the group's TP ranks (marked ``sequence_parallel``) and CP ranks, as every other weight's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_sp.model.moe.config import MoEConfig
from lightning_sp.model.parts.build import BuildContext
from lightning_sp.model.recompute import replaying
from lightning_sp.parallel.comm import Group, all_gather_sequence, f_bar, group_rank, group_size
from lightning_sp.parallel.dispatch import expert_counts
from lightning_sp.parallel.init import mark_parameter


@dataclass
class Routed:
    """What the router decided for ``T`` local tokens."""

    experts: Tensor
    """``[T, k]`` int64: the chosen experts (global indices)."""
    weights: Tensor
    """``[T, k]`` router dtype: each choice's combine weight."""
    keep: Tensor | None
    """``[T, k]`` bool: the choices within capacity (``None``: dropless, all kept)."""
    counts: Tensor
    """``[E]``: choices per expert over the whole micro-batch, before dropping (no grad)."""
    aux_loss: Tensor
    """The unscaled load-balancing loss of the micro-batch (a scalar)."""
    z_loss: Tensor
    """The unscaled router z-loss of the micro-batch (a scalar)."""
    dropped: int
    """Choices of the micro-batch dropped by the capacity (0 dropless)."""


class Router(nn.Module):
    """``weight [E, h]`` (replicated; ``sequence_parallel`` marks its gradient a partial sum
    over the TP group) and, with ``config.expert_bias``, the buffers ``expert_bias [E]`` (fp32,
    replicated on every rank holding the layer; persistent: checkpoints save it) and
    ``tokens_per_expert [E]`` (fp32; this rank's choices per expert counted since the last bias
    update, once per token: not in a full-recompute replay; reset every step, not saved).

    Both buffers stay fp32 whatever dtype the module is cast to (:meth:`_apply`): a bias
    moved by ``bias_update_rate`` (1e-3) per step would round away in bf16, and bf16 counts
    are exact only up to 256."""

    FP32_BUFFERS = ("expert_bias", "tokens_per_expert")
    """The buffers a dtype conversion of the module (``.to(dtype)``, ``.half()``, Lightning's
    precision plugin) leaves in fp32."""

    expert_bias: Tensor | None
    tokens_per_expert: Tensor | None

    def __init__(self, ctx: BuildContext, config: MoEConfig) -> None:
        """The router of ``config``'s experts over ``ctx``'s hidden size, initialised as its
        config says, replicated (its gradient reduced over the TP group under SP)."""
        super().__init__()
        self.config = config
        device = ctx.kwargs.get("device")
        self.weight = nn.Parameter(
            torch.empty(config.num_experts, ctx.config.hidden_size, **ctx.kwargs)
        )
        mark_parameter(
            self.weight, std=ctx.config.init_std, sequence_parallel=ctx.sequence_parallel
        )
        for name in self.FP32_BUFFERS:
            zeros = torch.zeros(config.num_experts, dtype=torch.float32, device=device)
            persistent = name == "expert_bias"
            self.register_buffer(name, zeros if config.expert_bias else None, persistent)

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> Router:
        """``nn.Module._apply`` (every ``.to``, ``.cuda``, ``.half``, ``to_empty`` goes
        through it), except that a buffer of :data:`FP32_BUFFERS` that ``fn`` would give
        another dtype keeps its fp32 tensor, only moved to ``fn``'s device: its value never
        passes through the lower precision (recasting afterwards would keep the rounding)."""
        kept = {name: self._buffers.get(name) for name in self.FP32_BUFFERS}
        super()._apply(fn, recurse)
        for name, old in kept.items():
            new = self._buffers.get(name)
            if old is not None and new is not None and new.dtype != torch.float32:
                self._buffers[name] = old.to(device=new.device)
        return self

    def forward(self, x: Tensor, group: Group) -> Routed:
        """Route ``x`` ``[T, h]`` (this rank's tokens of a micro-batch sharded over ``group``)."""
        cfg = self.config
        logits = nn.functional.linear(x, self.weight).to(cfg.logits_dtype(x.dtype))  # [T, E]
        softmax = cfg.score == "softmax"
        scores = torch.softmax(logits, dim=-1) if softmax else torch.sigmoid(logits)  # [T, E]
        choice = scores.detach()
        if self.expert_bias is not None:
            choice = choice + self.expert_bias.to(choice.dtype)
        experts = torch.topk(choice, cfg.top_k, dim=-1).indices  # [T, k]
        if cfg.force_balanced:  # token i -> experts (i·k + j) mod E
            slots = torch.arange(x.shape[0] * cfg.top_k, device=x.device)
            experts = slots.remainder(cfg.num_experts).view(x.shape[0], cfg.top_k)
        weights = scores.gather(1, experts)
        if cfg.normalize_top_k:  # softmax or sigmoid alike (transformers' norm_topk_prob)
            weights = weights / weights.sum(dim=-1, keepdim=True)
        local_counts = expert_counts(experts, cfg.num_experts)
        if self.tokens_per_expert is not None and self.training and not replaying():
            self.tokens_per_expert.add_(local_counts.to(self.tokens_per_expert.dtype))
        counts = local_counts.to(logits.dtype)
        if group_size(group) > 1:
            dist.all_reduce(counts, group=group)
        tokens = x.shape[0] * group_size(group)  # the micro-batch's T
        keep, dropped = None, 0
        if cfg.capacity_factor is not None:
            keep, dropped = self._capacity(experts, weights.detach(), tokens, group)
        grad = torch.is_grad_enabled()
        with torch.set_grad_enabled(grad and cfg.aux_loss_coef > 0):  # else: for logging only
            aux = self._aux_loss(scores, counts, tokens, group)
        with torch.set_grad_enabled(grad and cfg.z_loss_coef > 0):
            z = f_bar(torch.logsumexp(logits, dim=-1).square().sum(), group) / tokens
        return Routed(experts, weights, keep, counts, aux, z, dropped)

    def _aux_loss(self, scores: Tensor, counts: Tensor, tokens: int, group: Group) -> Tensor:
        """``E / T² · Σ_i counts_i · Σ_tokens p_i`` (transformers' one-layer
        ``load_balancing_loss_func``); sigmoid scores are normalised per token first."""
        if self.config.score == "sigmoid":
            scores = scores / scores.sum(dim=-1, keepdim=True)
        probability_sums = f_bar(scores.sum(dim=0), group)  # [E]
        return self.config.num_experts * (counts * probability_sums).sum() / tokens**2

    def _capacity(
        self, experts: Tensor, weights: Tensor, tokens: int, group: Group
    ) -> tuple[Tensor, int]:
        """Each expert keeps its ``ceil(cf·T·k/E)`` choices of highest weight over the whole
        micro-batch (gathered over ``group``; ties go to the earlier gathered row). Returns the
        local ``[T, k]`` keep mask and the micro-batch's dropped count."""
        cfg = self.config
        capacity = math.ceil(cfg.capacity_factor * tokens * cfg.top_k / cfg.num_experts)  # type: ignore[operator]
        local = torch.full(
            (experts.shape[0], cfg.num_experts), -1.0, dtype=weights.dtype, device=weights.device
        )
        local.scatter_(1, experts, weights)  # [T_local, E]: weight if chosen, else -1
        table = all_gather_sequence(local, group)  # [T, E]
        order = torch.argsort(-table, dim=0, stable=True)
        rank = torch.empty_like(order)
        position = torch.arange(tokens, device=order.device).unsqueeze(1).expand_as(order)
        rank.scatter_(0, order, position)  # rank[i, j]: row i's place in expert j's order
        kept = (table >= 0) & (rank < capacity)  # [T, E]
        dropped = tokens * cfg.top_k - int(kept.sum())
        start = group_rank(group) * experts.shape[0]
        mine = kept[start : start + experts.shape[0]]  # [T_local, E]
        return mine.gather(1, experts), dropped

    @torch.no_grad()
    def update_expert_bias(self, groups: tuple[Group, ...]) -> None:
        """DeepSeek-V3's step: sum the loads counted since the last call over ``groups`` (in
        turn: together every rank routing other tokens of this layer), move each bias by
        ``γ·sign(mean load - load)``, and reset the counts. Call once after each optimizer
        step; a no-op without ``expert_bias``."""
        if self.expert_bias is None or self.tokens_per_expert is None:
            return
        load = self.tokens_per_expert
        for group in groups:
            if group_size(group) > 1:
                dist.all_reduce(load, group=group)
        self.expert_bias.add_(self.config.bias_update_rate * torch.sign(load.mean() - load))
        load.zero_()
