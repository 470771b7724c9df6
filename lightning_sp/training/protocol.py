"""What ``MegatronSPStrategy`` drives: a LightningModule that builds its own model-parallel
shard, and the stage model it holds.

A LightningModule that satisfies :class:`ParallelModule` is trained with tensor, sequence
(and, if it says so, pipeline) parallelism. The strategy pushes, the module receives (as
Lightning's ``ModelParallelStrategy`` hands the module its device mesh): before
``configure_model`` the strategy calls ``setup_parallel(state, config)`` with this rank's
:class:`~lightning_sp.parallel.state.ParallelState` and the run's
:class:`~lightning_sp.parallel.config.ParallelConfig`; the module builds its shard from them
in ``configure_model`` and returns it from ``stage_model()``; after the last backward of a
step the strategy calls the shard's ``finalize_grads(buffer)``. What a module may read back:
:class:`BucketsGradients` of the strategy, :class:`Batched` of the data module.
:class:`~lightning_sp.training.gpt_module.GPTModule` holds a
:class:`~lightning_sp.pipeline.Pipeline` (for every ``p``, including 1);
``examples/custom_mlp.py`` shows a custom tensor-parallel model on ``lightning_sp.parallel``.

Any other LightningModule is trained as plain data parallelism (``t = p = c = 1`` only).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from lightning_sp.errors import ConfigError
from lightning_sp.parallel.buffer import GradBuffer, GradBufferConfig
from lightning_sp.parallel.config import ParallelConfig
from lightning_sp.parallel.state import ParallelState


@runtime_checkable
class StageModel(Protocol):
    """One rank's shard of a model-parallel model (an ``nn.Module``).

    Attributes:
        state: The parallel state the shard was built for.
    """

    state: ParallelState

    def finalize_grads(self, buffer: GradBuffer | None = None) -> None:
        """Every gradient reduction between the last backward of a step and the optimizer
        step: sequence-parallel parameters summed over the TP group, copies of tied weights
        summed, and every gradient averaged over the DP group, through the optimizer's
        bucketed ``buffer`` when it has one (for instance
        :func:`lightning_sp.parallel.grads.finalize_grads`)."""
        ...


@runtime_checkable
class ParallelModule(Protocol):
    """A LightningModule that ``MegatronSPStrategy`` can run beyond data parallelism.

    Attributes:
        supports_pipeline_parallel: Whether the module runs a pipeline schedule itself (its
            ``training_step`` does forward and backward of every micro-batch); the strategy
            refuses ``pipeline_parallel_size > 1`` otherwise.
    """

    supports_pipeline_parallel: bool

    def setup_parallel(self, state: ParallelState, config: ParallelConfig) -> None:
        """Receive this rank's parallel state and the run's layout (the data-parallel size
        decided), before ``configure_model``. Whether the shard is sequence parallel is the
        module's own setting (``GPTModule``: ``model.config.sequence_parallel``)."""
        ...

    def stage_model(self) -> StageModel:
        """This rank's shard, built in ``configure_model``; ``RuntimeError`` before that."""
        ...


def stage_model_of(module: object) -> StageModel | None:
    """``module.stage_model()`` if ``module`` is a :class:`ParallelModule` whose shard is
    built, else ``None`` (a plain module, or ``configure_model`` has not run yet)."""
    if not isinstance(module, ParallelModule):
        return None
    try:
        model = module.stage_model()
    except RuntimeError:
        return None
    return model if isinstance(model, StageModel) else None


def check_module(module: object, layout: ParallelConfig) -> None:
    """Refuse, in one line, a ``layout`` that ``module`` cannot be parallelised over: tensor,
    pipeline or context parallelism need a :class:`~lightning_sp.training.protocol.ParallelModule`
    (which builds its own shard; under CP it feeds its model each CP rank's chunks), pipeline
    parallelism one that says it runs a schedule."""
    sizes = {
        "tensor_parallel_size": layout.tensor_parallel_size,
        "pipeline_parallel_size": layout.pipeline_parallel_size,
        "context_parallel_size": layout.context_parallel_size,
    }
    if module is None or all(v == 1 for v in sizes.values()):
        return
    name = type(module).__name__
    if not isinstance(module, ParallelModule):
        field, value = next((k, v) for k, v in sizes.items() if v > 1)
        raise ConfigError(
            f"{field}={value} needs a module that builds its own model-parallel shard, but "
            f"{name} is a plain LightningModule; use tensor_parallel_size=1, "
            "pipeline_parallel_size=1 and context_parallel_size=1 (data parallelism), or "
            "implement lightning_sp.training.protocol.ParallelModule (see examples/custom_mlp.py)"
        )
    if sizes["context_parallel_size"] > 1 and not getattr(
        module, "supports_context_parallel", False
    ):
        raise ConfigError(
            f"context_parallel_size={layout.context_parallel_size} but {name} does not split its "
            "batches' sequences over the context-parallel group (supports_context_parallel is "
            "not True); use context_parallel_size=1"
        )
    if layout.pipeline_parallel_size > 1 and not module.supports_pipeline_parallel:
        raise ConfigError(
            f"pipeline_parallel_size={layout.pipeline_parallel_size} but {name} does not run a "
            "pipeline schedule (supports_pipeline_parallel=False); use pipeline_parallel_size=1"
        )


@runtime_checkable
class Batched(Protocol):
    """A data module that states its batch size per data-parallel rank
    (:class:`~lightning_sp.data.TextDataModule`)."""

    batch_size: int


@runtime_checkable
class BucketsGradients(Protocol):
    """A strategy that buckets gradients (``MegatronSPStrategy``): its record of how the
    optimizer's gradient buffer is built."""

    grad_buffer: GradBufferConfig
