"""Checks of a parsed ``fit`` / ``validate`` / ``test`` config, run in the launcher before any
class is built or any rank starts, so that a bad value fails once, in one line:
:func:`check_fit_config` (strategy arguments, precision, layout against the devices, model
against the layout, optimizer, the checkpoint to resume) and :func:`check_before_launch` (the
tokenizer fits the model's vocabulary, reading only the tokenizer file, and every checkpoint
directory can be written)."""

from __future__ import annotations

from typing import Any

from lightning_sp.data.tokenizer import tokenizer_info
from lightning_sp.errors import ConfigError, check_writable
from lightning_sp.training.checks import (
    check_optimizer,
    check_precision,
    check_strategy_args,
)


def check_tokenizer_fits(data: Any, vocab_size: int) -> None:
    """``data.tokenizer`` (a ``tokenizer.json``; None: bytes) has at most ``vocab_size`` ids
    (the model's ``model.config.vocab_size``)."""
    tokens = tokenizer_info(getattr(data, "tokenizer", None)).vocab_size
    if tokens > vocab_size:
        raise ConfigError(
            f"model.config.vocab_size={vocab_size} is smaller than the tokenizer's vocabulary "
            f"of {tokens} tokens; set model.config.vocab_size >= {tokens} or use a smaller "
            "tokenizer"
        )


def checkpoint_directories(trainer: Any) -> dict[str, str]:
    """``{field: directory}`` for each ``ModelCheckpoint`` of a parsed ``trainer`` config
    that names a ``dirpath`` (``trainer.callbacks[i].init_args.dirpath``), and for
    ``trainer.default_root_dir`` when set (logs, and checkpoints without a ``dirpath``)."""
    found: dict[str, str] = {}
    for index, callback in enumerate(getattr(trainer, "callbacks", None) or []):
        if not str(getattr(callback, "class_path", "")).endswith("ModelCheckpoint"):
            continue
        dirpath = getattr(getattr(callback, "init_args", None), "dirpath", None)
        if dirpath:
            found[f"trainer.callbacks[{index}].init_args.dirpath"] = str(dirpath)
    root = getattr(trainer, "default_root_dir", None)
    if root:
        found["trainer.default_root_dir"] = str(root)
    return found


def check_before_launch(config: Any) -> None:
    """The tokenizer fits the model; the checkpoint and log directories can be written."""
    data, model = getattr(config, "data", None), getattr(config, "model", None)
    if data is not None and model is not None:
        check_tokenizer_fits(data, int(model.config.vocab_size))
    for field, directory in checkpoint_directories(config.trainer).items():
        check_writable(field, directory)


def _strategy_init_args(strategy: Any) -> dict[str, Any] | None:
    """The init args of a ``MegatronSPStrategy`` in a parsed config (``None``: another one)."""
    if isinstance(strategy, str):
        return {} if strategy.startswith("megatron_sp") else None
    class_path = str(getattr(strategy, "class_path", "") or "")
    if not class_path.endswith("MegatronSPStrategy"):
        return None
    init = getattr(strategy, "init_args", None)
    return dict(vars(init)) if init is not None else {}


def check_fit_config(config: Any) -> None:
    """Every check that needs only a parsed ``fit`` config (a jsonargparse Namespace):
    strategy arguments, precision, layout against the devices, model against the layout,
    optimizer values and, when resuming, the checkpoint (present, intact, same shapes)."""
    from lightning_sp.checkpoint.verify import check_checkpoint
    from lightning_sp.model.config import GPTConfig

    trainer = config.trainer
    args = _strategy_init_args(trainer.strategy)
    model_config = GPTConfig(**vars(config.model.config))
    if args is not None:
        layout = check_strategy_args(**args)
        check_precision(trainer.precision)
        devices = trainer.devices
        if isinstance(devices, int) and devices > 0:
            layout = layout.for_world_size(devices * (trainer.num_nodes or 1))
            layout = layout.with_sequence_parallel(model_config.sequence_parallel)
            model_config.validate(layout.tensor_parallel_size)
            layout.check_sequence_length(model_config.seq_length, model_config.sequence_parallel)
    check_optimizer(config.model.optimizer)
    ckpt_path = getattr(config, "ckpt_path", None)
    if ckpt_path and ckpt_path not in ("last", "hpc", "best", "registry"):
        check_checkpoint(ckpt_path, model_config)
