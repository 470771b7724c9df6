"""``ParallelConfig``: how one training run is laid out over ranks, the one record of it.

The strategy's arguments fill it (``MegatronSPStrategy(tensor_parallel_size=..., ...)``); at
setup the strategy completes it (the data-parallel size from the world size, sequence
parallelism agreed with the module's) and pushes it, with the rank's
:class:`~lightning_sp.parallel.state.ParallelState`, into the module. The planner's
:class:`~lightning_sp.planner.layout.Layout` holds one beside the model config and the batch,
and a checkpoint's ``meta.json`` records one (:mod:`lightning_sp.checkpoint`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from lightning_sp.errors import ConfigError, positive_int
from lightning_sp.parallel.state import (
    check_expert_layout,
    check_expert_tensor_parallel,
    check_layout,
)


@dataclass(frozen=True)
class ParallelConfig:
    """The sizes and switches of a run's layout; ``t·c·p·d`` ranks in all."""

    tensor_parallel_size: int = 1
    """t: ranks in one tensor-parallel group (they should share a node)."""

    pipeline_parallel_size: int = 1
    """p: pipeline stages."""

    virtual_pipeline_size: int = 1
    """m: model chunks per pipeline stage; ``> 1`` runs the interleaved schedule."""

    context_parallel_size: int = 1
    """c: ranks each sample's sequence is split over (context parallelism, causal load
    balancing: CP rank r holds chunks r and 2c-1-r of the sequence cut into 2c); the mesh is
    (pp, dp, cp, tp), TP innermost."""

    expert_parallel_size: int = 1
    """e: ranks sharing out each mixture-of-experts layer's experts (E/e each), folded into
    the d·c data x context ranks (:mod:`lightning_sp.parallel.state`): e must divide d·c and
    the model's number of experts. Their gradients are reduced over the d·c/e ranks holding
    the same ones."""

    expert_tensor_parallel_size: int = 1
    """Ranks each expert's inner dimension ``f_e`` is split over: 1 (experts whole on every
    tensor-parallel rank, each routing its own sequence shard) or t (gate/up column parallel,
    down row parallel over the TP group, which gathers the micro-batch shard's tokens around
    the layer and reduce-scatters its output)."""

    data_parallel_size: int = 1
    """d = world size / (t·c·p): replicas of the model. The strategy's arguments leave it 1
    until the world size is known (:meth:`for_world_size`, at setup)."""

    sequence_parallel: bool | None = None
    """Shard LayerNorm/dropout activations along the sequence over the tensor-parallel group
    (paper §4.2.2). ``None``: not decided here, the module's model decides
    (``GPTModule``: ``model.config.sequence_parallel``); the strategy resolves it at setup, so
    a running layout, the planner's and a checkpoint's always hold a bool."""

    num_microbatches: int = 1
    """Micro-batches per optimizer step under the pipeline schedule (each data-parallel
    rank's batch is split into this many); 1 without pipeline parallelism."""

    distributed_optimizer: bool = False
    """fp32 master weights and Adam moments sharded over the d·c ranks of dp x cp (ZeRO-1,
    Megatron's distributed optimizer; the d data-parallel ranks for c = 1)."""

    def __post_init__(self) -> None:
        for field in ("tensor_parallel_size", "pipeline_parallel_size", "virtual_pipeline_size",
                      "context_parallel_size", "expert_parallel_size", "data_parallel_size",
                      "num_microbatches"):  # fmt: skip
            positive_int(field, getattr(self, field))
        check_expert_tensor_parallel(self.expert_tensor_parallel_size, self.tensor_parallel_size)

    @property
    def world_size(self) -> int:
        """t·c·p·d ranks."""
        return (
            self.tensor_parallel_size * self.context_parallel_size
            * self.pipeline_parallel_size * self.data_parallel_size
        )  # fmt: skip

    def for_world_size(self, world_size: int) -> ParallelConfig:
        """This layout on ``world_size`` ranks: d = world / (t·c·p), :class:`ConfigError` (one
        line) unless t·c·p divides the world and e divides d·c."""
        d = check_layout(
            world_size, self.tensor_parallel_size, self.pipeline_parallel_size,
            self.context_parallel_size,
        )  # fmt: skip
        check_expert_layout(d * self.context_parallel_size, self.expert_parallel_size)
        return dataclasses.replace(self, data_parallel_size=d)

    def with_sequence_parallel(self, model_value: bool) -> ParallelConfig:
        """The layout with sequence parallelism decided: the model's ``model_value`` when this
        layout leaves it open, else this layout's, which must agree (:class:`ConfigError`)."""
        return dataclasses.replace(
            self, sequence_parallel=resolve_sequence_parallel(self.sequence_parallel, model_value)
        )

    def check_sequence_length(self, seq_length: int, sequence_parallel: bool) -> None:
        """Under context parallelism (``c > 1``) every sequence is cut into ``2c`` equal
        chunks, and with sequence parallelism each rank's ``s/c`` tokens are split again over
        ``t``: ``seq_length`` (``model.config.seq_length``) must be a multiple of ``2c`` (with
        SP, of ``lcm(2c, c·t)``). One-line :class:`ConfigError` otherwise, naming the nearest
        valid lengths."""
        c, t, s = self.context_parallel_size, self.tensor_parallel_size, seq_length
        if c == 1:
            return
        need = 2 * c
        why = f"context_parallel_size={c} cuts each sequence into {need} chunks"
        if sequence_parallel and t > 1:
            need = math.lcm(need, c * t)
            why += f" and sequence parallelism splits each rank's s/c over tensor_parallel_size={t}"
        if s % need:
            below, above = s // need * need, (s // need + 1) * need
            nearest = f"{below} or {above}" if below else f"{above}"
            raise ConfigError(
                f"model.config.seq_length={s} is not a multiple of {need} ({why}); use e.g. "
                f"{nearest}"
            )

    def same_shards(self, other: ParallelConfig) -> bool:
        """Whether every rank holds the same shard and dropout streams under ``other`` (t, p,
        m, c, d and SP equal): a checkpoint's RNG streams are restored only then. Micro-batches
        and the optimizer's sharding change neither."""
        return _shard_fields(self) == _shard_fields(other)


def resolve_sequence_parallel(strategy_value: bool | None, model_value: bool) -> bool:
    """Sequence parallelism is set in one place: the strategy's ``sequence_parallel`` when it
    is given must equal the model config's (:class:`ConfigError`, one line, if not); left
    ``None`` the model's value holds."""
    if strategy_value is None or strategy_value == model_value:
        return model_value
    raise ConfigError(
        f"trainer.strategy.sequence_parallel={strategy_value} conflicts with "
        f"model.config.sequence_parallel={model_value}; set it in one place "
        "(model.config.sequence_parallel) and leave the strategy's unset"
    )


def _shard_fields(config: ParallelConfig) -> tuple[int | bool | None, ...]:
    return (
        config.tensor_parallel_size, config.pipeline_parallel_size,
        config.virtual_pipeline_size, config.context_parallel_size, config.data_parallel_size,
        config.expert_parallel_size, config.expert_tensor_parallel_size, config.sequence_parallel,
    )  # fmt: skip
