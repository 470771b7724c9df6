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

Its bases hold the rest of its hooks: the shard and the protocol
(:mod:`~lightning_sp.training.shard_module`), checkpoints and the start of a fit
(:mod:`~lightning_sp.training.checkpoint_hooks`), backward, clipping and the optimizer
(:mod:`~lightning_sp.training.optimizer_hooks`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from torchmetrics import MeanMetric
from typing_extensions import override

from lightning_sp.data.prompts import Codec
from lightning_sp.interop.hf import check_hf_directory, load_hf_weights
from lightning_sp.model.compile import CompileOptions, check_compile_options, compile_layers
from lightning_sp.model.config import GPTConfig
from lightning_sp.model.config_checks import check_model_layout
from lightning_sp.model.generate import GenerationConfig, generate
from lightning_sp.model.lora import LoRAConfig
from lightning_sp.optim.adamw import OptimizerConfig
from lightning_sp.parallel.config import ParallelConfig
from lightning_sp.parallel.state import ParallelState
from lightning_sp.pipeline import Pipeline
from lightning_sp.pipeline.token_mean import TokenMean, counted_tokens
from lightning_sp.training import adapters
from lightning_sp.training.batches import (
    labels_of,
    replica_mean,
    scale_auxiliary_losses_to_token_mean,
    step_inputs,
)
from lightning_sp.training.checkpoint_hooks import CheckpointHooks
from lightning_sp.training.checks import (
    COMPILED_MEMORY_WARNING,
    check_compile,
    check_data,
    check_optimizer,
    check_pipeline_batch,
    check_predict,
    eager_fp8_warning,
)
from lightning_sp.training.dpo import PreferenceSteps, check_dpo
from lightning_sp.training.optimizer_hooks import OptimizerHooks
from lightning_sp.training.preference import DPOConfig
from lightning_sp.training.protocol import Batched

_DEFAULT_MODEL = GPTConfig()
_DEFAULT_OPTIMIZER = OptimizerConfig()
_DEFAULT_GENERATION = GenerationConfig()
_DEFAULT_COMPILE = CompileOptions()


class GPTModule(CheckpointHooks, OptimizerHooks):
    """Trains a GPT shard: next-token loss, AdamW, validation loss and perplexity.

    Args:
        config: The model (``lightning_sp.GPTConfig``). Its ``sequence_parallel`` is the
            run's, and the one place it is set.
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
        compile_options: How ``compile_layers`` compiles (backend, mode, ``fullgraph``,
            ``dynamic``: :class:`~lightning_sp.model.compile.CompileOptions`); set only with
            ``compile_layers=True``, checked against the model and the device before any step.
        generation: How ``predict`` continues each prompt (:meth:`predict_step`).
        lora: Train LoRA adapters (``peft``'s settings: :class:`~lightning_sp.model.lora.
            LoRAConfig`) on the linears it names, the base frozen (no gradients, no optimizer
            state, no weight-gradient GEMMs), in any layout; ``None``: train every weight.
        adapter_from: A PEFT adapter directory (trained on ``init_from``) the adapters start
            from, in any layout; ``lora`` None: its settings (:mod:`.adapters`).
        dpo: Train on preference pairs with Direct Preference Optimization (TRL's losses and
            metrics, the reference as :class:`~lightning_sp.training.preference.DPOConfig`
            says: :mod:`lightning_sp.training.dpo`); the data must be preference data.
            ``None``: next-token training.
    """

    def __init__(
        self,
        config: GPTConfig = _DEFAULT_MODEL,
        optimizer: OptimizerConfig = _DEFAULT_OPTIMIZER,
        init_from: str | None = None,
        compile_layers: bool = False,
        generation: GenerationConfig = _DEFAULT_GENERATION,
        lora: LoRAConfig | None = None,
        adapter_from: str | None = None,
        dpo: DPOConfig | None = None,
        compile_options: CompileOptions = _DEFAULT_COMPILE,
    ) -> None:
        super().__init__()
        self.dpo = dataclasses.replace(dpo) if dpo is not None else None
        self.lora = dataclasses.replace(lora) if lora is not None else None
        self.compile_layers = compile_layers
        self.compile_options = dataclasses.replace(compile_options)
        self.compile_options.validate(compile_layers)
        self.config = dataclasses.replace(config)
        self.optimizer_config = dataclasses.replace(optimizer)
        self.generation = dataclasses.replace(generation)
        check_optimizer(self.optimizer_config)
        self.init_from = init_from
        if init_from is not None:
            check_hf_directory(init_from, self.config)
        self.generation.validate()
        self.adapter_from = adapter_from
        self.lora = adapters.adapter_settings(self.lora, adapter_from, init_from, self.config)
        self._preference: PreferenceSteps | None = None  # a DPO run's steps
        if self.dpo is not None:
            check_dpo(self.dpo, self.config, self.lora is not None)
            self._preference = PreferenceSteps(self.dpo, self.lora is not None)
        self._save_hyperparameters()
        self.pipeline: Pipeline | None = None  # this rank's model chunks (one when p = 1)
        self._parallel: tuple[ParallelState, ParallelConfig] | None = None  # pushed by megatron_sp
        self.val_loss = MeanMetric()
        self._configured: list[dict[str, Any]] | None = None  # this run's optimizer settings
        self._resumed_optimizer: dict[str, Any] | None = None  # the checkpoint's (resuming)
        self._token_mean: TokenMean | None = None  # the step's counts, with loss masks
        self._clipped: tuple[object, list[Tensor] | None] | None = None  # buffer, flat: clipping
        self._stepped: list[torch.nn.Module] | None = None  # see optimizer_step

    def _save_hyperparameters(self) -> None:
        """What ``hparams.yaml`` and checkpoints record of this module: its settings as they
        run (``recompute: auto`` appears resolved once ``configure_model`` has resolved it)."""
        self.save_hyperparameters(
            {
                "config": self.config.values(),
                "optimizer": dataclasses.asdict(self.optimizer_config),
                "init_from": self.init_from,
                "compile_layers": self.compile_layers,
                "lora": dataclasses.asdict(self.lora) if self.lora is not None else None,
                "adapter_from": self.adapter_from,
                "dpo": dataclasses.asdict(self.dpo) if self.dpo is not None else None,
                "compile_options": dataclasses.asdict(self.compile_options),
            }
        )

    # -- model -------------------------------------------------------------------------------

    @override
    def configure_model(self) -> None:
        if self.pipeline is not None:
            return
        config, state, layout = self.config, self.parallel_state, self.parallel_config
        check_data(getattr(self._trainer, "datamodule", None), config)
        check_model_layout(config, layout)  # the one check of the model against the layout
        if self.compile_layers and self.compile_options.backend == "inductor":
            check_compile(state)
        if config.recompute.auto:  # the planner's fastest recomputation that fits
            from lightning_sp.planner.estimate import auto_recompute_config

            per_step = self._batch_size() or layout.num_microbatches
            micro_batch = max(1, per_step // layout.num_microbatches)
            config, choice = auto_recompute_config(config, layout, micro_batch, state.device)
            rank_zero_info(f"recompute=auto: {choice.describe()}")
            # resolved once: the model, hparams.yaml, the checkpoint and the monitors all see
            # the policy that runs (the loggers write hparams after configure_model)
            self.config = config
            self._save_hyperparameters()
        if self.compile_layers:  # recompute resolved: what the layers will run
            check_compile_options(self.compile_options, config, state.device)
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
        if self.lora is not None:  # after the base weights: peft's init, or adapter_from's
            adapters.attach_adapters(self.pipeline.chunks, self.lora, self.adapter_from, config)
        if (slow := eager_fp8_warning(config, self.compile_layers)) is not None:
            rank_zero_warn(slow)
        if self.compile_layers:
            rank_zero_warn(COMPILED_MEMORY_WARNING)
            for chunk in self.pipeline.chunks:
                compile_layers(chunk.layers, self.compile_options)
        if self._preference is not None:
            data = getattr(self._trainer, "datamodule", None)
            self._preference.configure(config, self.pipeline, self.init_from, data)

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
        if self._preference is not None:  # DPO: the step's mean over pairs
            if self._token_mean is None or batch_idx % self.trainer.accumulate_grad_batches == 0:
                self._token_mean = TokenMean(self.parallel_state)  # a new step
            model, mean = self.stage_model(), self._token_mean
            return self._preference.training_step(model, batch, mean, self._zero_grad)
        masked = "loss_mask" in batch  # logged with the step's token mean
        if masked and (
            self._token_mean is None or batch_idx % self.trainer.accumulate_grad_batches == 0
        ):
            self._token_mean = TokenMean(self.parallel_state)  # a new step
            accumulate = self.trainer.accumulate_grad_batches
            scale_auxiliary_losses_to_token_mean(self.stage_model(), labels_of(batch), accumulate)
        loss = self._loss(batch, train=True)
        if masked:
            assert self._token_mean is not None
            self._token_mean.add(labels_of(batch), loss)
            return loss
        # not prog_bar (a host read every step): lightning_sp.ProgressBar reads it when it refreshes
        self.log("train/loss", replica_mean(loss, self.parallel_state))
        return loss

    @override
    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        if self._preference is not None:
            return self._preference.validation_step(self.stage_model(), batch)
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
        if self._preference is not None:  # val/loss and TRL's names: val/rewards/accuracies, ...
            for name, mean in self._preference.validation_metrics(self.parallel_state).items():
                self.log(f"val/{name}", mean, prog_bar=name in ("loss", "rewards/accuracies"))
            return
        loss = self.val_loss.compute()
        self.val_loss.reset()
        self.log("val/loss", loss, prog_bar=True)
        self.log("val/ppl", torch.exp(loss), prog_bar=True)
