"""``ParallelConfig``: how one training run is laid out over ranks, the one record of it.

Built and checked once, here (every size positive, the expert tensor parallel rule, and, once
the world size is known, t·c·p dividing it and e dividing d·c: :meth:`for_world_size`), then
passed whole: the strategy's arguments fill it (``MegatronSPStrategy(tensor_parallel_size=...,
...)``); at setup the strategy completes it for the world and builds this rank's
:class:`~lightning_sp.parallel.state.ParallelState` *from* it
(:meth:`~lightning_sp.parallel.state.ParallelState.from_config`), then pushes both into the
module. The planner's :class:`~lightning_sp.planner.layout.Layout` is one (with the model and
the batch beside it), activation shapes are built from one
(:meth:`~lightning_sp.model.config.GPTConfig.activation_shape`), a model is checked against one
(:func:`~lightning_sp.model.config_checks.check_model_layout`), and a checkpoint's
``meta.json`` records one (:mod:`lightning_sp.checkpoint`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from lightning_sp.errors import ConfigError, divisors, positive_int

SIZES = (
    "tensor_parallel_size", "pipeline_parallel_size", "virtual_pipeline_size",
    "context_parallel_size", "expert_parallel_size", "data_parallel_size", "num_microbatches",
)  # fmt: skip
"""The fields that are counts of ranks or micro-batches: each a positive integer."""


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

    num_microbatches: int = 1
    """Micro-batches per optimizer step under the pipeline schedule (each data-parallel
    rank's batch is split into this many); 1 without pipeline parallelism."""

    distributed_optimizer: bool = False
    """fp32 master weights and Adam moments sharded over the d·c ranks of dp x cp (ZeRO-1,
    Megatron's distributed optimizer; the d data-parallel ranks for c = 1)."""

    def __post_init__(self) -> None:
        """The checks of the record itself, the one place each is written: every size a
        positive integer, and the experts whole on every TP rank (1) or split over the whole
        TP group (``t``); one :class:`ConfigError` line for anything else."""
        for field in SIZES:
            positive_int(field, getattr(self, field))
        etp, t = self.expert_tensor_parallel_size, self.tensor_parallel_size
        if etp not in (1, t) or isinstance(etp, bool):
            valid = "1" if t == 1 else f"1 or {t}"
            raise ConfigError(
                f"expert_tensor_parallel_size={etp!r} must be {valid} (1: experts whole on every "
                f"tensor-parallel rank; tensor_parallel_size={t}: each expert's f_e split over "
                "the TP group)"
            )

    @property
    def world_size(self) -> int:
        """t·c·p·d ranks."""
        return self.model_parallel_size * self.data_parallel_size

    @property
    def model_parallel_size(self) -> int:
        """t·c·p: the ranks one replica of the model is spread over."""
        return self.tensor_parallel_size * self.context_parallel_size * self.pipeline_parallel_size

    @property
    def data_context_size(self) -> int:
        """d·c: the ranks of equal (pp, tp) coordinates, which hold the same model shard (the
        distributed optimizer's shards; expert parallelism folds into them)."""
        return self.data_parallel_size * self.context_parallel_size

    @property
    def expert_data_parallel_size(self) -> int:
        """d·c/e: the ranks that hold the same experts."""
        return self.data_context_size // self.expert_parallel_size

    def for_world_size(self, world_size: int) -> ParallelConfig:
        """This layout on ``world_size`` ranks, the one check of a layout against a world:
        d = world / (t·c·p); :class:`ConfigError` (one line) unless t·c·p divides the world
        and e divides the d·c data x context ranks it folds into."""
        t, p, c = self.tensor_parallel_size, self.pipeline_parallel_size, self.context_parallel_size
        model_parallel = self.model_parallel_size
        if world_size % model_parallel:
            what, sizes = (
                ("tensor_parallel_size * pipeline_parallel_size", "t * p")
                if c == 1
                else (
                    "tensor_parallel_size * pipeline_parallel_size * context_parallel_size",
                    "t * p * c",
                )
            )
            factors = [t, p] + ([c] if c > 1 else [])
            raise ConfigError(
                f"world size {world_size} is not divisible by {what} = "
                f"{' * '.join(map(str, factors))} = {model_parallel}; {sizes} must be one of "
                f"{divisors(world_size)}"
            )
        d = world_size // model_parallel
        e = self.expert_parallel_size
        if (d * c) % e:
            raise ConfigError(
                f"expert_parallel_size={e} does not divide the "
                f"data_parallel_size * context_parallel_size = {d * c} ranks it folds "
                f"into; expert_parallel_size must be one of {divisors(d * c)}"
            )
        return dataclasses.replace(self, data_parallel_size=d)

    def sequence_divisor(self, sequence_parallel: bool) -> int:
        """What every sequence length must be a multiple of on this layout (torchtitan's
        ``seq_len_divisor``): under context parallelism (``c > 1``) each sequence is cut into
        ``2c`` equal chunks (causal load balancing), and with sequence parallelism each rank's
        ``s/c`` tokens are split again over ``t``: ``lcm(2c, c·t)``; ``t`` with SP alone, 1
        with neither."""
        c, t = self.context_parallel_size, self.tensor_parallel_size
        need = 2 * c if c > 1 else 1
        return math.lcm(need, c * t) if sequence_parallel and t > 1 else need

    def check_sequence_length(self, seq_length: int, sequence_parallel: bool) -> None:
        """``seq_length`` (``model.config.seq_length``) a multiple of
        :meth:`sequence_divisor`: one-line :class:`ConfigError` otherwise, naming the nearest
        valid lengths (or, without context parallelism, ``sequence_parallel=False``)."""
        c, t, s = self.context_parallel_size, self.tensor_parallel_size, seq_length
        need = self.sequence_divisor(sequence_parallel)
        if not s % need:
            return
        if c == 1:  # SP alone: each rank holds s/t of the sequence
            raise ConfigError(
                f"seq_length={s} is not divisible by tensor_parallel_size={t} "
                f"with sequence_parallel=True; use a seq_length that is a multiple of {t} "
                "or sequence_parallel=False"
            )
        why = f"context_parallel_size={c} cuts each sequence into {2 * c} chunks"
        if need != 2 * c:
            why += f" and sequence parallelism splits each rank's s/c over tensor_parallel_size={t}"
        below, above = s // need * need, (s // need + 1) * need
        nearest = f"{below} or {above}" if below else f"{above}"
        raise ConfigError(
            f"model.config.seq_length={s} is not a multiple of {need} ({why}); use e.g. {nearest}"
        )

    def same_shards(self, other: ParallelConfig) -> bool:
        """Whether every rank holds the same shard under ``other`` (t, p, m, c, d, e and etp
        equal): a checkpoint's RNG streams are restored only then, and only if the model's
        sequence parallelism is also the same (the checkpointer compares that: it is the
        model config's, ``model.config.sequence_parallel``). Micro-batches and the
        optimizer's sharding change neither."""
        return _shard_fields(self) == _shard_fields(other)


def _shard_fields(config: ParallelConfig) -> tuple[int, ...]:
    return (
        config.tensor_parallel_size, config.pipeline_parallel_size,
        config.virtual_pipeline_size, config.context_parallel_size, config.data_parallel_size,
        config.expert_parallel_size, config.expert_tensor_parallel_size,
    )  # fmt: skip
