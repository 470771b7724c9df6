"""The checkpoint hooks of :class:`~lightning_sp.training.gpt_module.GPTModule`: what a
checkpoint records besides the weights and optimizer state (the model chunks' RNG streams, the
vocabulary's identity, a LoRA run's base), what loading one restores, checks or upgrades (the
base, keys saved before the one holder, one GPT's streams), and the start of a fit (a resumed
run trains with this run's optimizer settings; the auxiliary losses scaled as Lightning scales
the loss).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_sp.model.config import GPTConfig
from lightning_sp.model.hooks import scale_auxiliary_losses
from lightning_sp.model.lora import LoRAConfig
from lightning_sp.optim import resume
from lightning_sp.optim.adamw import OptimizerConfig
from lightning_sp.training import adapters
from lightning_sp.training.checks import check_vocabulary, vocabulary_identity
from lightning_sp.training.shard_module import ShardModule


class CheckpointHooks(ShardModule):
    """The checkpoint and fit-start hooks of a module that holds a GPT :class:`Pipeline`
    (``GPTModule``, which sets the attributes below)."""

    config: GPTConfig
    optimizer_config: OptimizerConfig
    _configured: list[dict[str, Any]] | None
    _resumed_optimizer: dict[str, Any] | None
    lora: LoRAConfig | None
    init_from: str | None

    @property
    def checkpoint_holds_base(self) -> bool:
        """Whether this run's checkpoints hold its frozen weights. A LoRA run from
        ``init_from`` saves its adapters and their optimizer state only (plus ``lora_base``:
        the base's path and fingerprint); a resume reads the base from ``init_from`` again,
        in any layout, and refuses another base (:func:`~lightning_sp.training.adapters.
        check_base`). A full fine-tune has nothing frozen; a LoRA run on a seeded base saves
        it (nothing else could restore it)."""
        return self.lora is None or self.init_from is None

    def _vocabulary_identity(self) -> dict[str, Any]:
        datamodule = getattr(self._trainer, "datamodule", None) if self._trainer else None
        return vocabulary_identity(self.config.vocab_size, datamodule)

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["rng_streams"] = self.stage_model().rng_state_dict()
        checkpoint["vocabulary"] = self._vocabulary_identity()
        if self.lora is not None:  # which base the adapters train on (checked on resume)
            checkpoint["lora_base"] = adapters.base_record(self.init_from)

    @override
    def on_fit_start(self) -> None:
        """A mixture of experts routing force-balanced (a measurement switch) is not trained:
        one line (the CLI refuses it before launch)."""
        if self.config.moe is not None:
            self.config.moe.check_trainable()

    @override
    def on_train_start(self) -> None:
        """A resumed run trains with this run's optimizer settings (restored from the
        checkpoint just before): :mod:`lightning_sp.optim.resume`; one line if they differ
        from the checkpoint's. Lightning divides each accumulated batch's loss by
        ``accumulate_grad_batches``: the auxiliary losses (an MoE layer's load-balancing
        terms) are scaled alike (:func:`~lightning_sp.model.hooks.scale_auxiliary_losses`)."""
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
        adapters.check_base(checkpoint.get("lora_base"), self.init_from)
        weights = checkpoint.get("state_dict", {})
        for key in [k for k in weights if k.startswith("gpt.")]:  # saved before the one holder
            weights["pipeline.chunks.0." + key[len("gpt.") :]] = weights.pop(key)
        streams = checkpoint.get("rng_streams")
        if streams is not None and "replicated" in streams:  # one GPT's streams: chunk 0
            streams = {"0": streams}
        if streams is not None:
            self.stage_model().load_rng_state_dict(streams)
