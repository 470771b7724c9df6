"""``lightning-sp fit | validate | test``: Lightning's ``LightningCLI`` for ``GPTModule`` +
``TextDataModule``, with the config checked before any class is built or any process starts,
one-line errors, our loggers, checkpoint callback and progress bar."""

from __future__ import annotations

import os
from typing import Any

from jsonargparse import Namespace
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from typing_extensions import override

from lightning_sp.cli.checks import check_before_launch, check_fit_config, checkpoint_adapters
from lightning_sp.cli.init_from import complete_from_directory
from lightning_sp.cli.parser import OneLineErrorParser

LIGHTNING_MODEL_CHECKPOINT = (
    "lightning.pytorch.callbacks.ModelCheckpoint",
    "lightning.pytorch.callbacks.model_checkpoint.ModelCheckpoint",
    "pytorch_lightning.callbacks.ModelCheckpoint",
)
"""Lightning's ModelCheckpoint, as a config names it; the CLI builds
:class:`lightning_sp.ModelCheckpoint` (which also saves the step that ends the run) instead."""


def _default_loggers(root: str) -> list[Namespace]:
    """CSV logs under ``root``/csv, and TensorBoard logs under ``root``/tensorboard when
    installed (``root``: ``trainer.default_root_dir``, where any Lightning run logs)."""

    def logger(name: str, folder: str) -> Namespace:
        path = f"lightning.pytorch.loggers.{name}"
        return Namespace(class_path=path, init_args=Namespace(save_dir=root, name=folder))

    loggers = [logger("CSVLogger", "csv")]
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        return loggers
    return [*loggers, logger("TensorBoardLogger", "tensorboard")]


class GPTCLI(LightningCLI):
    """LightningCLI for ``GPTModule`` + ``TextDataModule``, sequence length shared by both;
    the parsed config is checked before any class is instantiated."""

    adapters_from_checkpoint: str | None = None
    """A checkpoint a command without subcommands reads (``generate --ckpt_path``), whose
    adapters ``model.lora`` takes when the config names none (a subcommand's own
    ``ckpt_path`` does this for ``fit`` / ``validate`` / ``test`` / ``predict``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("parser_class", OneLineErrorParser)  # one line, a close match
        super().__init__(*args, **kwargs)

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("model.config.seq_length", "data.seq_length")

    @override
    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        """Parse, take the architecture ``model.config`` leaves out from ``model.init_from``
        (:mod:`lightning_sp.cli.init_from`) and the adapters ``model.lora`` leaves out from a
        LoRA run's ``ckpt_path`` (:func:`~lightning_sp.cli.checks.checkpoint_adapters`), then
        check the config of ``fit`` / ``validate`` /
        ``test`` / ``predict`` before launch (one-line errors), before Lightning seeds (its
        "Seed set to" notice follows the checks, so that a bad config prints one line only)."""
        super().parse_arguments(parser, args)
        complete_from_directory(parser, args, self.config)
        subcommand = self.config.get("subcommand")
        if subcommand is None and self.adapters_from_checkpoint is not None:
            checkpoint_adapters(self.config.model, self.adapters_from_checkpoint)
        if subcommand is not None:
            section = self.config[subcommand]
            checkpoint_adapters(section.model, section.get("ckpt_path"))  # a LoRA run's
            check_fit_config(section, subcommand)
            check_before_launch(self.config[subcommand])  # tokenizer, writable dirs

    @override
    def before_instantiate_classes(self) -> None:
        """Log to CSV (and TensorBoard)
        under ``trainer.default_root_dir`` unless the config names loggers (or ``false``); build
        :class:`lightning_sp.ModelCheckpoint` where the config names Lightning's; use
        :class:`lightning_sp.ProgressBar` (short names and units) unless the config disables
        the bar or names a progress bar of its own."""
        config = self.config.get(str(self.subcommand), self.config)
        trainer = config.get("trainer")
        if trainer is None:
            return
        if trainer.get("logger") in (None, True):  # Lightning's default logger: ours
            trainer["logger"] = _default_loggers(trainer.get("default_root_dir") or os.getcwd())
        callbacks = list(trainer.get("callbacks") or [])
        for callback in callbacks:  # last.ckpt that always continues the run
            if getattr(callback, "class_path", None) in LIGHTNING_MODEL_CHECKPOINT:
                callback.class_path = "lightning_sp.ModelCheckpoint"
        if trainer.get("enable_progress_bar") is False:
            return
        if any("ProgressBar" in str(getattr(c, "class_path", "")) for c in callbacks):
            return
        bar = Namespace(class_path="lightning_sp.ProgressBar", init_args=Namespace())
        trainer["callbacks"] = [*callbacks, bar]


class Unseeded(LightningCLI):
    """Mix in before a ``LightningCLI`` subclass for the commands that train nothing
    (``prepare``, ``estimate``, ``generate``): no ``seed_everything`` (its "Seed set to" line
    would come before a one-line error; their own seeds are ``data.seed`` and ``--seed``)."""

    @override
    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        super().parse_arguments(parser, args)
        self.config["seed_everything"] = False
