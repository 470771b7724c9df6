"""Layout-independent checkpoints on ``torch.distributed.checkpoint`` (DCP).

Every tensor is saved under its identity in the *unsharded, unsplit* model: the parameter's
global name (global layer numbers, :meth:`GPT.global_name`) and the offsets of this rank's
shard inside the full tensor (the :class:`~lightning_sp.parallel.init.ShardSpec` that the
layout-independent init already uses). DCP writes each rank's shards to its own files and
records the global shapes; loading reads, for each shard of the *new* layout, the pieces of
whichever saved shards overlap it. A checkpoint saved with any (t, p, m, d, SP) therefore loads
into any other valid layout: resharding on load, no conversion step.

Keys::

    model.<global name>                 weights, e.g. model.layers.3.mlp.fc1.weight
    optim.<global name>.<field>         Adam's exp_avg, exp_avg_sq and step, and ``master``
                                        (fp32 master weights of bf16/fp16 models)
    optim.param_groups                  learning rates, betas, ... per parameter group
    rng.pp<p>.dp<d>.tp<t>               one rank's dropout streams and torch RNG state
    lightning                           Lightning's loop, callback, scheduler and datamodule state

and ``meta.json`` beside DCP's files: format version, layout, step, model config and a
CRC32 of every file (so a truncated or corrupt file is named before anything is read).

The vocabulary is padded to a multiple of ``128·t``, which depends on t: only the true
vocabulary rows are saved, and each layout keeps its own padding rows (which no output depends
on). The tied embedding's copy on the last pipeline stage is not saved; it loads from the one
entry. RNG streams are per rank and restored only into the same layout; another layout starts
its streams from the seed.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import (
    _create_read_items,
    _create_write_items,
    create_read_items_for_chunk_list,
)

from lightning_sp.errors import ConfigError
from lightning_sp.model.gpt import GPT
from lightning_sp.training import commit

FORMAT = "lightning_sp.dcp"
FORMAT_VERSION = 1
META_FILE = "meta.json"
DCP_METADATA = ".metadata"


@dataclass(frozen=True)
class Shard:
    """A local tensor (a view of a parameter or optimizer state) and where it sits in the
    full tensor: ``offsets`` inside ``global_shape``. ``None`` offsets: the whole tensor."""

    local: Tensor
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...] | None = None


@dataclass
class Layout:
    """What a checkpoint records about the run that wrote it."""

    tensor_parallel_size: int
    pipeline_parallel_size: int
    data_parallel_size: int
    virtual_pipeline_size: int = 1
    sequence_parallel: bool = False

    def describe(self) -> str:
        return (
            f"t={self.tensor_parallel_size}, p={self.pipeline_parallel_size}, "
            f"m={self.virtual_pipeline_size}, d={self.data_parallel_size}, "
            f"SP={self.sequence_parallel}"
        )


@dataclass
class Meta:
    """``meta.json``."""

    step: int
    layout: Layout
    model: dict[str, Any]
    format: str = FORMAT
    version: int = FORMAT_VERSION
    checksums: dict[str, int] = field(default_factory=dict)

    def dumps(self) -> str:
        data = dict(self.__dict__, layout=self.layout.__dict__)
        return json.dumps(data, indent=1, sort_keys=True)

    @classmethod
    def read(cls, path: Path) -> Meta:
        data = json.loads((path / META_FILE).read_text())
        return cls(**dict(data, layout=Layout(**data["layout"])))


# -- global identities ---------------------------------------------------------------------------


def gpt_chunks(module: nn.Module) -> list[GPT]:
    """The GPT shards (one, or the pipeline stage's chunks) inside ``module``."""
    return [m for m in module.modules() if isinstance(m, GPT)]


def parameter_shards(module: nn.Module) -> Iterator[tuple[str, Tensor, Shard | None]]:
    """``(global name, parameter, its saved slice)`` for every parameter of ``module``'s GPT
    shards; the slice is ``None`` where this rank holds nothing of the full tensor (a shard of
    padding rows only)."""
    for chunk in gpt_chunks(module):
        t = chunk.state.tensor_parallel_size
        for name, param in chunk.named_parameters():
            gname = chunk.global_name(name)
            spec = param.shard  # type: ignore[attr-defined]
            shape = tuple(param.shape)
            if spec.dim is None:
                yield gname, param, Shard(param.detach(), shape)
                continue
            full = list(shape)
            full[spec.dim] *= t
            if gname == "word_embeddings.weight":  # padding rows depend on t: true rows only
                full[0] = chunk.config.vocab_size
            length = min(shape[spec.dim], full[spec.dim] - spec.start)
            if length <= 0:
                yield gname, param, None
                continue
            offsets = [0] * len(shape)
            offsets[spec.dim] = spec.start
            local = param.detach().narrow(spec.dim, 0, length)
            yield gname, param, Shard(local, tuple(full), tuple(offsets))


def _like(shard: Shard, tensor: Tensor) -> Shard:
    """The same slice of ``tensor`` (an optimizer state of the parameter's shape)."""
    local = tensor.detach()
    for dim, size in enumerate(shard.local.shape):
        local = local.narrow(dim, 0, size)
    return Shard(local, shard.global_shape, shard.offsets)


def _optimizer_pairs(optimizer: torch.optim.Optimizer) -> list[tuple[Tensor, Tensor]]:
    """``(optimizer parameter, model parameter)``: the same tensor, or an fp32 master and its
    model parameter (:class:`~lightning_sp.training.optim.MasterWeightAdamW`)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    models = getattr(optimizer, "model_params", params)
    return list(zip(params, models, strict=True))


ADAM_FIELDS = ("exp_avg", "exp_avg_sq")


Install = tuple[torch.optim.Optimizer, Tensor, str, Tensor, str]
"""``(optimizer, its parameter, state field, the state tensor, checkpoint key)``."""


def state_entries(
    module: nn.Module, optimizers: list[torch.optim.Optimizer], *, for_load: bool
) -> tuple[dict[str, Tensor], dict[str, Shard], list[Install]]:
    """The tensors of a checkpoint as DCP sees them: ``{key: local tensor}`` and
    ``{key: Shard}`` for the sharded ones. For a save, the tied embedding's pipeline copy is
    left out; for a load, every parameter is a target, and Adam states that do not exist yet
    are allocated (returned as installs, for :func:`install_states` after the load)."""
    tensors: dict[str, Tensor] = {}
    shards: dict[str, Shard] = {}
    by_param: dict[int, tuple[str, Shard]] = {}
    for gname, param, shard in parameter_shards(module):
        if shard is None or (not for_load and getattr(param, "pipeline_copy", False)):
            continue
        by_param[id(param)] = (gname, shard)
        _add(tensors, shards, f"model.{gname}", shard)
    installs: list[Install] = []
    for optimizer in optimizers:
        for opt_param, model_param in _optimizer_pairs(optimizer):
            if id(model_param) not in by_param:
                continue
            gname, shard = by_param[id(model_param)]
            state = optimizer.state.get(opt_param, {})
            if opt_param is not model_param:
                _add(tensors, shards, f"optim.{gname}.master", _like(shard, opt_param))
            for name in (*ADAM_FIELDS, "step"):
                key, value = f"optim.{gname}.{name}", state.get(name)
                if value is None and for_load:
                    value = (
                        torch.zeros((), dtype=torch.float32)
                        if name == "step"
                        else torch.zeros_like(opt_param)
                    )
                    installs.append((optimizer, opt_param, name, value, key))
                if value is None:
                    continue
                if name == "step":
                    tensors[key] = value
                else:
                    _add(tensors, shards, key, _like(shard, value))
    return tensors, shards, installs


def install_states(installs: list[Install], loaded: set[str]) -> None:
    """Give Adam the states allocated for a load, for parameters whose every field was in the
    checkpoint (a checkpoint saved before the first step has none)."""
    complete: dict[int, bool] = {}
    for _, param, _, _, key in installs:
        complete[id(param)] = complete.get(id(param), True) and key in loaded
    for optimizer, param, name, value, _ in installs:
        if complete[id(param)]:
            optimizer.state[param][name] = value


def _add(tensors: dict[str, Tensor], shards: dict[str, Shard], key: str, shard: Shard) -> None:
    tensors[key], shards[key] = shard.local, shard


def global_shapes(module: nn.Module) -> dict[str, tuple[int, ...]]:
    """``{model.<global name>: full shape}`` of the parameters in ``module``."""
    return {
        f"model.{gname}": shard.global_shape
        for gname, _, shard in parameter_shards(module)
        if shard is not None
    }


# -- DCP planners that know global offsets -------------------------------------------------------


class GlobalSavePlanner(DefaultSavePlanner):
    """DCP's planner, with each sharded tensor written as the chunk at its global offsets.
    Identical chunks (replicas over DP, TP-replicated parameters) are written once."""

    def __init__(self, shards: dict[str, Shard]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.shards = shards

    def create_local_plan(self) -> SavePlan:
        items: list[WriteItem] = []
        for key, obj in self.state_dict.items():
            shard = self.shards.get(key)
            if shard is None or shard.offsets is None:
                items += _create_write_items(key, obj)
                continue
            chunk = ChunkStorageMetadata(
                offsets=torch.Size(shard.offsets), sizes=torch.Size(obj.shape)
            )
            items.append(
                WriteItem(
                    index=MetadataIndex(key, torch.Size(shard.offsets)),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=chunk,
                        properties=TensorProperties.create_from_tensor(obj),
                        size=torch.Size(shard.global_shape),
                    ),
                )
            )
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        return self.state_dict[index.fqn]


class GlobalLoadPlanner(DefaultLoadPlanner):
    """Reads, for each local shard, the overlapping pieces of the saved chunks."""

    def __init__(self, shards: dict[str, Shard]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.shards = shards

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        requests = []
        for key, obj in self.state_dict.items():
            stored = self.metadata.state_dict_metadata[key]
            shard = self.shards.get(key)
            if shard is None or shard.offsets is None:
                requests += _create_read_items(key, stored, obj)
                continue
            chunk = ChunkStorageMetadata(
                offsets=torch.Size(shard.offsets), sizes=torch.Size(obj.shape)
            )
            assert isinstance(stored, TensorStorageMetadata)  # a sharded entry is a tensor
            requests += create_read_items_for_chunk_list(key, stored, [chunk])
        return LoadPlan(requests)

    def lookup_tensor(self, index: MetadataIndex) -> Tensor:
        return self.state_dict[index.fqn]


class FaultyWriter(FileSystemWriter):
    """DCP's file writer with the ``shard`` / ``written`` fault points of
    :mod:`lightning_sp.training.commit` (inactive unless the variable is set)."""

    def __init__(self, path: Path, rank: int) -> None:
        super().__init__(path, sync_files=True, overwrite=True)
        self.fault_rank = rank  # the base class's ``rank`` is DCP's own (optional)

    def write_data(self, plan: SavePlan, planner: Any) -> Any:
        future = super().write_data(plan, planner)
        if commit.maybe_fault("shard", self.fault_rank):
            for result in future.value():  # leave this rank's files half written, then die
                file = Path(self.path) / result.storage_data.relative_path
                if file.exists():
                    with open(file, "r+b") as fh:
                        fh.truncate(file.stat().st_size // 2)
            commit.die("shard", self.fault_rank)
        commit.maybe_fault("written", self.fault_rank)
        return future


# -- reading and checking ------------------------------------------------------------------------


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
        if name in meta.model and meta.model[name] != value and name != "recompute":
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
