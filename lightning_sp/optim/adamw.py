"""AdamW as Megatron trains: low-precision weights, fp32 gradients, fp32 master weights.

The model keeps bf16 (or fp16) parameters, so activations stay 2 bytes and the paper's
accounting holds. Every parameter gets an fp32 ``main_grad`` buffer; a post-accumulate-grad
hook adds each fresh low-precision gradient into it and frees ``param.grad``, so gradient
accumulation over micro-batches happens in fp32. AdamW updates fp32 master copies of the
weights and writes them back, rounded, into the model.

For fp32 models none of this is needed: :func:`build_adamw` returns a plain ``AdamW``.

Either way the update runs as multi-tensor kernels: torch's fused AdamW on CUDA, the
``foreach`` implementation elsewhere (one kernel per operation over all parameters instead of
a Python loop over them; the same arithmetic as the per-parameter loop).

:class:`OptimizerConfig` holds the settings (``model.optimizer`` in a config) and
:func:`configure_adamw` builds the optimizer with GPT-3's warm-up + cosine schedule.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from lightning.pytorch.utilities.types import OptimizerLRSchedulerConfig
from torch import Tensor, nn

from lightning_sp.optim.distributed import DistributedAdamW, run_closure
from lightning_sp.parallel.buffer import GradBuffer, GradBufferConfig
from lightning_sp.parallel.state import ParallelState


@dataclass
class OptimizerConfig:
    """AdamW with linear warm-up and cosine decay (GPT-3's schedule)."""

    lr: float = 3e-4
    """Peak learning rate, reached after warmup_steps."""

    min_lr: float = 3e-5
    """Learning rate at the end of the cosine decay (and after it)."""

    weight_decay: float = 0.1
    """Decoupled weight decay, applied to weight matrices only."""

    beta1: float = 0.9
    """Adam β1."""

    beta2: float = 0.95
    """Adam β2."""

    eps: float = 1e-8
    """Adam ε."""

    warmup_steps: int = 100
    """Steps of linear warm-up from 0 to lr."""

    decay_steps: int | None = None
    """Steps until the cosine decay reaches min_lr; default: the trainer's max_steps."""


@runtime_checkable
class HasGradBuffer(Protocol):
    """An optimizer over a :class:`~lightning_sp.parallel.buffer.GradBuffer`
    (:class:`MasterWeightAdamW`,
    :class:`~lightning_sp.optim.distributed.DistributedAdamW`)."""

    grad_buffer: GradBuffer | None


def grad_buffer_of(optimizer: object) -> GradBuffer | None:
    """The gradient buffer ``optimizer`` steps from, if any (a plain ``AdamW`` has none)."""
    return optimizer.grad_buffer if isinstance(optimizer, HasGradBuffer) else None


@runtime_checkable
class Sharded(Protocol):
    """A model a gradient buffer can serve: it knows its parallel state (a ``GPT``, a
    ``Pipeline``, any shard built on ``lightning_sp.parallel``)."""

    state: ParallelState


@runtime_checkable
class Scheduled(Protocol):
    """A pipeline stage (``Pipeline``): several backward passes per step, and a tied
    embedding whose copies are summed over stages before the data-parallel reduction."""

    num_microbatches: int

    def tied_embedding_weights(self) -> list[Tensor]: ...


def _accumulate_into_main_grad(param: Tensor) -> None:
    param.main_grad.add_(param.grad)  # type: ignore[attr-defined]
    param.grad = None


class MasterWeightAdamW(torch.optim.AdamW):
    """AdamW on fp32 master weights of low-precision model parameters.

    ``param_groups`` are given with the *model* parameters; the optimizer holds fp32 masters
    in their place. Its ``state_dict`` includes the masters, so a resumed run continues from
    the exact fp32 weights.
    """

    def __init__(
        self,
        param_groups: Iterable[dict[str, Any]],
        *,
        grad_buffer: GradBuffer | None = None,
        **defaults: Any,
    ) -> None:
        self.model_params: list[Tensor] = []
        self.grad_buffer = grad_buffer
        """With a :class:`~lightning_sp.parallel.buffer.GradBuffer`, ``main_grad`` are views
        into it and its hooks accumulate (and reduce); without, one buffer per parameter."""
        master_groups = []
        for group in param_groups:
            masters = []
            for p in group["params"]:
                if grad_buffer is None:
                    p.main_grad = torch.zeros_like(p, dtype=torch.float32)
                    p.register_post_accumulate_grad_hook(_accumulate_into_main_grad)
                if p.dtype in (torch.bfloat16, torch.float16) or grad_buffer is None:
                    master = p.detach().float().clone().requires_grad_(True)
                else:  # a full-precision parameter is its own master
                    master = p
                masters.append(master)
                self.model_params.append(p)
            master_groups.append({**group, "params": masters})
        super().__init__(master_groups, **defaults)

    def _masters(self) -> list[Tensor]:
        return [m for group in self.param_groups for m in group["params"]]

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = run_closure(closure)
        for master, p in zip(self._masters(), self.model_params, strict=True):
            master.grad = p.main_grad  # type: ignore[attr-defined]
        super().step()
        for master, p in zip(self._masters(), self.model_params, strict=True):
            if master is not p:
                p.copy_(master)
            else:
                p.grad = None
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.grad_buffer is not None:
            self.grad_buffer.zero()
        for p in self.model_params:
            if self.grad_buffer is None:
                p.main_grad.zero_()  # type: ignore[attr-defined]
            p.grad = None
        for master in self._masters():
            master.grad = None

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["master_weights"] = [m.detach().clone() for m in self._masters()]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        masters = state_dict.pop("master_weights")
        super().load_state_dict(state_dict)
        with torch.no_grad():
            for master, saved, p in zip(self._masters(), masters, self.model_params, strict=True):
                master.copy_(saved)
                if master is not p:
                    p.copy_(saved)


def kernel_options(device: torch.device) -> dict[str, bool]:
    """AdamW's implementation for parameters on ``device``: ``fused`` on CUDA, else ``foreach``."""
    return {"fused": True} if device.type == "cuda" else {"foreach": True}


def build_adamw(
    model: nn.Module,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    eps: float,
    grad_buffer: GradBufferConfig | None = None,
) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (not on biases, LayerNorms, 1-D params).

    fp32 models get ``torch.optim.AdamW``; low-precision models get
    :class:`MasterWeightAdamW` (fp32 gradients and master weights); both use
    :func:`kernel_options` for the parameters' device. With ``grad_buffer`` (a
    :class:`~lightning_sp.parallel.buffer.GradBufferConfig`) every model gets
    :class:`MasterWeightAdamW` over a :class:`~lightning_sp.parallel.buffer.GradBuffer` of
    buckets of its ``bucket_numel`` elements (``model`` then has a ``state``; a pipeline's
    micro-batches and tied embedding are read from it), reducing during backward unless its
    ``overlap`` is off; with its ``distributed`` the buffer reduce-scatters and
    :class:`~lightning_sp.optim.distributed.DistributedAdamW` keeps 1/d of the state.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    device = params[0].device if params else torch.device("cpu")
    kernel: dict[str, Any] = dict(lr=lr, betas=betas, eps=eps, **kernel_options(device))
    if grad_buffer is not None:
        if not isinstance(model, Sharded):
            raise TypeError(f"a gradient buffer needs the model's parallel state: "
                            f"{type(model).__name__} has no `state`")  # fmt: skip
        stage = model if isinstance(model, Scheduled) else None
        buffer = GradBuffer(
            params,
            model.state,
            grad_buffer.bucket_numel,
            deferred=stage.tied_embedding_weights() if stage is not None else (),
            overlap=grad_buffer.overlap,
            backwards_per_step=stage.num_microbatches if stage is not None else 1,
            distributed=grad_buffer.distributed,
        )
        if grad_buffer.distributed:
            return DistributedAdamW(groups, buffer, **kernel)
        return MasterWeightAdamW(groups, grad_buffer=buffer, **kernel)
    low_precision = any(p.dtype in (torch.bfloat16, torch.float16) for p in params)
    cls = MasterWeightAdamW if low_precision else torch.optim.AdamW
    return cls(groups, **kernel)


def lr_multiplier(step: int, peak: float, floor: float, warmup: int, decay: int) -> float:
    """Learning-rate factor at ``step``: linear warm-up, cosine decay to ``floor / peak``."""
    if step < warmup:
        return (step + 1) / warmup
    if step >= decay:
        return floor / peak
    progress = (step - warmup) / max(1, decay - warmup)
    return (floor + 0.5 * (peak - floor) * (1.0 + math.cos(math.pi * progress))) / peak


def configure_adamw(
    model: nn.Module,
    cfg: OptimizerConfig,
    max_steps: int,
    grad_buffer: GradBufferConfig | None = None,
) -> OptimizerLRSchedulerConfig:
    """``configure_optimizers``'s answer: AdamW (:func:`build_adamw`, over a gradient buffer
    when ``grad_buffer`` is given) with warm-up + cosine decay stepped every optimizer step."""
    optimizer = build_adamw(
        model, cfg.lr, cfg.weight_decay, (cfg.beta1, cfg.beta2), cfg.eps, grad_buffer
    )
    decay = cfg.decay_steps or max(max_steps, cfg.warmup_steps + 1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: lr_multiplier(step, cfg.lr, cfg.min_lr, cfg.warmup_steps, decay),
    )
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
