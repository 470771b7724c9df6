"""``ProcessGroupStrategy``: one process per device and a default process group, started the
way Lightning's DDP starts them, with nothing wrapped.

This is the plumbing under :class:`~lightning_sp.training.strategy.MegatronSPStrategy`: which
launcher starts the processes (Lightning's subprocess launcher, as ``ddp``, or its spawn
launcher; none under SLURM or torchrun, which start them themselves), each process's ranks and
CPU threads, the default process group with a timeout, and the collectives Lightning asks a
strategy for (barrier, broadcast, reduce). What runs inside the processes (the layout, the
step, checkpoints) is the subclass's.
"""

from __future__ import annotations

import datetime
import multiprocessing
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from typing_extensions import override

from lightning_sp.parallel.release import release_process_groups
from lightning_sp.parallel.threads import set_rank_threads
from lightning_sp.runtime import shutdown

if TYPE_CHECKING:
    import lightning.pytorch as pl


class ProcessGroupStrategy(ParallelStrategy):
    """One process per device in one default process group; the model is not wrapped.

    Args:
        timeout: Seconds a collective may wait before it fails.
        process_group_backend: ``gloo`` or ``nccl``; ``None``: chosen from the device.
        start_method: ``popen`` (re-run the script per rank, as ``ddp``) or ``spawn``.
    """

    def __init__(
        self,
        timeout: float = 600.0,
        process_group_backend: str | None = None,
        start_method: str = "popen",
    ) -> None:
        super().__init__()
        self.timeout = datetime.timedelta(seconds=timeout)
        self._process_group_backend = process_group_backend
        self._start_method = start_method
        self._num_nodes = 1
        self._failed = False  # an exception is ending this process: no barrier in teardown

    def check_before_launch(self) -> None:
        """Refuse a configuration that cannot run, before any process starts (the Trainer is
        being built). Subclasses add their checks."""

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def total_processes(self) -> int:
        """Processes over all nodes (Lightning's ``world_size`` says so only once the ranks
        are set)."""
        return self.num_nodes * self.num_processes

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    @override
    def _configure_launcher(self) -> None:
        self.check_before_launch()
        assert self.cluster_environment is not None
        if self.cluster_environment.creates_processes_externally:
            return
        if self._start_method == "spawn":
            self._launcher = _MultiProcessingLauncher(self, start_method="spawn")
        else:
            self._launcher = shutdown.WatchedLauncher(
                self.cluster_environment, self.num_processes, self.num_nodes
            )

    @override
    def setup_environment(self) -> None:
        """In each process: its ranks, CPU threads and seed, then the default process group
        (with ``timeout``; NCCL bound to this process's device)."""
        super().setup_environment()
        shutdown.install()
        set_rank_threads(self.num_processes)  # this host's cores shared among its ranks
        reset_seed()
        self.set_world_ranks()
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(
            self.root_device
        )
        self._process_group_backend = backend
        kwargs: dict[str, Any] = {"timeout": self.timeout}
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        assert self.cluster_environment is not None
        _init_dist_connection(self.cluster_environment, backend, **kwargs)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(
                self.node_rank * self.num_processes + self.local_rank
            )
            self.cluster_environment.set_world_size(self.total_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        """The model in the precision's dtype on this process's device, and (when fitting)
        its optimizers; nothing is wrapped."""
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # -- collectives Lightning asks for ------------------------------------------------------

    @override
    def barrier(self, name: str | None = None) -> None:
        if _distributed_is_initialized():
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        holder = [obj]
        dist.broadcast_object_list(holder, src)
        return holder[0]

    @override
    def reduce(
        self,
        tensor: Tensor | Any,
        group: Any | None = None,
        reduce_op: ReduceOp | str | None = "mean",
    ) -> Tensor | Any:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    # -- how the run ends (lightning_sp.runtime.shutdown) ------------------------------------

    @override
    def on_train_start(self) -> None:
        """Our signal handlers replace Lightning's (registered just before training), whose
        SIGTERM handler runs a collective inside the handler."""
        shutdown.install()
        shutdown.set_training(True)

    @override
    def on_train_end(self) -> None:
        shutdown.set_training(False)

    @override
    def on_exception(self, exception: BaseException) -> None:
        """An exception ends this rank: teardown skips its barrier (a peer may be dead or
        blocked in a collective this rank will never join)."""
        self._failed = True
        shutdown.set_training(False)
        shutdown.stopping()

    @override
    def teardown(self) -> None:
        # no rank may leave while a peer's last collective is in flight: gloo aborts the peer;
        # after an exception, though, a peer may never arrive: leave at once
        if _distributed_is_initialized() and not self._failed:
            dist.barrier()
        super().teardown()
        if self._start_method == "spawn" and multiprocessing.parent_process() is not None:
            # a rank the spawn launcher started ends when its function returns, by the
            # interpreter's finalization, where a gloo worker freeing a tensor aborts it
            # (SIGABRT: lightning_sp.parallel.release): its groups are ended here, while alive
            release_process_groups()
