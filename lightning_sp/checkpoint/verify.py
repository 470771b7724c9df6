"""Reading a checkpoint and checking it before anything is loaded: completeness, format,
file checksums, and that its tensor shapes fit the model."""

from __future__ import annotations

import dataclasses
import zlib
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from lightning_sp.checkpoint.format import (
    DCP_METADATA,
    FORMAT,
    FORMAT_VERSION,
    META_FILE,
    Meta,
)
from lightning_sp.errors import ConfigError


def file_checksums(path: Path) -> dict[str, int]:
    """CRC32 of every file in a checkpoint's data directory (but ``meta.json``)."""
    sums = {}
    for file in sorted(path.iterdir()):
        if file.is_file() and file.name != META_FILE:
            crc = 0
            with open(file, "rb") as fh:
                while block := fh.read(1 << 22):
                    crc = zlib.crc32(block, crc)
            sums[file.name] = crc
    return sums


def verify(path: Path, field: str = "ckpt_path") -> tuple[Meta, Metadata]:
    """Check that ``path`` is a complete, intact checkpoint of this format; return its
    ``meta.json`` and DCP metadata. :class:`ConfigError` (one line naming the file) if not."""
    shown = f"{field}={str(path)!r}"
    if not path.exists():
        raise ConfigError(f"{shown} does not exist")
    data = path.resolve()
    if not data.is_dir():
        raise ConfigError(f"{shown} is a file; a checkpoint is a directory saved by megatron_sp")
    if (data / "meta.pt").is_file() and not (data / META_FILE).exists():
        raise ConfigError(
            f"{shown} is in the old per-shard format, which this version does not read; "
            "resume with the version that wrote it"
        )
    for name in (META_FILE, DCP_METADATA):
        if not (data / name).is_file():
            raise ConfigError(f"{shown} is not a complete checkpoint: {name} is missing")
    try:
        meta = Meta.read(data)
    except (ValueError, TypeError, KeyError) as error:
        raise ConfigError(f"{shown}: {META_FILE} is corrupt ({error})") from None
    if meta.format != FORMAT or meta.version > FORMAT_VERSION:
        raise ConfigError(
            f"{shown} has format {meta.format} version {meta.version}; this version reads "
            f"{FORMAT} up to version {FORMAT_VERSION}"
        )
    actual = file_checksums(data)
    for name, crc in meta.checksums.items():
        file = data / name
        if name not in actual:
            raise ConfigError(f"{shown}: file {file} is missing")
        if actual[name] != crc:
            raise ConfigError(f"{shown}: file {file} is truncated or corrupt (CRC32 mismatch)")
    try:
        metadata = FileSystemReader(data).read_metadata()
    except Exception as error:
        raise ConfigError(f"{shown}: file {data / DCP_METADATA} is corrupt ({error})") from None
    return meta, metadata


def saved_config(meta: Meta) -> Any:
    """The :class:`~lightning_sp.model.config.GPTConfig` a checkpoint was trained with (fields
    it does not record, added to the config since, take their defaults; fields this version
    no longer has are ignored)."""
    from lightning_sp.model.config import GPTConfig

    known = {f.name for f in dataclasses.fields(GPTConfig)}
    return GPTConfig.from_values({k: v for k, v in meta.model.items() if k in known})


def check_architecture(metadata: Metadata, meta: Meta, config: Any, lora: Any = None) -> None:
    """The model ``config`` (a ``GPTConfig``) is the architecture the checkpoint was trained
    with: its :attr:`~lightning_sp.model.config.GPTConfig.architecture` record equal, whole
    (the MoE shape included), and every tensor the checkpoint holds a parameter or persistent
    buffer of this model. Else one :class:`ConfigError` line naming each differing field
    (``moe.top_k`` for an MoE one) with both values (or the tensor this model lacks). The run
    settings (:class:`~lightning_sp.model.run_settings.RunSettings`) may differ. ``lora`` (a
    ``LoRAConfig``): the model carries those adapters (a LoRA run's checkpoint holds them)."""

    from lightning_sp.checkpoint.shards import buffer_entries, global_shapes

    if meta.model:
        differ = [
            f"model.config.{name}={mine!r} but the checkpoint was trained with {name}={theirs!r}"
            for name, mine, theirs in config.architecture.differences(
                saved_config(meta).architecture
            )
        ]
        if differ:
            raise ConfigError(
                f"{'; '.join(differ)}: another architecture; load it with the checkpoint's values"
            )
    model = _shapes_model(config, lora)
    shapes = global_shapes(model) | dict(buffer_entries(model))
    for key, entry in metadata.state_dict_metadata.items():
        tensor = key.startswith("model.") and isinstance(entry, TensorStorageMetadata)
        if tensor and key not in shapes:
            raise ConfigError(
                f"the checkpoint holds {key}, which this model lacks; load it into the model "
                "it was trained with"
            )


def _shapes_model(config: Any, lora: Any) -> Any:
    """A model of ``config`` on the ``meta`` device (its tensors' names and shapes), with
    ``lora``'s adapters when given."""
    import torch

    from lightning_sp.model.gpt import GPT
    from lightning_sp.model.lora import apply_lora
    from lightning_sp.parallel.state import ParallelState

    with torch.device("meta"):
        model = GPT(_for_shapes(config), ParallelState.single("meta"), device="meta")
    if lora is not None:
        apply_lora(model, lora)
    return model


def _for_shapes(config: Any) -> Any:
    """``config`` as a model built only for its tensors' names and shapes runs it: without
    recomputation (a policy never changes a shape; ``auto`` is resolved per device at run
    time)."""
    from lightning_sp.model.recompute import NO_RECOMPUTE

    return dataclasses.replace(config, recompute=NO_RECOMPUTE)


def check_shapes(
    metadata: Metadata, shapes: dict[str, tuple[int, ...]], meta: Meta, model: dict[str, Any]
) -> None:
    """Every parameter of the model exists in the checkpoint with the same full shape; else a
    :class:`ConfigError` naming the differing model field (or the tensor) and both values."""
    stored = metadata.state_dict_metadata
    bad = [k for k, s in shapes.items() if k not in stored or tuple(stored[k].size) != s]  # type: ignore[union-attr]
    if not bad:
        return
    for name, value in model.items():  # name the config field when the saved config says it
        if (
            name in ("seq_length", "vocab_size")
            and name in meta.model
            and meta.model[name] != value
        ):
            raise ConfigError(
                f"model.config.{name}={value!r} but the checkpoint was trained with "
                f"{name}={meta.model[name]!r}; its tensor shapes do not fit this model"
            )
    key = bad[0]
    if key not in stored:
        raise ConfigError(f"the checkpoint has no {key}, which this model has")
    entry = stored[key]
    assert isinstance(entry, TensorStorageMetadata)
    raise ConfigError(
        f"{key} has shape {list(shapes[key])} in this model but {list(entry.size)} in the "
        "checkpoint"
    )


def read_full(path: Path) -> dict[str, Any]:
    """The whole checkpoint in one process: ``{key: full tensor or object}`` (no process group;
    for tests, inspection and export)."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict[str, Any] = {}
    _load_state_dict(
        state,
        storage_reader=FileSystemReader(Path(path).resolve()),
        planner=_EmptyStateDictLoadPlanner(),
        no_dist=True,
    )
    return state


def check_checkpoint(
    ckpt_path: str, model_config: Any, lora: Any = None, with_base: bool = True
) -> None:
    """The checkpoint exists, is intact, was trained with this model's architecture
    (:func:`check_architecture`; ``lora``: with those adapters), and its tensors have this
    model's shapes (without ``with_base``, the adapters': a LoRA run from ``init_from``
    saves no frozen weight)."""
    from lightning_sp.checkpoint.shards import global_shapes

    meta, metadata = verify(Path(ckpt_path))
    check_architecture(metadata, meta, model_config, lora)
    model = _shapes_model(model_config, lora)
    check_shapes(metadata, global_shapes(model, with_base), meta, model_config.values())


def saved_adapters(path: Path) -> Any:
    """The ``LoRAConfig`` of the run that saved the checkpoint directory ``path``, from its
    Lightning state (None: a full fine-tune's, or not a checkpoint this can read; the checks
    that follow name what is wrong with it)."""
    from lightning_sp.model.lora import LoRAConfig

    if not (path.is_dir() and (path / META_FILE).is_file() and (path / DCP_METADATA).is_file()):
        return None
    try:
        fields = (read_lightning(path).get("hyper_parameters") or {}).get("lora")
    except Exception:  # unreadable: verify() names the file before anything loads
        return None
    return LoRAConfig(**fields) if fields else None


def read_lightning(path: Path) -> dict[str, Any]:
    """The Lightning state a checkpoint directory records (hyper-parameters, vocabulary, a
    LoRA run's ``lora_base``, ...), read in one process without its tensors."""
    import warnings

    from torch.distributed.checkpoint import load as dcp_load

    state: dict[str, Any] = {"lightning": None}
    with warnings.catch_warnings():  # "no process group: loading in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp_load(state, storage_reader=FileSystemReader(Path(path).resolve()), no_dist=True)
    return state.get("lightning") or {}
