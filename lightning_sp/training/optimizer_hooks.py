"""The optimisation hooks of :class:`~lightning_sp.training.gpt_module.GPTModule`: what runs
between a step's losses and its optimizer step. Backward (which a pipeline schedule has
already run inside ``training_step``) and the zeroing of gradients around it; the step's
metrics and, with loss masks, the gradients divided by the step's global token count
(:class:`~lightning_sp.pipeline.token_mean.TokenMean`); clipping by the true global norm; the
optimizer step and the modules' state moved after it; the optimizer itself (AdamW on the
strategy's gradient buffer).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.utilities.types import OptimizerLRSchedulerConfig
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_sp.errors import ConfigError
from lightning_sp.model.config import GPTConfig
from lightning_sp.model.hooks import after_optimizer_step, step_metrics, stepped_modules
from lightning_sp.optim import resume
from lightning_sp.optim.adamw import OptimizerConfig, configure_adamw, grad_buffer_of
from lightning_sp.parallel.grads import clip_grad_norm_, counted_flat_grads
from lightning_sp.pipeline.token_mean import TokenMean
from lightning_sp.training.dpo import PreferenceSteps
from lightning_sp.training.protocol import BucketsGradients
from lightning_sp.training.shard_module import ShardModule


class OptimizerHooks(ShardModule):
    """The backward, gradient and optimizer hooks of a module that holds a GPT
    :class:`~lightning_sp.pipeline.Pipeline` (``GPTModule``, which sets the attributes
    below)."""

    config: GPTConfig
    optimizer_config: OptimizerConfig
    _preference: PreferenceSteps | None
    _configured: list[dict[str, Any]] | None
    _token_mean: TokenMean | None
    _clipped: tuple[object, list[Tensor] | None] | None
    _stepped: list[torch.nn.Module] | None

    @override
    def optimizer_step(
        self,
        epoch: int,
        batch_idx: int,
        optimizer: Optimizer | LightningOptimizer,
        optimizer_closure: Callable[[], Any] | None = None,
    ) -> None:
        """The step, then the modules' state moved once per step (:func:`~lightning_sp.model.
        hooks.after_optimizer_step`, those modules found once: the MoE routers' biases): here,
        not in ``on_train_batch_end``, which Lightning calls after the callbacks' (a
        checkpoint saved there must hold the state this step moved)."""
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        if self._stepped is None:  # the model is built once (configure_model)
            self._stepped = stepped_modules(self.stage_model())
        after_optimizer_step(self.stage_model(), self._stepped)

    @override
    def backward(self, loss: Tensor, *args: Any, **kwargs: Any) -> None:
        """Backward of the loss; under pipeline parallelism the schedule has already run it
        inside ``training_step`` (the hooks around backward still run)."""
        if not self.stage_model().runs_backward:
            super().backward(loss, *args, **kwargs)

    def _zero_grad(self) -> None:
        """Zero the gradients now (before a pipeline schedule runs backward in a step)."""
        optimizer = self.optimizers()
        assert not isinstance(optimizer, list)  # configure_optimizers returns one
        optimizer.zero_grad()

    @override
    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Optimizer) -> None:
        """Lightning zeroes gradients between ``training_step`` and ``backward``; under
        pipeline parallelism backward has already run by then, so ``training_step`` zeroes
        them before the schedule instead."""
        if not self.stage_model().runs_backward:
            super().optimizer_zero_grad(epoch, batch_idx, optimizer)

    @override
    def on_before_optimizer_step(self, optimizer: Optimizer) -> None:
        """The step's metrics the model's parts count over every micro-batch, replica and
        stage (:func:`~lightning_sp.model.hooks.step_metrics`: an MoE model's routing metrics),
        logged as ``train/<name>`` (``train/moe/*``).
        With loss masks: divide the step's gradients (summed over its counted tokens) by
        the global count and log ``train/loss``, the global token mean
        (:meth:`TokenMean.finish`); a step whose global count is 0 is refused (one line, every
        rank) before the optimizer steps. Runs after the gradients are finalised, before
        clipping."""
        model = self.stage_model()
        for name, value in step_metrics(model, model.state, self.config).items():
            self.log(f"train/{name}", value.float())
        if self._preference is not None:  # TRL's names: train/rewards/chosen, ...
            for name, mean in self._preference.step_metrics(model.state).items():
                self.log(f"train/{name}", mean)
        if self._token_mean is None:
            return
        accumulation = 1 if model.runs_backward else self.trainer.accumulate_grad_batches
        loss = self._token_mean.finish(model, accumulation)
        tokens, self._token_mean = self._token_mean.finished_tokens, None
        if not tokens:  # the same global count on every rank: every rank raises this line
            raise ConfigError(
                f"step {self.trainer.global_step}: no label of the global batch counts in the "
                "loss (every token masked: chat rows without an assistant answer, or only "
                "end-of-document tokens under eod_mask_loss); the run stops rather than step "
                "the optimizer on nothing: prepare the chat corpus again (conversations "
                "without an answer are dropped)"
            )
        self.log("train/loss", loss.float())  # not prog_bar: see training_step

    @override
    def configure_optimizers(self) -> OptimizerLRSchedulerConfig:
        strategy = self.trainer.strategy
        buffer = strategy.grad_buffer if isinstance(strategy, BucketsGradients) else None
        configured = configure_adamw(
            self.stage_model(), self.optimizer_config, self.trainer.max_steps, buffer
        )
        self._configured = resume.configured_settings(configured["optimizer"])
        return configured

    @override
    def configure_gradient_clipping(
        self,
        optimizer: Optimizer,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        """Clip by the true global norm over all shards (replicated parameters counted once)."""
        if not gradient_clip_val:
            return
        if gradient_clip_algorithm not in (None, "norm"):
            raise ConfigError(
                f"gradient_clip_algorithm={gradient_clip_algorithm!r} is not supported; use 'norm'"
            )
        buffer, state = grad_buffer_of(optimizer), self.parallel_state
        if self._clipped is None or self._clipped[0] is not buffer:  # once per buffer
            self._clipped = (buffer, counted_flat_grads(self.parameters(), buffer, state))  # whole
        flat, sharded = self._clipped[1], buffer is not None and buffer.distributed
        norm = clip_grad_norm_(self.parameters(), gradient_clip_val, state, sharded, flat)
        self.log("train/grad_norm", norm, prog_bar=False)
