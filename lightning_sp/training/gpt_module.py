"""``GPTModule``: the LightningModule that trains a ``lightning_sp.GPT``.

The model is created in ``configure_model``, directly as this rank's shard (no full model is
ever materialised), from the parallel state and layout the ``megatron_sp`` strategy pushed in
(:meth:`GPTModule.setup_parallel`), or as a whole model on one process under any other
strategy. It is always one
:class:`~lightning_sp.pipeline.Pipeline` of this rank's model chunks (one chunk when
``p = 1``), the module's :meth:`~GPTModule.stage_model` (the
:class:`~lightning_sp.training.protocol.ParallelModule` protocol the strategy drives). With
``p > 1`` a training step runs the whole schedule (forward and backward of every
micro-batch) inside ``training_step``; with ``p = 1`` Lightning runs backward as usual.

Under context parallelism (``c > 1``) every CP rank of a data-parallel replica reads the same
batch ``[b, s]`` and feeds its model only its two load-balanced chunks ``[b, s/c]``
(:func:`~lightning_sp.training.batches.step_inputs`), in training, validation and the
pipeline schedule alike; the loss the model returns, and the one logged, is the token
mean over the whole sequences (equal on the CP ranks).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.types import OptimizerLRSchedulerConfig
from torch import Tensor
from torch.optim import Optimizer
from torchmetrics import MeanMetric
from typing_extensions import override

from lightning_sp.data.prompts import Codec
from lightning_sp.errors import ConfigError
from lightning_sp.interop.hf import check_hf_directory, load_hf_weights
from lightning_sp.model.config import GPTConfig
from lightning_sp.model.generate import GenerationConfig, generate
from lightning_sp.model.gpt import GPT
from lightning_sp.model.moe import (
    scale_auxiliary_losses,
    update_expert_biases,
)
from lightning_sp.model.moe_metrics import step_metrics
from lightning_sp.optim import resume
from lightning_sp.optim.adamw import OptimizerConfig, configure_adamw, grad_buffer_of
from lightning_sp.parallel.config import ParallelConfig
from lightning_sp.parallel.grads import clip_grad_norm_
from lightning_sp.parallel.state import ParallelState
from lightning_sp.pipeline import Pipeline
from lightning_sp.pipeline.token_mean import TokenMean, counted_tokens
from lightning_sp.training.batches import labels_of, replica_mean, step_inputs
from lightning_sp.training.checks import (
    COMPILED_MEMORY_WARNING,
    check_compile,
    check_data,
    check_optimizer,
    check_pipeline_batch,
    check_predict,
    check_vocabulary,
    vocabulary_identity,
)
from lightning_sp.training.protocol import Batched, BucketsGradients

_DEFAULT_MODEL = GPTConfig()
_DEFAULT_OPTIMIZER = OptimizerConfig()
_DEFAULT_GENERATION = GenerationConfig()


class GPTModule(LightningModule):
    """Trains a GPT shard: next-token loss, AdamW, validation loss and perplexity.

    Args:
        config: The model (``lightning_sp.GPTConfig``). Its ``sequence_parallel`` is the
            run's; the strategy's ``sequence_parallel``, if given, must agree.
        optimizer: AdamW and learning-rate schedule settings.
        init_from: A local Hugging Face directory of a GPT-2 or Llama model (``config.json``
            + ``model.safetensors``, or shards with ``model.safetensors.index.json``) to start
            from instead of the seeded initialisation; each rank reads only its own slices.
            Its architecture and sizes must equal ``config``'s (checked here).
        compile_layers: ``torch.compile`` each transformer layer, in any layout (see
            :func:`~lightning_sp.training.checks.check_compile`). Measured on CPU (torch
            2.13; t=1, t=2 + SP with lean recompute, p=2): the eager loss, gradients within
            fp32 rounding; each dropout with our generators and each recompute's RNG snapshot
            is a graph break (dropout 0 traces whole layers). The bytes a compiled layer saves
            are the partitioner's choice, not the policy's (configs/tiny.yaml: 36.0 sbh
            measured vs 32.0 eager), so the formulas and the planner no longer describe them
            (warned once); the activation monitor measures them.
        generation: How ``predict`` continues each prompt (:meth:`predict_step`).
    """

    def __init__(
        self,
        config: GPTConfig = _DEFAULT_MODEL,
        optimizer: OptimizerConfig = _DEFAULT_OPTIMIZER,
        init_from: str | None = None,
        compile_layers: bool = False,
        generation: GenerationConfig = _DEFAULT_GENERATION,
    ) -> None:
        super().__init__()
        self.compile_layers = compile_layers
        self.config = dataclasses.replace(config)
        self.optimizer_config = dataclasses.replace(optimizer)
        self.generation = dataclasses.replace(generation)
        self.config.validate()
        check_optimizer(self.optimizer_config)
        self.init_from = init_from
        if init_from is not None:
            check_hf_directory(init_from, self.config)
        self.generation.validate()
        self._save_hyperparameters()
        self.pipeline: Pipeline | None = None  # this rank's model chunks (one when p = 1)
        self._parallel: tuple[ParallelState, ParallelConfig] | None = None  # pushed by megatron_sp
        self.val_loss = MeanMetric()
        self._configured: list[dict[str, Any]] | None = None  # this run's optimizer settings
        self._resumed_optimizer: dict[str, Any] | None = None  # the checkpoint's (resuming)
        self._token_mean: TokenMean | None = None  # the step's counts, with loss masks

    def _save_hyperparameters(self) -> None:
        """What ``hparams.yaml`` and checkpoints record of this module: its settings as they
        run (``recompute: auto`` appears resolved once ``configure_model`` has resolved it)."""
        self.save_hyperparameters(
            {
                "config": dataclasses.asdict(self.config),
                "optimizer": dataclasses.asdict(self.optimizer_config),
                "init_from": self.init_from,
                "compile_layers": self.compile_layers,
            }
        )

    # -- model -------------------------------------------------------------------------------

    supports_pipeline_parallel = True
    """The strategy may run this module with ``pipeline_parallel_size > 1``."""

    supports_context_parallel = True
    """The strategy may run this module with ``context_parallel_size > 1`` (each CP rank
    keeps its chunks of every batch)."""

    @property
    def sequence_parallel(self) -> bool:
        """``config.sequence_parallel`` (the ``ParallelModule`` protocol)."""
        return self.config.sequence_parallel

    def setup_parallel(self, state: ParallelState, config: ParallelConfig) -> None:
        """Receive this rank's state and the run's layout from the strategy (the
        ``ParallelModule`` protocol); ``configure_model`` builds the shard from them."""
        self._parallel = (state, config)

    def stage_model(self) -> Pipeline:
        """This rank's model chunks (built in ``configure_model``)."""
        if self.pipeline is None:
            raise RuntimeError("the model is created in configure_model; run it through a Trainer")
        return self.pipeline

    @property
    def parallel_state(self) -> ParallelState:
        """The state the strategy pushed, else one process on the strategy's device."""
        if self._parallel is not None:
            return self._parallel[0]
        # the device the strategy will run on (this module is still on the CPU while
        # configure_model runs), so the model and its RNG streams are built there
        strategy = self._trainer.strategy if self._trainer is not None else None
        device = strategy.root_device if strategy is not None else self.device
        return ParallelState.single(device)

    @property
    def parallel_config(self) -> ParallelConfig:
        """The layout the strategy pushed, else one process (every size 1)."""
        if self._parallel is not None:
            return self._parallel[1]
        return ParallelConfig(sequence_parallel=self.config.sequence_parallel)

    @property
    def chunks(self) -> list[GPT]:
        """This rank's model chunks (one :class:`GPT` when ``p = 1``)."""
        return list(self.stage_model().chunks)

    @override
    def configure_model(self) -> None:
        if self.pipeline is not None:
            return
        config, state, layout = self.config, self.parallel_state, self.parallel_config
        check_data(getattr(self._trainer, "datamodule", None), config)
        layout.check_sequence_length(config.seq_length, config.sequence_parallel)
        if self.compile_layers:
            check_compile(state)
        if config.recompute == "auto":  # the planner's fastest recomputation that fits
            from lightning_sp.planner.estimate import auto_recompute_config

            per_step = self._batch_size() or layout.num_microbatches
            micro_batch = max(1, per_step // layout.num_microbatches)
            config, choice = auto_recompute_config(config, layout, micro_batch, state.device)
            rank_zero_info(f"recompute=auto: {choice.describe()}")
            # resolved once: the model, hparams.yaml, the checkpoint and the monitors all see
            # the policy that runs (the loggers write hparams after configure_model)
            self.config = config
            self._save_hyperparameters()
        if state.pipeline_parallel_size > 1:
            trainer = self._trainer
            accumulate = trainer.accumulate_grad_batches if trainer is not None else None
            check_pipeline_batch(accumulate, self._batch_size(), layout.num_microbatches)
        self.pipeline = Pipeline(
            config,
            state,
            num_microbatches=layout.num_microbatches,
            virtual_pipeline_size=layout.virtual_pipeline_size,
            dtype=torch.get_default_dtype(),
            device=state.device,
            timeout=state.timeout,
        )
        self._load_init_from()
        if self.compile_layers:
            rank_zero_warn(COMPILED_MEMORY_WARNING)
            for chunk in self.pipeline.chunks:
                for layer in chunk.layers:
                    layer.compile()

    def _batch_size(self) -> int | None:
        """Samples per step per data-parallel rank, if the data module states it."""
        datamodule = getattr(self._trainer, "datamodule", None)  # set by Trainer.fit
        return datamodule.batch_size if isinstance(datamodule, Batched) else None

    def _load_init_from(self) -> None:
        """Overwrite the seeded weights with ``init_from``'s (this rank's slices only)."""
        if self.init_from is not None:
            for chunk in self.chunks:
                load_hf_weights(chunk, self.init_from)

    def _loss(self, batch: dict[str, Tensor], train: bool) -> Tensor:
        """The batch's mean loss, or with a ``loss_mask`` the sum over its counted tokens (the
        step's global token mean divides it: :class:`TokenMean`)."""
        model = self.stage_model()
        ids, labels, packing = step_inputs(batch, model)  # this CP rank's chunks [b, s/c]
        if not train:
            return model.eval_step(ids, labels, packing)
        if not model.runs_backward:
            return model(ids, labels, packing)  # Lightning runs backward
        optimizer = self.optimizers()
        assert not isinstance(optimizer, list)  # configure_optimizers returns one
        optimizer.zero_grad()  # see optimizer_zero_grad
        return model.train_step(ids, labels, packing)  # every micro-batch's passes

    # -- steps -------------------------------------------------------------------------------

    @override
    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = self._loss(batch, train=True)
        if "loss_mask" in batch:  # logged with the step's token mean (on_before_optimizer_step)
            if self._token_mean is None or batch_idx % self.trainer.accumulate_grad_batches == 0:
                self._token_mean = TokenMean(self.parallel_state)  # a new step
            self._token_mean.add(labels_of(batch), loss)
            return loss
        self.log("train/loss", replica_mean(loss, self.parallel_state), prog_bar=True)
        return loss

    @override
    def optimizer_step(
        self,
        epoch: int,
        batch_idx: int,
        optimizer: Optimizer | LightningOptimizer,
        optimizer_closure: Callable[[], Any] | None = None,
    ) -> None:
        """The step, then the MoE layers' auxiliary-loss-free bias updates: here, not in
        ``on_train_batch_end``, which Lightning calls after the callbacks' (a checkpoint saved
        there must hold the biases this step moved)."""
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        update_expert_biases(self.stage_model())

    @override
    def backward(self, loss: Tensor, *args: Any, **kwargs: Any) -> None:
        """Backward of the loss; under pipeline parallelism the schedule has already run it
        inside ``training_step`` (the hooks around backward still run)."""
        if not self.stage_model().runs_backward:
            super().backward(loss, *args, **kwargs)

    @override
    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Optimizer) -> None:
        """Lightning zeroes gradients between ``training_step`` and ``backward``; under
        pipeline parallelism backward has already run by then, so ``training_step`` zeroes
        them before the schedule instead."""
        if not self.stage_model().runs_backward:
            super().optimizer_zero_grad(epoch, batch_idx, optimizer)

    @override
    def on_before_optimizer_step(self, optimizer: Optimizer) -> None:
        """The step's MoE routing metrics over every micro-batch, replica and stage
        (:func:`~lightning_sp.model.moe_metrics.step_metrics`), logged as ``train/moe/*``.
        With loss masks: divide the step's gradients (summed over its counted tokens) by
        the global count and log ``train/loss``, the global token mean
        (:meth:`TokenMean.finish`); a step whose global count is 0 is refused (one line, every
        rank) before the optimizer steps. Runs after the gradients are finalised, before
        clipping."""
        model = self.stage_model()
        for name, value in step_metrics(model, model.state, self.config).items():
            self.log(f"train/{name}", value.float())
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
        self.log("train/loss", loss.float(), prog_bar=True)

    @override
    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        loss = self._loss(batch, train=False)
        if "loss_mask" not in batch:
            self.val_loss.update(loss)
            return
        tokens = counted_tokens(labels_of(batch))  # a token mean over the whole split
        if tokens:
            self.val_loss.update(loss / tokens, weight=tokens)

    @override
    def predict_step(self, batch: dict[str, Any], batch_idx: int) -> dict[str, Any]:
        """Continue the prompt of ``batch`` (``{"input_ids": [1, n], "prompt": [str]}``) with
        :func:`~lightning_sp.model.generate.generate` and ``self.generation``; returns
        ``{"prompt", "completion", "token_ids"}`` (text decoded with the datamodule's
        ``codec``, which also gives the end-of-document token that stops generation)."""
        codec: Codec | None = getattr(getattr(self.trainer, "datamodule", None), "codec", None)
        check_predict(self.stage_model().state)
        ids = batch["input_ids"][0].tolist()
        eos = codec.eos_id if codec is not None else None
        tokens = generate(self.chunks[0], ids, self.generation, eos_id=eos)
        return {
            "prompt": batch["prompt"][0],
            "completion": codec.decode(tokens) if codec is not None else None,
            "token_ids": tokens,
        }

    @override
    def on_validation_epoch_end(self) -> None:
        loss = self.val_loss.compute()
        self.val_loss.reset()
        self.log("val/loss", loss, prog_bar=True)
        self.log("val/ppl", torch.exp(loss), prog_bar=True)

    # -- optimisation ------------------------------------------------------------------------

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
        buffer = grad_buffer_of(optimizer)
        sharded = buffer is not None and buffer.distributed
        norm = clip_grad_norm_(self.parameters(), gradient_clip_val, self.parallel_state, sharded)
        self.log("train/grad_norm", norm, prog_bar=False)

    # -- checkpoints -------------------------------------------------------------------------

    def _vocabulary_identity(self) -> dict[str, Any]:
        datamodule = getattr(self._trainer, "datamodule", None) if self._trainer else None
        return vocabulary_identity(self.config.vocab_size, datamodule)

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["rng_streams"] = self.stage_model().rng_state_dict()
        checkpoint["vocabulary"] = self._vocabulary_identity()

    @override
    def on_train_start(self) -> None:
        """A resumed run trains with this run's optimizer settings (restored from the
        checkpoint just before): :mod:`lightning_sp.optim.resume`; one line if they differ
        from the checkpoint's. Lightning divides each accumulated batch's loss by
        ``accumulate_grad_batches``: the MoE auxiliary losses are scaled alike."""
        pipeline = self.stage_model()
        accumulate = self.trainer.accumulate_grad_batches
        scale_auxiliary_losses(pipeline, 1 / (pipeline.num_microbatches * accumulate))
        if self._resumed_optimizer is None or self._configured is None:
            return
        scheduler = self.lr_schedulers()
        for optimizer in self.trainer.optimizers:
            resume.apply_settings(optimizer, scheduler, self._configured)
        changes = resume.changed_settings(self._resumed_optimizer, self.optimizer_config)
        if changes:
            rank_zero_info(resume.notice(changes, self.trainer.global_step))
        self._resumed_optimizer = None

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._resumed_optimizer = checkpoint.get("hyper_parameters", {}).get("optimizer", {})
        check_vocabulary(checkpoint.get("vocabulary", {}), self._vocabulary_identity())
        weights = checkpoint.get("state_dict", {})
        for key in [k for k in weights if k.startswith("gpt.")]:  # saved before the one holder
            weights["pipeline.chunks.0." + key[len("gpt.") :]] = weights.pop(key)
        streams = checkpoint.get("rng_streams")
        if streams is not None and "replicated" in streams:  # one GPT's streams: chunk 0
            streams = {"0": streams}
        if streams is not None:
            self.stage_model().load_rng_state_dict(streams)
