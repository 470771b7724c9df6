"""DCP planners that know global offsets, and DCP's file writer with the crash-test fault
points of :mod:`~lightning_sp.checkpoint.commit`."""

from __future__ import annotations

import errno
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
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

from lightning_sp.checkpoint import commit
from lightning_sp.checkpoint.shards import Shard, checkpoint_key


def _entry_names(shards: dict[str, Shard]) -> dict[tuple[str, tuple[int, ...]], str]:
    """``{(checkpoint key, offsets): entry}`` for the sharded entries (an entry's name differs
    from its key where a rank holds several chunks of one tensor)."""
    return {
        (checkpoint_key(entry, shards), shard.offsets): entry
        for entry, shard in shards.items()
        if shard.offsets is not None
    }


class GlobalSavePlanner(DefaultSavePlanner):
    """DCP's planner, with each sharded tensor written as the chunk at its global offsets.
    Identical chunks (replicas over DP, TP-replicated parameters) are written once."""

    def __init__(self, shards: dict[str, Shard]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.shards = shards
        self.entries = _entry_names(shards)

    def create_local_plan(self) -> SavePlan:
        items: list[WriteItem] = []
        for entry, obj in self.state_dict.items():
            shard = self.shards.get(entry)
            if shard is None or shard.offsets is None:
                items += _create_write_items(entry, obj)
                continue
            chunk = ChunkStorageMetadata(
                offsets=torch.Size(shard.offsets), sizes=torch.Size(obj.shape)
            )
            items.append(
                WriteItem(
                    index=MetadataIndex(
                        checkpoint_key(entry, self.shards), torch.Size(shard.offsets)
                    ),
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
        return self.state_dict[_entry(self.entries, index)]


class GlobalLoadPlanner(DefaultLoadPlanner):
    """Reads, for each local shard, the overlapping pieces of the saved chunks."""

    def __init__(self, shards: dict[str, Shard]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.shards = shards
        self.entries = _entry_names(shards)

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        requests = []
        for entry, obj in self.state_dict.items():
            shard, key = self.shards.get(entry), checkpoint_key(entry, self.shards)
            stored = self.metadata.state_dict_metadata[key]
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
        return self.state_dict[_entry(self.entries, index)]


def _entry(entries: dict[tuple[str, tuple[int, ...]], str], index: MetadataIndex) -> str:
    """The state-dict entry DCP's ``index`` (a checkpoint key and the chunk's offsets) names."""
    offsets = tuple(index.offset) if index.offset is not None else None
    return entries.get((index.fqn, offsets), index.fqn)  # type: ignore[arg-type]


class FaultyWriter(FileSystemWriter):
    """DCP's file writer with the ``full`` / ``interrupt`` / ``shard`` / ``written`` fault
    points of :mod:`~lightning_sp.checkpoint.commit` (inactive unless the variable
    is set)."""

    def __init__(self, path: Path, rank: int) -> None:
        super().__init__(path, sync_files=True, overwrite=True)
        self.fault_rank = rank  # the base class's ``rank`` is DCP's own (optional)

    def write_data(self, plan: SavePlan, planner: Any) -> Any:
        if commit.maybe_fault("full", self.fault_rank):
            raise OSError(errno.ENOSPC, "No space left on device (fault injection)")
        if commit.maybe_fault("interrupt", self.fault_rank):
            try:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(5)  # the handler raises KeyboardInterrupt here
            except KeyboardInterrupt as stop:
                raise RuntimeError("the write was interrupted (fault injection)") from stop
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
