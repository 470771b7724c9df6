"""``MegatronSPStrategy``: tensor, sequence and pipeline parallelism (with data parallelism
over the rest of the world) for Lightning, registered as ``"megatron_sp"``.

The strategy owns the process groups. Its base,
:class:`~lightning_sp.training.processes.ProcessGroupStrategy`, starts the processes and the
default process group the way Lightning's DDP does (its subprocess/spawn launchers, SLURM,
torchrun); this class holds the run's layout (a
:class:`~lightning_sp.parallel.config.ParallelConfig` made from its arguments), builds this
rank's :class:`~lightning_sp.ParallelState` on a ``("pp", "dp", "cp", "tp")`` device mesh,
and
pushes both into the LightningModule before ``configure_model`` (as Lightning's
``ModelParallelStrategy`` pushes its device mesh). It wraps nothing.

What it parallelises: a LightningModule implementing
:class:`~lightning_sp.training.protocol.ParallelModule` builds its own shard (``GPTModule``: a
:class:`~lightning_sp.pipeline.Pipeline`, which also runs the pipeline schedule when ``p > 1``);
after the last backward of a step the strategy calls that shard's ``finalize_grads``
(sequence-parallel gradients summed over the TP group, the tied embedding's two copies over
the first and last pipeline stage, all gradients averaged over the DP group and, under context
parallelism, summed over the CP group), then lets the optimizer step. Any other
LightningModule runs as plain data parallelism (``t = p = c = 1`` only, else refused at setup
in one line): its parameters and buffers are broadcast from
data-parallel rank 0 before the first step and its gradients averaged.

Checkpoints are layout-independent DCP directories published by an atomic rename
(:mod:`lightning_sp.checkpoint`); a non-finite loss or gradient stops the run or
skips the step (:mod:`~lightning_sp.runtime.guard`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import StrategyRegistry
from torch.optim import Optimizer
from typing_extensions import override

from lightning_sp.checkpoint import Checkpointer
from lightning_sp.checkpoint.checkpointer import resumable_loader
from lightning_sp.errors import ConfigError
from lightning_sp.model.hooks import stepped_modules, stepped_state
from lightning_sp.optim.adamw import grad_buffer_of
from lightning_sp.parallel.buffer import DEFAULT_BUCKET_NUMEL, GradBuffer, GradBufferConfig
from lightning_sp.parallel.grads import finalize_grads, flat_grads
from lightning_sp.parallel.state import ParallelState
from lightning_sp.runtime import shutdown
from lightning_sp.runtime.guard import NonFiniteGuard
from lightning_sp.training.checkpoint_io import load_lightning_checkpoint, save_lightning_checkpoint
from lightning_sp.training.checks import (
    check_moved_strategy_args,
    check_precision,
    check_strategy_args,
)
from lightning_sp.training.processes import ProcessGroupStrategy
from lightning_sp.training.protocol import ParallelModule, check_module, stage_model_of

if TYPE_CHECKING:
    import lightning.pytorch as pl


@torch.no_grad()
def broadcast_module_state(module: torch.nn.Module, state: ParallelState) -> None:
    """Copy every parameter and buffer of data-parallel rank 0 to the other replicas (as DDP
    does when it wraps a model), so replicas that initialised differently start equal."""
    if state.dp_group is None:
        return
    for tensor in [*module.parameters(), *module.buffers()]:
        dist.broadcast(tensor.data, group=state.dp_group, group_src=0)


class MegatronSPStrategy(ProcessGroupStrategy):
    """Tensor + sequence (+ pipeline) parallel training of a ``lightning_sp.GPT``.

    Args:
        tensor_parallel_size: Ranks in one tensor-parallel group (t). They should share a node.
        pipeline_parallel_size: Pipeline stages (p). The data-parallel size is
            world size / (t * c * p).
        context_parallel_size: Ranks each sample's sequence is split over (c, context
            parallelism): the sequence is cut into 2c chunks and CP rank r holds chunks r and
            2c-1-r (causal load balancing); attention exchanges keys and values over the
            group. The mesh is (pp, dp, cp, tp), TP innermost. ``model.config.seq_length``
            must be divisible by 2c (and by 2c·t with sequence parallelism). Gradients are
            summed over the CP group and averaged over the DP group.
        expert_parallel_size: Ranks sharing out each mixture-of-experts layer's experts (e),
            folded into the data x context ranks (e divides d·c and the number of experts);
            tokens reach their experts by all-to-all.
        expert_tensor_parallel_size: 1 (experts whole on every TP rank) or t (each expert's
            f_e split over the TP group, gate/up column and down row parallel).
        num_microbatches: Micro-batches per optimizer step; each step's batch (per
            data-parallel rank) is split into this many.
        virtual_pipeline_size: Model chunks per pipeline stage (m) for the interleaved
            schedule; 1 is plain 1F1B.
        timeout: Seconds a collective may wait before it fails (every process group).
        process_group_backend: ``gloo`` or ``nccl``; by default chosen from the device.
        start_method: ``popen`` (re-run the script per rank, as ``ddp``) or ``spawn``.
        async_save: Write checkpoints in a background thread (DCP ``async_save``): the step
            waits only for a copy of the state to CPU memory, not for the disk.
        nonfinite: What a non-finite loss or gradient norm does: ``stop`` (default: the run
            ends with one line naming the step, the ranks and the quantity, and no
            checkpoint of that state is written) or ``skip`` (the step's update is dropped,
            as Megatron does, and counted in ``train/skipped_steps``).
        max_skipped_steps: With ``nonfinite: skip``, how many steps in a row may be skipped
            before the run stops anyway.
        bucket_size: Elements per gradient bucket: gradients live in one contiguous buffer per
            dtype, and each bucket's data-parallel all-reduce starts as soon as backward has
            produced its last gradient (:mod:`lightning_sp.parallel.buffer`).
        overlap_grad_reduce: Launch the buckets' reductions during backward; off, they all
            run after it (the same result).
        distributed_optimizer: Shard the fp32 master weights and Adam moments over
            data-parallel ranks (ZeRO-1, Megatron's distributed optimizer): gradients are
            reduce-scattered, each rank steps its 1/d and the weights are all-gathered
            (:mod:`lightning_sp.optim.distributed`). Under context parallelism over
            the d·c ranks of dp x cp: each steps its 1/(d·c).
    """

    strategy_name = "megatron_sp"

    def __init__(
        self,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        context_parallel_size: int = 1,
        expert_parallel_size: int = 1,
        expert_tensor_parallel_size: int = 1,
        num_microbatches: int = 1,
        virtual_pipeline_size: int = 1,
        timeout: float = 600.0,
        process_group_backend: str | None = None,
        start_method: str = "popen",
        async_save: bool = False,
        nonfinite: str = "stop",
        max_skipped_steps: int = 10,
        bucket_size: int = DEFAULT_BUCKET_NUMEL,
        overlap_grad_reduce: bool = True,
        distributed_optimizer: bool = False,
        **kwargs: Any,
    ) -> None:
        if kwargs:  # a typo: one line naming it and the valid names (this signature's)
            check_moved_strategy_args(kwargs)  # or a setting that lives elsewhere now
            name = next(iter(kwargs))
            valid = [p for p in inspect.signature(MegatronSPStrategy).parameters if p != "kwargs"]
            raise ConfigError(
                f"MegatronSPStrategy got an unknown argument {name}={kwargs[name]!r}; "
                f"valid: {', '.join(valid)}"
            )
        layout = check_strategy_args(
            tensor_parallel_size=tensor_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size,
            context_parallel_size=context_parallel_size,
            expert_parallel_size=expert_parallel_size,
            expert_tensor_parallel_size=expert_tensor_parallel_size,
            num_microbatches=num_microbatches,
            virtual_pipeline_size=virtual_pipeline_size,
            timeout=timeout,
            process_group_backend=process_group_backend,
            start_method=start_method,
            async_save=async_save,
            nonfinite=nonfinite,
            max_skipped_steps=max_skipped_steps,
            bucket_size=bucket_size,
            overlap_grad_reduce=overlap_grad_reduce,
            distributed_optimizer=distributed_optimizer,
        )
        super().__init__(timeout, process_group_backend, start_method)
        self.parallel_config = layout
        """The layout: as given until setup, then completed (``data_parallel_size`` from the
        world size) and pushed into the module."""
        self._parallel_state: ParallelState | None = None
        self.checkpointer = Checkpointer(async_save=async_save)
        self.guard = NonFiniteGuard(nonfinite, max_skipped_steps)
        self.grad_buffer = GradBufferConfig(bucket_size, overlap_grad_reduce, distributed_optimizer)
        """How gradients are bucketed and reduced; the module's optimizer builds its buffer
        from this record."""
        self._stepped: tuple[torch.nn.Module, list[torch.Tensor]] | None = None
        """The module the guard last read and the state it moves after each step."""
        self._guarded: tuple[GradBuffer, list[torch.Tensor] | None] | None = None
        """The buffer the guard last read and its flat storage (``flat_grads``, once per
        buffer: the per-parameter walk does not run every step)."""

    # -- layout ------------------------------------------------------------------------------

    @property
    def parallel_state(self) -> ParallelState:
        """This rank's :class:`ParallelState` (available from ``configure_model`` on)."""
        if self._parallel_state is None:
            raise RuntimeError("the parallel state exists once the processes have started")
        return self._parallel_state

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # data is sharded over data-parallel replicas only: the TP/PP/CP ranks of one replica
        # read the same samples (CP ranks then keep their chunks: GPTModule)
        state = self.parallel_state
        return {"num_replicas": state.data_parallel_size, "rank": state.data_parallel_rank}

    @override
    def check_before_launch(self) -> None:
        check_precision(self.precision_plugin.precision)
        self.parallel_config.for_world_size(self.total_processes)  # t·c·p divides the world

    @override
    def setup_environment(self) -> None:
        """Check the layout and the module, start the process group, build this rank's
        :class:`ParallelState` on the ``("pp", "dp", "cp", "tp")`` mesh, and push it with the
        completed :attr:`parallel_config` into a :class:`ParallelModule` (before Lightning
        calls its ``configure_model``)."""
        module = self.lightning_module
        self.parallel_config = config = self.parallel_config.for_world_size(self.total_processes)
        check_module(module, config)
        receiver = module if isinstance(module, ParallelModule) else None
        super().setup_environment()
        self._parallel_state = state = ParallelState.from_config(
            config, device=self.root_device, timeout=self.timeout
        )
        if receiver is not None:
            receiver.setup_parallel(state, config)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        assert self.model is not None
        if not isinstance(self.lightning_module, ParallelModule):
            broadcast_module_state(self.model, self.parallel_state)

    # -- the step ----------------------------------------------------------------------------

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        """Run the closure (forward + backward), finish the gradients, then step.

        The reductions run inside the closure, so Lightning's gradient clipping, which
        follows the closure, sees the finished gradients.
        """
        module = model if model is not None else self.lightning_module
        assert module is not None
        stage = stage_model_of(module)

        buffer = grad_buffer_of(optimizer)

        def closure_then_reduce() -> Any:
            result = closure()
            if stage is not None:  # e.g. a Pipeline: also sums the tied embedding's copies
                stage.finalize_grads(buffer)
            else:  # plain data parallelism
                finalize_grads(module, self.parallel_state, buffer)
            return result

        # forward + backward first, so that a non-finite step can be dropped before AdamW
        result = closure_then_reduce()
        pl_module = self.lightning_module
        step = pl_module.trainer.global_step if pl_module is not None else 0
        ok = self.guard.check(
            result, module, optimizer, step, shutdown.received(),
            self._guard_grads(module, buffer), self._guard_state(module),
        )  # fmt: skip
        if self.guard.stop_signal and pl_module is not None:  # every rank stops after this step
            shutdown.agree(self.guard.stop_signal)
            pl_module.trainer.should_stop = True
        if not ok:
            if pl_module is not None:
                pl_module.log("train/skipped_steps", float(self.guard.total_skipped))
            return result
        return super().optimizer_step(optimizer, lambda: result, model, **kwargs)

    def _guard_state(self, module: torch.nn.Module) -> list[torch.Tensor]:
        """The tensors ``module``'s modules move after each optimizer step (the MoE routers'
        expert biases), found once per module: the guard checks them finite at every step."""
        if self._stepped is None or self._stepped[0] is not module:
            self._stepped = (module, stepped_state(stepped_modules(module)))
        return self._stepped[1]

    def _guard_grads(
        self, module: torch.nn.Module, buffer: GradBuffer | None
    ) -> list[torch.Tensor] | None:
        """The tensors holding all of ``module``'s gradients, for the guard: ``buffer``'s flat
        storage when it holds them all (worked out once per buffer), else ``None`` (the guard
        reads the parameters)."""
        if buffer is None:
            return None
        if self._guarded is None or self._guarded[0] is not buffer:
            self._guarded = (buffer, flat_grads(module.parameters(), buffer))
        return self._guarded[1]

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Lightning's gradient accumulation: backward passes inside this block only
        accumulate; the bucketed reduction starts on the last micro-batch's backward."""
        buffers = [b for o in self.optimizers if (b := grad_buffer_of(o)) is not None]
        for buffer in buffers:
            buffer.sync = False
        try:
            yield
        finally:
            for buffer in buffers:
                buffer.sync = True

    # -- checkpoints -------------------------------------------------------------------------

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return True

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str | Path, storage_options: Any = None
    ) -> None:
        """Write a checkpoint (:mod:`lightning_sp.checkpoint`); every rank calls this.
        Weights and optimizer state are taken from the live module and optimizers
        (:func:`~lightning_sp.training.checkpoint_io.save_lightning_checkpoint`)."""
        assert self.lightning_module is not None
        path = Path(self.broadcast(str(filepath)))
        save_lightning_checkpoint(
            self.checkpointer, self.lightning_module, self.optimizers, checkpoint, path,
            self.parallel_config, self.parallel_state,
        )  # fmt: skip

    @override
    def load_checkpoint(
        self, checkpoint_path: str | Path, weights_only: bool | None = None
    ) -> dict:
        """Load weights, persistent buffers and optimizer state in place (any saved layout)
        and return Lightning's state; the RNG streams come back only into the layout that
        saved them (:func:`~lightning_sp.training.checkpoint_io.load_lightning_checkpoint`)."""
        assert self.lightning_module is not None
        return load_lightning_checkpoint(
            self.checkpointer, self.lightning_module, self.optimizers, checkpoint_path,
            self.parallel_config, self.parallel_state,
        )  # fmt: skip

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """The weights were loaded in place by :meth:`load_checkpoint`."""

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """The optimizer state was loaded in place by :meth:`load_checkpoint`."""

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """A loader with a stateful sampler resumes through Lightning's loader protocol."""
        return resumable_loader(dataloader)

    @override
    def remove_checkpoint(self, filepath: str | Path) -> None:
        """Delete a checkpoint once the save in flight (if any) is published."""
        self.checkpointer.remove(Path(filepath))

    @override
    def teardown(self) -> None:
        self.checkpointer.wait()
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            "megatron_sp", cls, description="Megatron tensor/sequence parallelism (popen launcher)"
        )
        strategy_registry.register(
            "megatron_sp_spawn",
            cls,
            description="Megatron tensor/sequence parallelism (spawn launcher)",
            start_method="spawn",
        )


def register() -> None:
    """Register ``"megatron_sp"`` and ``"megatron_sp_spawn"`` in Lightning's registry."""
    if "megatron_sp" not in StrategyRegistry:
        MegatronSPStrategy.register_strategies(StrategyRegistry)
