"""Saving and loading :mod:`~lightning_sp.training.checkpoint` checkpoints from every rank.

A save writes a fresh data directory with DCP (each rank its shards), then rank 0 records
``meta.json`` with file checksums and publishes the name by an atomic rename
(:mod:`~lightning_sp.training.commit`). With ``async_save`` the tensors are copied to CPU
memory and the step goes on while a background thread writes them on a separate gloo group;
the rename happens when every rank has finished. At most one save is in flight: the next save,
a removal (``save_top_k``) and the end of training wait for it, so an old checkpoint is never
deleted before its successor is complete.
"""

from __future__ import annotations

import threading
import uuid
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader

from lightning_sp.errors import ConfigError
from lightning_sp.training import commit
from lightning_sp.training.checkpoint import (
    FaultyWriter,
    GlobalLoadPlanner,
    GlobalSavePlanner,
    Layout,
    Meta,
    check_shapes,
    file_checksums,
    global_shapes,
    install_states,
    state_entries,
    verify,
)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _broadcast(obj: Any) -> Any:
    if not _distributed():
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, 0)
    return holder[0]


def _first_error(message: str | None) -> str | None:
    """The first rank's error message (in rank order), on every rank."""
    if not _distributed():
        return message
    messages: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(messages, message)
    return next((m for m in messages if m), None)


def rng_key(pipeline_rank: int, data_rank: int, tensor_rank: int) -> str:
    """The key of one rank's RNG state (per rank: only the same layout restores it)."""
    return f"rng.pp{pipeline_rank}.dp{data_rank}.tp{tensor_rank}"


class Checkpointer:
    """One rank's side of saving and loading. Every rank calls every method, in step."""

    def __init__(self, async_save: bool = False) -> None:
        self.async_save = async_save
        self._group: dist.ProcessGroup | None = None
        self._pending: Future | None = None
        self._committer: threading.Thread | None = None
        self._commit_error: BaseException | None = None
        self._deferred_removals: list[Path] = []

    @property
    def rank(self) -> int:
        return dist.get_rank() if _distributed() else 0

    # -- save ------------------------------------------------------------------------------------

    def save(
        self,
        final: Path,
        module: nn.Module,
        optimizers: list[torch.optim.Optimizer],
        *,
        meta: Meta,
        lightning_state: dict[str, Any],
        rng: tuple[str, Any],
    ) -> None:
        """Write the checkpoint ``final`` (see the module docstring)."""
        self.wait()
        rank = self.rank
        commit.count_save(rank)
        token = _broadcast(f"{meta.step:09d}-{uuid.uuid4().hex[:8]}")
        data = commit.data_directory(final, token)
        if rank == 0:
            commit.collect_garbage(final)
            data.mkdir(parents=True)
        if _distributed():
            dist.barrier()
        tensors, shards, _ = state_entries(module, optimizers, for_load=False)
        state: dict[str, Any] = dict(tensors)
        state[rng[0]] = rng[1]
        state["optim.param_groups"] = [
            [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
            for opt in optimizers
        ]
        if rank == 0:
            state["lightning"] = lightning_state
        writer, planner = FaultyWriter(data, rank), GlobalSavePlanner(shards)
        if not self.async_save:
            dcp.save(state, storage_writer=writer, planner=planner)
            if rank == 0:
                self._publish(final, data, meta)
            if _distributed():
                dist.barrier()  # the name is published when save returns, on every rank
            return
        if self._group is None and _distributed():
            self._group = dist.new_group(backend="gloo")
        response = dcp.async_save(
            state, storage_writer=writer, planner=planner, process_group=self._group
        )
        future = getattr(response, "upload_completion", response)
        self._pending = future
        if rank == 0:
            self._committer = threading.Thread(
                target=self._publish_when_done, args=(future, final, data, meta), daemon=True
            )
            self._committer.start()

    def _publish(self, final: Path, data: Path, meta: Meta) -> None:
        meta.checksums = file_checksums(data)
        (data / "meta.json").write_text(meta.dumps())
        commit.publish(final, data)

    def _publish_when_done(self, future: Future, final: Path, data: Path, meta: Meta) -> None:
        try:
            future.result()  # every rank's writes and DCP's metadata are done
            self._publish(final, data, meta)
            for path in self._deferred_removals:
                commit.remove(path)
            self._deferred_removals.clear()
        except BaseException as error:
            self._commit_error = error

    def wait(self) -> None:
        """Block until the save in flight (if any) is written and published."""
        if self._pending is not None:
            self._pending.result()
            self._pending = None
        if self._committer is not None:
            self._committer.join()
            self._committer = None
        if self._commit_error is not None:
            error, self._commit_error = self._commit_error, None
            raise RuntimeError(f"saving the checkpoint failed: {error}") from error

    def remove(self, final: Path) -> None:
        """Delete ``final`` (rank 0's job) once the save in flight is published."""
        if self.rank != 0:
            return
        if self._committer is not None and self._committer.is_alive():
            self._deferred_removals.append(final)
        else:
            commit.remove(final)

    # -- load ------------------------------------------------------------------------------------

    def load(
        self,
        path: Path,
        module: nn.Module,
        optimizers: list[torch.optim.Optimizer],
        *,
        layout: Layout,
        model_config: dict[str, Any],
        rng_name: str,
    ) -> dict[str, Any]:
        """Load weights and optimizer state in place into ``module`` and ``optimizers`` (any
        layout) and return Lightning's state, with this rank's ``rng`` state when the layout
        is the one that saved it. Errors are one :class:`ConfigError`, the same on every rank."""
        error = None
        if self.rank == 0:
            try:
                verify(path)
            except ConfigError as exc:
                error = str(exc)
        error = _broadcast(error)
        if error:
            raise ConfigError(error)
        data = path.resolve()
        meta = Meta.read(data)
        metadata = FileSystemReader(data).read_metadata()
        try:
            check_shapes(metadata, global_shapes(module), meta, model_config)
        except ConfigError as exc:
            error = str(exc)
        error = _first_error(error)
        if error:
            raise ConfigError(error)
        stored = metadata.state_dict_metadata
        tensors, shards, installs = state_entries(module, optimizers, for_load=True)
        state: dict[str, Any] = {k: v for k, v in tensors.items() if k in stored}
        state["lightning"] = None
        state["optim.param_groups"] = None
        same_layout = meta.layout == layout
        if same_layout and rng_name in stored:
            state[rng_name] = None
        dcp.load(state, storage_reader=FileSystemReader(data), planner=GlobalLoadPlanner(shards))
        install_states(installs, set(state))
        for optimizer, groups in zip(optimizers, state["optim.param_groups"], strict=True):
            for group, saved in zip(optimizer.param_groups, groups, strict=True):
                group.update(saved)
        lightning: dict[str, Any] = state["lightning"]
        lightning["rng_streams"] = state.get(rng_name)
        lightning["checkpoint_layout"] = meta.layout
        return lightning
