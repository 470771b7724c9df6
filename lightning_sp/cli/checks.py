"""Checks of a parsed ``fit`` / ``validate`` / ``test`` config, run in the launcher before any
class is built or any rank starts, so that a bad value fails once, in one line:
:func:`check_fit_config` (strategy arguments, precision, layout against the devices, model
against the layout, optimizer, the checkpoint to resume) and :func:`check_before_launch` (the
tokenizer fits the model's vocabulary, reading only the tokenizer file, and every checkpoint
directory can be written)."""

from __future__ import annotations

import os
from typing import Any

from lightning_sp.data.tokenizer import tokenizer_info
from lightning_sp.errors import ConfigError, check_writable
from lightning_sp.training.checks import (
    check_gradient_clipping,
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
    """The tokenizer fits the model; already-prepared data directories are whole; the
    checkpoint and log directories can be written."""
    data, model = getattr(config, "data", None), getattr(config, "model", None)
    if data is not None and model is not None:
        check_tokenizer_fits(data, int(model.config.vocab_size))
    if data is not None:
        check_prepared_files(data)
    for field, directory in checkpoint_directories(config.trainer).items():
        check_writable(field, directory)


def check_prepared_files(data: Any) -> None:
    """The prepared directories the data module will read as they are (a blend's, or a
    ``prepared_dir`` with no source to prepare it from) have a readable index and every
    split file the size it counts (:class:`~lightning_sp.data.tokens.TokenSplit`: sizes only,
    no token read): one line naming a cut, missing or unreadable file before anything starts."""
    from lightning_sp.data.blend import parse_blend
    from lightning_sp.data.prepare import SPLITS, read_metadata
    from lightning_sp.data.tokens import TokenSplit

    blend, prepared = data.get("blend"), data.get("prepared_dir")
    if blend is not None:
        directories = list(parse_blend(blend).directories)
    elif prepared is not None and data.get("paths") is None and data.get("dataset_name") is None:
        directories = [os.path.expanduser(prepared)]
    else:
        return
    for directory in directories:
        if read_metadata(directory) is not None:  # else the data module says what is missing
            for split in SPLITS:
                TokenSplit(directory, split)


def _strategy_init_args(strategy: Any) -> dict[str, Any] | None:
    """The init args of a ``MegatronSPStrategy`` in a parsed config (``None``: another one)."""
    if isinstance(strategy, str):
        return {} if strategy.startswith("megatron_sp") else None
    class_path = str(getattr(strategy, "class_path", "") or "")
    if not class_path.endswith("MegatronSPStrategy"):
        return None
    init = getattr(strategy, "init_args", None)
    return dict(vars(init)) if init is not None else {}


def device_count(devices: Any, accelerator: Any = "auto") -> int:
    """The number of devices per node that ``trainer.devices`` asks for, in any form it takes on
    the command line or in YAML: an int, a digit string (``--trainer.devices 2`` parses as
    ``'2'``), ``auto`` or -1 (every device of the accelerator; 1 on CPU), a list of device
    indices or a comma-separated string of them (``"0,1"``; GPUs only). One-line
    :class:`ConfigError` otherwise."""
    shown = f"trainer.devices={devices!r}"
    name = str(getattr(accelerator, "class_path", accelerator) or "auto").lower()
    on_cpu = "cpu" in name or (name == "auto" and not _cuda_count())
    if isinstance(devices, str):
        text = devices.strip()
        if text in ("auto", "-1"):
            return 1 if on_cpu else _cuda_count()
        if text.lstrip("-").isdigit():
            devices = int(text)
        else:
            parts = [part.strip() for part in text.split(",") if part.strip()]
            if not parts or not all(part.isdigit() for part in parts):
                raise ConfigError(
                    f"{shown} is not a device count; valid: a positive integer, auto, or a list "
                    "of GPU indices such as 0,1"
                )
            devices = [int(part) for part in parts]
    if isinstance(devices, bool):
        raise ConfigError(f"{shown} is not a device count; valid: a positive integer or auto")
    if isinstance(devices, int):
        if devices == -1:
            return 1 if on_cpu else _cuda_count()
        if devices < 1:
            raise ConfigError(f"{shown} must be a positive integer, -1 or auto")
        return devices
    if isinstance(devices, list | tuple):
        if on_cpu:
            raise ConfigError(
                f"{shown} lists device indices, which the CPU accelerator does not take; give "
                f"a count (trainer.devices={len(devices)})"
            )
        if not devices or not all(isinstance(d, int) and d >= 0 for d in devices):
            raise ConfigError(f"{shown} must list GPU indices (integers >= 0)")
        return len(devices)
    raise ConfigError(f"{shown} is not a device count; valid: a positive integer or auto")


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_generate_layout(config: Any, t: int) -> None:
    """``generate --tensor_parallel_size t`` fits the model: one line listing the t that do
    (each divides hidden_size, num_heads and the MLP width, and divides or is divided by the
    key/value groups), before any rank starts."""
    import dataclasses

    from lightning_sp.model.config_checks import check_model_layout
    from lightning_sp.parallel.config import ParallelConfig

    config = dataclasses.replace(config, sequence_parallel=False)

    def fits(size: int) -> bool:
        try:
            check_model_layout(config, ParallelConfig(tensor_parallel_size=size))
        except ConfigError:
            return False
        return True

    if not fits(t):
        valid = [size for size in range(1, config.num_heads + 1) if fits(size)]
        raise ConfigError(
            f"tensor_parallel_size={t} does not fit the model (num_heads={config.num_heads}, "
            f"num_query_groups={config.groups}, hidden_size={config.hidden_size}); valid: "
            f"{', '.join(map(str, valid))}"
        )


def check_predict_layout(subcommand: str | None, args: dict[str, Any]) -> None:
    """``predict`` generates with the whole model and sequence on each rank: p = c = 1."""
    if subcommand != "predict":
        return
    for name in ("pipeline_parallel_size", "context_parallel_size"):
        value = args.get(name, 1)
        if value > 1:
            raise ConfigError(
                f"{name}={value}: predict needs the whole model and sequence on each rank; "
                f"predict with {name}=1"
            )


def _lora(model: Any) -> Any:
    """The adapters of a parsed ``model`` section: ``model.lora`` as the record, else those of
    ``model.adapter_from``'s directory; None for a full fine-tune."""
    from lightning_sp.interop.peft import read_adapter_config
    from lightning_sp.model.lora import LoRAConfig

    lora, adapter_from = getattr(model, "lora", None), getattr(model, "adapter_from", None)
    if lora is None:
        return read_adapter_config(adapter_from) if adapter_from is not None else None
    return lora if isinstance(lora, LoRAConfig) else LoRAConfig(**dict(vars(lora)))


def checkpoint_adapters(model: Any, ckpt_path: Any) -> None:
    """A parsed ``model`` section given a LoRA run's checkpoint (``ckpt_path``, a directory)
    runs with the adapters it holds: ``model.lora`` left out (and no ``model.adapter_from``)
    becomes the checkpoint's settings, so ``validate`` / ``test`` / ``generate`` / a resume
    take the run's own config without restating them; a ``model.lora`` that states another
    ``r``, ``lora_alpha`` or ``use_rslora`` than the checkpoint's is one line (its weights
    would mean something else). A full fine-tune's checkpoint changes nothing."""
    import dataclasses
    from pathlib import Path

    from jsonargparse import Namespace

    from lightning_sp.checkpoint.verify import saved_adapters
    from lightning_sp.training.adapters import first_difference

    if not ckpt_path or ckpt_path in ("last", "hpc", "best", "registry"):
        return
    saved = saved_adapters(Path(ckpt_path))
    if saved is None:
        return
    stated = _lora(model)
    if stated is None:
        model.lora = Namespace(**dataclasses.asdict(saved))
        return
    if difference := first_difference(stated, saved):
        name, ours, theirs = difference
        raise ConfigError(
            f"model.lora.{name}={ours!r} but ckpt_path={str(ckpt_path)!r} holds adapters "
            f"with {name}={theirs!r}; leave model.lora out or set {name}: {theirs!r}"
        )


def check_resume(ckpt_path: str, model: Any, model_config: Any) -> None:
    """The checkpoint to resume (validate, test) is intact, of this architecture and shapes
    (:func:`~lightning_sp.checkpoint.verify.check_checkpoint`: with the run's adapters; a
    LoRA run from ``model.init_from`` needs only the adapters, its base read from there), and
    a LoRA run's was trained on ``model.init_from`` (its recorded fingerprint: one line
    otherwise, before anything starts)."""
    from pathlib import Path

    from lightning_sp.checkpoint.verify import check_checkpoint, read_lightning, verify
    from lightning_sp.training.adapters import check_base

    lora, init_from = _lora(model), getattr(model, "init_from", None)
    if lora is not None and Path(ckpt_path).is_dir():
        verify(Path(ckpt_path))  # intact, before its records are read
        check_base(read_lightning(Path(ckpt_path)).get("lora_base"), init_from)
    with_base = lora is None or init_from is None
    check_checkpoint(ckpt_path, model_config, lora, with_base)


def _masked(data: Any) -> bool:
    """Whether the data section gives batches with per-token loss masks: chat SFT rows (a
    ``chat_template_dir`` without ``preference``) or ``eod_mask_loss``."""
    get = data.get if hasattr(data, "get") else lambda k, d=None: getattr(data, k, d)
    chat = get("chat_template_dir") is not None and not get("preference", False)
    return bool(chat or get("eod_mask_loss", False))


def check_fit_config(config: Any, subcommand: str | None = None) -> None:
    """Every check that needs only a parsed ``fit`` / ``validate`` / ``test`` / ``predict``
    config (a jsonargparse Namespace): strategy arguments, precision, layout against the
    devices (``trainer.devices`` in any form, :func:`device_count`), model against the layout,
    optimizer values and, when resuming, the checkpoint (present, intact, the same
    architecture and shapes)."""
    from lightning_sp.model.config import GPTConfig
    from lightning_sp.model.config_checks import check_model_layout
    from lightning_sp.model.fp8 import check_fp8_launch
    from lightning_sp.parallel.config import ParallelConfig
    from lightning_sp.training.batches import check_masked_accumulation

    trainer = config.trainer
    args = _strategy_init_args(trainer.strategy)
    model_config = GPTConfig.from_values(config.model.config)  # nested mappings as records
    layout = ParallelConfig()  # another strategy: data parallelism, the whole model per rank
    if subcommand in (None, "fit") and model_config.moe is not None:
        model_config.moe.check_trainable()
        data = getattr(config, "data", None)
        if model_config.moe.adds_auxiliary_losses and data is not None and _masked(data):
            check_masked_accumulation(int(trainer.accumulate_grad_batches or 1))
    if args is not None:
        layout = check_strategy_args(**args)
        check_precision(trainer.precision)
        check_predict_layout(subcommand, args)
        devices = device_count(trainer.devices, trainer.accelerator)
        if devices > 0:
            layout = layout.for_world_size(devices * int(trainer.num_nodes or 1))
    check_model_layout(model_config, layout)  # the one check of the model against the layout
    lora = _lora(config.model) is not None
    check_fp8_launch(model_config, trainer.accelerator, trainer.precision, lora)
    check_optimizer(config.model.optimizer)
    check_gradient_clipping(trainer.gradient_clip_val, trainer.gradient_clip_algorithm)
    ckpt_path = getattr(config, "ckpt_path", None)
    if ckpt_path and ckpt_path not in ("last", "hpc", "best", "registry"):
        check_resume(ckpt_path, config.model, model_config)  # its adapters and base too
