"""Checks of a parsed ``fit`` config that read files but need no process group, so that they
fail in the launcher, once, before any rank starts: the tokenizer fits the model's vocabulary
(only the tokenizer file is read), and every checkpoint directory can be written."""

from __future__ import annotations

import os
import tempfile
from typing import Any

from lightning_sp.errors import ConfigError
from lightning_sp.training.data.tokenizer import tokenizer_info


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


def check_writable(field: str, directory: str) -> None:
    """``directory`` exists and a file can be created in it, or it can be created: its
    nearest existing ancestor is a directory in which a file can be created (a probe file,
    removed at once). ``field`` names the setting in the message."""
    path = os.path.abspath(os.path.expanduser(directory))
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ConfigError(
            f"{field}={directory!r} cannot be written: {existing!r} is a file, not a "
            "directory; give a directory path"
        )
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as error:
        raise ConfigError(
            f"{field}={directory!r} cannot be written: {error.strerror or error} in "
            f"{existing!r}; give a directory this user can write"
        ) from error


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
