"""Saving and loading :mod:`~lightning_sp.checkpoint` checkpoints from every rank.

A save writes a fresh data directory with DCP (each rank its shards), then rank 0 records
``meta.json`` with file checksums and publishes the name by an atomic rename
(:mod:`~lightning_sp.checkpoint.commit`). With ``async_save`` the tensors are copied to CPU
memory and the step goes on while one background thread per rank writes them (DCP's
collectives on a separate gloo group) and publishes them when every rank has finished. Saves
and removals (``save_top_k``) run in that thread in the order they were asked for, so an old
checkpoint is never deleted before its successor is published; at most ``MAX_IN_FLIGHT``
saves wait there (a step checkpoint and ``last``), and the end of training waits for all.

A save that fails (a full disk, a directory gone unwritable, on any rank) raises
:class:`CheckpointSaveError` on every rank: one line naming the checkpoint, the first failing
rank and its error. The name it would have replaced still resolves to the previous save (the
rename never happened). DCP already carries a write error of any rank to all of them; what
only rank 0 does (the metadata, the rename) is agreed after the save, before ``save``
returns. With ``async_save`` the failure is agreed at the next save (or raised by the end of
training's wait, on the ranks that saw it).

A save that a signal broke is a stop, not a failed save: the signalled rank's interrupt may
surface as any error (``torch.save``'s writer turns a ``KeyboardInterrupt`` into a
``RuntimeError``), so every rank raises :class:`SaveStopped` instead, and the shutdown path
names the signal (exit 128 + N).
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

from lightning_sp.checkpoint import commit
from lightning_sp.checkpoint.dcp_planners import (
    FaultyWriter,
    GlobalLoadPlanner,
    GlobalSavePlanner,
)
from lightning_sp.checkpoint.format import META_FILE, Meta
from lightning_sp.checkpoint.shards import (
    buffer_entries,
    checkpoint_key,
    global_shapes,
    gpt_chunks,
    install_states,
    state_entries,
)
from lightning_sp.checkpoint.verify import check_architecture, check_shapes, file_checksums, verify
from lightning_sp.errors import ConfigError
from lightning_sp.optim.distributed import DistributedAdamW
from lightning_sp.parallel.config import ParallelConfig
from lightning_sp.runtime import shutdown

MAX_IN_FLIGHT = 2  # a step checkpoint and last.ckpt


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _broadcast(obj: Any) -> Any:
    if not _distributed():
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, 0)
    return holder[0]


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


STOPPED = "stopped by a signal"
"""A rank's part of the agreement on a save when its own signal broke that save."""


def _first_error(message: str | None) -> str | None:
    """The first rank's error message (in rank order), on every rank; :data:`STOPPED` when
    any rank's was (a stop outranks a failure it may have caused elsewhere)."""
    if not _distributed():
        return message
    messages: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(messages, message)
    return STOPPED if STOPPED in messages else next((m for m in messages if m), None)


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written: one line, the same on every rank (``cli.py`` prints
    it once and exits with code 4)."""


class SaveStopped(RuntimeError):
    """A save that a rank's signal broke: the run is stopping, not failing to save (``cli.py``
    reports the signal, or on rank 0 the signalled rank's exit)."""


def _raise_for(failure: str | None) -> None:
    """Raise what an agreed save outcome means: nothing, a stop, or a failed save."""
    if failure == STOPPED:
        raise SaveStopped(STOPPED)
    if failure:
        raise CheckpointSaveError(failure)


def save_failure(final: Path, error: BaseException) -> str:
    """One line for a failed save of ``final``: the first failing rank and its error (DCP's
    :class:`CheckpointException` holds every failing rank's) and what ``final`` still holds."""
    rank = _rank()
    if isinstance(error, CheckpointException) and error.failures:
        rank = min(error.failures)
        error = error.failures[rank][0]
    held = (
        f"{final.name} still holds the previous save"
        if final.is_symlink()
        else f"nothing was published as {final.name}"
    )
    return (
        f"saving checkpoint {final} failed on rank {rank}: {type(error).__name__}: {error}; {held}"
    )


def _failure_of(run: Callable[[], Any], final: Path) -> str | None:
    """Run ``run`` (a save of ``final``, or the wait for one): its failure's line
    (:func:`save_failure`), or None. A failure that was a signal's doing is a stop, not a
    failed save: when DCP wrapped a rank's ``KeyboardInterrupt`` into the
    :class:`CheckpointException` every rank raises, that exception goes on as it is (exit
    128 + N); when a signal interrupted this rank (:func:`shutdown.interrupted`) and its save
    failed in any other way (the interrupt turned into another error), the outcome is
    :data:`STOPPED`. (A SIGTERM during training interrupts nothing: the save that ends the
    step runs on, and its failure is a failed save.)"""
    try:
        run()
    except (Exception, CheckpointException) as error:
        failures = error.failures.values() if isinstance(error, CheckpointException) else ()
        if any(not isinstance(e, Exception) for e, _ in failures):
            raise
        return STOPPED if shutdown.interrupted() else save_failure(final, error)
    return None


def holds_base(module: nn.Module) -> bool:
    """Whether ``module``'s checkpoints hold its frozen weights: False for a module whose
    ``checkpoint_holds_base`` says so (a LoRA run from ``init_from``: adapters only, the base
    read again from ``init_from``), True otherwise."""
    return bool(getattr(module, "checkpoint_holds_base", True))


class Checkpointer:
    """One rank's side of saving and loading. Every rank calls every method, in step."""

    def __init__(self, async_save: bool = False) -> None:
        self.async_save = async_save
        self._group: dist.ProcessGroup | None = None
        self._pending: list[tuple[Future, Path]] = []
        self._failure: str | None = None  # an async save's, until the next save agrees on it
        self._executor_: ThreadPoolExecutor | None = None  # created on first use (picklable)

    @property
    def _executor(self) -> ThreadPoolExecutor:
        # one worker: saves (and removals) run in the order they were asked for, on every rank
        if self._executor_ is None:
            self._executor_ = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
        return self._executor_

    @property
    def rank(self) -> int:
        return _rank()

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
        rank = self.rank
        if self.async_save:  # a background save that failed since the last save, on any rank
            _raise_for(_first_error(self._failure))
        commit.count_save(rank)
        token = _broadcast(f"{meta.step:09d}-{uuid.uuid4().hex[:8]}")
        data = commit.data_directory(final, token)
        with_base = holds_base(module)
        tensors, shards, _ = state_entries(module, optimizers, for_load=False, with_base=with_base)
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
            error = _failure_of(
                lambda: self._write(state, writer, planner, None, final, data, meta), final
            )
            _raise_for(_first_error(error))  # also: the name is published when save returns
            return
        if self._group is None and _distributed():
            self._group = dist.new_group(backend="gloo")
        while len(self._pending) >= MAX_IN_FLIGHT:
            future, name = self._pending.pop(0)
            outcome = _failure_of(future.result, name)
            self._failure = self._failure or outcome
        staged = {k: v.detach().to("cpu", copy=True) if torch.is_tensor(v) else v
                  for k, v in state.items()}  # fmt: skip
        future = self._executor.submit(
            self._write, staged, writer, planner, self._group, final, data, meta
        )
        self._pending.append((future, final))

    def _write(
        self,
        state: dict[str, Any],
        writer: FaultyWriter,
        planner: GlobalSavePlanner,
        group: dist.ProcessGroup | None,
        final: Path,
        data: Path,
        meta: Meta,
    ) -> None:
        """DCP's save (collective over ``group``), then rank 0 publishes: every rank's shard
        writes and DCP's metadata are done when ``dcp.save`` returns on rank 0."""
        if self.rank == 0:  # crashed saves' leftovers of this name, before anyone writes
            with contextlib.suppress(OSError):  # cleanup only: the next save tries again
                commit.collect_garbage(final)
        if _distributed():
            dist.barrier(group=group)
        dcp.save(state, storage_writer=writer, planner=planner, process_group=group)
        if self.rank == 0:
            meta.checksums = file_checksums(data)
            (data / META_FILE).write_text(meta.dumps())
            commit.publish(final, data)

    def wait(self) -> None:
        """Block until every save in flight is written and published; a failure is raised as
        :class:`CheckpointSaveError` (or :class:`SaveStopped`) on the ranks that saw it (no
        collective: this runs in teardown, also on error paths)."""
        failure, self._failure = self._failure, None
        while self._pending:
            future, name = self._pending.pop(0)
            outcome = _failure_of(future.result, name)  # every save waited for
            failure = failure or outcome
        _raise_for(failure)

    def remove(self, final: Path) -> None:
        """Delete ``final`` (rank 0's job) after every save in flight is published."""
        if self.rank != 0:
            return
        if self._pending:
            self._pending.append((self._executor.submit(commit.remove, final), final))
        else:
            commit.remove(final)

    # -- load ------------------------------------------------------------------------------------

    def load(
        self,
        path: Path,
        module: nn.Module,
        optimizers: list[torch.optim.Optimizer],
        *,
        layout: ParallelConfig,
        model_config: dict[str, Any],
        rng_name: str,
    ) -> dict[str, Any]:
        """Load weights, persistent buffers and optimizer state in place into ``module`` and
        ``optimizers`` (any layout) and return Lightning's state, with this rank's ``rng``
        state when the layout is the one that saved it (:meth:`ParallelConfig.same_shards`)
        and so is the model's ``sequence_parallel`` (``model_config``'s against the
        recorded model's), and under ``missing_buffers`` the keys
        of the module's buffers the checkpoint lacks (saved before checkpoints held buffers;
        set to zero). Errors are one :class:`ConfigError`, the same on every rank."""
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
            chunks = gpt_chunks(module)
            if chunks:
                lora = getattr(module, "lora", None)  # a LoRA run's adapters are saved too
                check_architecture(metadata, meta, chunks[0].config, lora)
            shapes = global_shapes(module, holds_base(module))
            check_shapes(metadata, shapes, meta, model_config)
        except ConfigError as exc:
            error = str(exc)
        error = _first_error(error)
        if error:
            raise ConfigError(error)
        stored = metadata.state_dict_metadata
        tensors, shards, installs = state_entries(module, optimizers, for_load=True)
        state: dict[str, Any] = {
            k: v for k, v in tensors.items() if checkpoint_key(k, shards) in stored
        }
        state["lightning"] = None
        state["optim.param_groups"] = None
        # the dropout streams are per shard: the same layout and the same sequence parallelism
        # (the model config's: an SP rank's sharded stream draws for s/t tokens, not s)
        same_sp = meta.model.get("sequence_parallel") == model_config.get("sequence_parallel")
        if meta.layout.same_shards(layout) and same_sp and rng_name in stored:
            state[rng_name] = None
        dcp.load(state, storage_reader=FileSystemReader(data), planner=GlobalLoadPlanner(shards))
        missing = [k for k, _ in buffer_entries(module) if k not in stored]
        for key in missing:  # saved before checkpoints held buffers: they start at zero
            tensors[key].zero_()
        install_states(installs, {checkpoint_key(k, shards) for k in state})
        for optimizer in optimizers:
            if isinstance(optimizer, DistributedAdamW):
                optimizer.masters_from_weights()
        saved_groups = state["optim.param_groups"] if optimizers else []  # predict: none
        for optimizer, groups in zip(optimizers, saved_groups, strict=True):
            for group, saved in zip(optimizer.param_groups, groups, strict=True):
                group.update(saved)
        lightning: dict[str, Any] = state["lightning"]
        lightning["rng_streams"] = state.get(rng_name)
        lightning["checkpoint_layout"] = meta.layout
        lightning["missing_buffers"] = missing
        return lightning


def resumable_loader(dataloader: object) -> object:
    """Give a ``DataLoader`` whose sampler has ``state_dict`` / ``load_state_dict`` those two
    methods (delegating to the sampler), so that Lightning saves and restores the data position
    through its public loader protocol and does not warn that the loader is not resumable.
    Other loaders are returned unchanged."""
    sampler = getattr(dataloader, "sampler", None)
    has = all(callable(getattr(sampler, name, None)) for name in ("state_dict", "load_state_dict"))
    if sampler is not None and has and not callable(getattr(dataloader, "state_dict", None)):
        dataloader.state_dict = sampler.state_dict  # type: ignore[attr-defined]
        dataloader.load_state_dict = sampler.load_state_dict  # type: ignore[attr-defined]
    return dataloader
