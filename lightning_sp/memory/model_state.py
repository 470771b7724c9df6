"""Model-state memory: parameters per rank (by pipeline stage, tensor-, expert- and
expert-tensor-parallel shard), and the bytes of weights, gradients and optimizer state that
mixed-precision Adam keeps for them, with the distributed optimizer's (ZeRO-1) sharding over
data parallelism. Context parallelism shards none of them. The activation formulas are
:mod:`lightning_sp.memory.formulas`'.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_sp.model.config import GPTConfig
from lightning_sp.model.parts.block import block_of_shape
from lightning_sp.model.shape import ActivationShape
from lightning_sp.model.spec import NORMS, POSITIONS
from lightning_sp.parallel.config import ParallelConfig


@dataclass(frozen=True)
class ModelStatePrecision:
    """Bytes kept per parameter by mixed-precision Adam (Megatron's, and
    ``lightning_sp.optim.adamw``'s :class:`MasterWeightAdamW`; no distributed optimizer, so
    nothing is sharded over data parallelism). The defaults sum to 18 bytes per parameter."""

    param_bytes: float = 2
    """The model's low-precision (bf16) weights."""

    grad_bytes: float = 4
    """The fp32 gradient-accumulation buffer (``main_grad``); the bf16 ``.grad`` is freed as
    soon as it has been added into it, so it is not counted."""

    master_bytes: float = 4
    """The optimizer's fp32 master copy of the weights."""

    optimizer_bytes: float = 8
    """Adam's fp32 first and second moments, 4 bytes each."""

    @property
    def bytes_per_parameter(self) -> float:
        return self.param_bytes + self.grad_bytes + self.master_bytes + self.optimizer_bytes


MIXED_PRECISION_ADAM = ModelStatePrecision()


def layer_parameter_count(
    h: int,
    layout: ParallelConfig | None = None,
    ffn_hidden_size: int | None = None,
    config: GPTConfig | None = None,
) -> int:
    """Parameters of one transformer layer on one tensor-parallel rank of ``layout`` (None:
    one rank): the sum over the layer's parts (:meth:`~lightning_sp.model.parts.block.Block.
    parameters`); ``config`` gives the architecture (default: GPT's, with ``h`` and
    ``ffn_hidden_size``).

    Split by t: the attention and MLP weights (and their column-parallel biases); key/value
    heads replicated when there are fewer groups than ranks (``g' = max(g, t)``). Replicated:
    the row-parallel biases and both norms. For GPT at ``f = 4h, t = 1`` this is
    ``12h² + 13h``. Routed experts count ``f_e/t`` of their width under the layout's expert
    tensor parallelism.
    """
    if config is None:
        config = GPTConfig(hidden_size=h, num_heads=h, ffn_hidden_size=ffn_hidden_size)
    shape = _layer_shape(config, layout)
    return block_of_shape(shape).parameters(shape)


def _layer_shape(config: GPTConfig, layout: ParallelConfig | None) -> ActivationShape:
    """The shape the parameter counts read (t and the expert tensor parallel size of
    ``layout``; None: one rank), built once per count."""
    return config.activation_shape(layout)


def _layer_expert_parameters(shape: ActivationShape) -> int:
    """The routed experts' parameters of one layer on a tensor-parallel rank (all ``E`` of
    them, ``f_e/t`` wide under expert tensor parallelism ``etp = t``); 0 for a dense layer."""
    return block_of_shape(shape).expert_parameters(shape)


def stage_parameter_count(
    config: GPTConfig, layout: ParallelConfig | None = None, stage: int = 0
) -> int:
    """Parameters on one rank of pipeline stage ``stage`` of ``layout`` (None: one rank;
    tensor-parallel shards counted once).

    A stage holds ``L/p`` layers; the first also the word embedding (``v_pad/t × h``, the
    padded vocabulary) and the learned positions if any (``s × h``, replicated); the last the
    output layer (its own copy of the tied embedding, or its own weight, ``v_pad/t × h``) and
    the final norm. A mixture-of-experts layer's routed experts count ``1/e`` at expert-parallel
    size ``e``, and ``1/t`` more under expert tensor parallelism.
    """
    layout = ParallelConfig() if layout is None else layout
    return _stage_count(config, layout, _layer_shape(config, layout), stage)


def _stage_count(
    config: GPTConfig, layout: ParallelConfig, shape: ActivationShape, stage: int
) -> int:
    t, p, e = layout.tensor_parallel_size, layout.pipeline_parallel_size, shape.e
    h, layer = config.hidden_size, block_of_shape(shape).parameters(shape)
    if e > 1:  # a rank of an EP group holds E/e of each layer's routed experts
        experts = _layer_expert_parameters(shape)
        layer -= experts - experts // e
    count = config.num_layers // p * layer
    vocab = config.padded_vocab_size(t) // t * h
    if stage == 0:
        count += vocab + POSITIONS[config.position_embedding].parameters(config.seq_length, h)
    if stage == p - 1:
        count += NORMS[config.normalization].parameters(h)
        if p > 1 or not config.tie_embeddings:
            count += vocab
    return count


def parameters_per_rank(config: GPTConfig, layout: ParallelConfig | None = None) -> int:
    """The most parameters any rank of ``layout`` holds (the first stage: embedding,
    positions, ``L/p`` layers; with ``p = 1`` also the final LayerNorm); routed experts ``1/e``
    of them (and ``1/t`` of their width under expert tensor parallelism)."""
    layout = ParallelConfig() if layout is None else layout
    shape, p = _layer_shape(config, layout), layout.pipeline_parallel_size
    return max(_stage_count(config, layout, shape, stage) for stage in {0, p - 1})


def expert_parameters_per_rank(config: GPTConfig, layout: ParallelConfig | None = None) -> int:
    """Of :func:`parameters_per_rank`, the routed experts' (``L/p`` layers' ``1/e`` of them,
    ``f_e/t`` wide under expert tensor parallelism): the distributed optimizer shards their
    state over the ``d·c/e`` ranks holding them."""
    layout = ParallelConfig() if layout is None else layout
    experts = _layer_expert_parameters(_layer_shape(config, layout))
    return (
        config.num_layers
        // layout.pipeline_parallel_size
        * (experts // layout.expert_parallel_size)
    )


def model_parameter_count(config: GPTConfig) -> int:
    """Parameters of the whole model (the embedding once if tied, vocabulary padded as at
    t = 1)."""
    return stage_parameter_count(config)


def model_active_parameter_count(config: GPTConfig) -> int:
    """Parameters one token uses: :func:`model_parameter_count` less, per layer, the routed
    experts it is not sent to (all of them for a dense model)."""
    x = _layer_shape(config, None)
    block = block_of_shape(x)
    unused = block.expert_parameters(x) - block.active_expert_parameters(x)
    return model_parameter_count(config) - config.num_layers * unused


def model_state_bytes(
    num_parameters: int,
    precision: ModelStatePrecision = MIXED_PRECISION_ADAM,
    data_parallel_size: int = 1,
    distributed_optimizer: bool = False,
) -> float:
    """Weights + gradients + optimizer state for ``num_parameters`` parameters on one rank.

    With the distributed optimizer (ZeRO-1) the fp32 masters and Adam moments are split over
    the ``data_parallel_size`` ranks given (``d·c`` under context parallelism):
    ``2 + 4 + 12/d`` bytes per parameter by default.
    """
    n = num_parameters
    replicated = n * (precision.param_bytes + precision.grad_bytes)
    sharded = n * (precision.master_bytes + precision.optimizer_bytes)
    return replicated + (sharded / data_parallel_size if distributed_optimizer else sharded)


def distributed_optimizer_elements(bucket_numels: Sequence[int], d: int, rank: int) -> int:
    """Parameter elements whose optimizer state data-parallel ``rank`` keeps: each bucket of
    ``n`` elements is padded to a multiple of ``d`` and split in ``d`` equal shards (the
    padding belongs to no parameter). Times 12 bytes (fp32 master, exp_avg, exp_avg_sq) is a
    rank's optimizer state; summed over ranks it is every element once."""
    total = 0
    for n in bucket_numels:
        per = -(-n // d)
        total += max(0, min(n, (rank + 1) * per) - rank * per)
    return total
