"""``ShardModule``: the base of :class:`~lightning_sp.training.gpt_module.GPTModule` that holds
this rank's shard, one :class:`~lightning_sp.pipeline.Pipeline` of its model chunks: the
module's side of the :class:`~lightning_sp.training.protocol.ParallelModule` protocol (the
parallel state and layout the ``megatron_sp`` strategy pushes in, the stage model it drives),
or one process on the strategy's device under any other strategy.
"""

from __future__ import annotations

from lightning.pytorch import LightningModule

from lightning_sp.model.gpt import GPT
from lightning_sp.parallel.config import ParallelConfig
from lightning_sp.parallel.state import ParallelState
from lightning_sp.pipeline import Pipeline


class ShardModule(LightningModule):
    """A LightningModule holding this rank's model chunks (``GPTModule``, which builds
    :attr:`pipeline` in ``configure_model``)."""

    pipeline: Pipeline | None  # this rank's model chunks (one when p = 1)
    _parallel: tuple[ParallelState, ParallelConfig] | None  # pushed by megatron_sp

    supports_pipeline_parallel = True
    """The strategy may run this module with ``pipeline_parallel_size > 1``."""

    supports_context_parallel = True
    """The strategy may run this module with ``context_parallel_size > 1`` (each CP rank
    keeps its chunks of every batch)."""

    def setup_parallel(self, state: ParallelState, config: ParallelConfig) -> None:
        """Receive this rank's state and the run's layout from the strategy (the
        ``ParallelModule`` protocol); ``configure_model`` builds the shard from them."""
        self._parallel = (state, config)

    def stage_model(self) -> Pipeline:
        """This rank's model chunks (built in ``configure_model``)."""
        if self.pipeline is None:
            raise RuntimeError("the model is created in configure_model; run it through a Trainer")
        return self.pipeline

    @property
    def parallel_state(self) -> ParallelState:
        """The state the strategy pushed, else one process on the strategy's device."""
        if self._parallel is not None:
            return self._parallel[0]
        # the device the strategy will run on (this module is still on the CPU while
        # configure_model runs), so the model and its RNG streams are built there
        strategy = self._trainer.strategy if self._trainer is not None else None
        device = strategy.root_device if strategy is not None else self.device
        return ParallelState.single(device)

    @property
    def parallel_config(self) -> ParallelConfig:
        """The layout the strategy pushed, else one process (every size 1)."""
        if self._parallel is not None:
            return self._parallel[1]
        return ParallelConfig()

    @property
    def chunks(self) -> list[GPT]:
        """This rank's model chunks (one :class:`GPT` when ``p = 1``)."""
        return list(self.stage_model().chunks)
