"""What a part's module is built from: the config it reads (:class:`LayerConfig`) and the one
record passed whole to every part's constructor (:class:`BuildContext`: ``Attention(ctx)``,
``MLP(ctx)``, ``MoE(ctx, moe)``, ``TransformerLayer(ctx, n)``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Protocol

from lightning_sp.model.ops import RopeScaling
from lightning_sp.model.recompute import NO_RECOMPUTE, RecomputePolicy
from lightning_sp.parallel.random import RNGStreams
from lightning_sp.parallel.state import ParallelState


class LayerConfig(Protocol):
    """What the parts' modules read of a config (:class:`~lightning_sp.model.config.
    GPTConfig` is one; the parts sit below it, so they name only this). Read-only."""

    @property
    def hidden_size(self) -> int: ...

    @property
    def num_heads(self) -> int: ...

    @property
    def sequence_parallel(self) -> bool: ...

    @property
    def attention(self) -> str: ...

    @property
    def attention_dropout(self) -> float: ...

    @property
    def activation(self) -> str: ...

    @property
    def normalization(self) -> str: ...

    @property
    def position_embedding(self) -> str: ...

    @property
    def layernorm_eps(self) -> float: ...

    @property
    def init_std(self) -> float: ...

    @property
    def rope_theta(self) -> float: ...

    @property
    def rope_scaling(self) -> RopeScaling | None: ...

    @property
    def feed_forward(self) -> str: ...

    @property
    def moe(self) -> Any: ...

    @property
    def qk_norm(self) -> str | None: ...

    @property
    def norm_placement(self) -> str: ...

    @property
    def groups(self) -> int: ...

    @property
    def head_dim(self) -> int: ...

    @property
    def ffn_size(self) -> int: ...

    @property
    def output_init_std(self) -> float: ...

    @property
    def seed(self) -> int: ...

    def has_bias(self, projection: str) -> bool: ...


@dataclass(frozen=True)
class BuildContext:
    """Everything a part's module is built from, passed whole to its constructor
    (``Attention(ctx)``, ``MLP(ctx)``, ``MoE(ctx, moe)``, ``TransformerLayer(ctx, n)``): the
    config, the layout, the dropout streams, its layer's recompute policy, the shared RoPE
    tables and the tensor factory arguments (``dtype``, ``device``). The model makes one per
    layer (:meth:`for_layer`); a test or a benchmark building one module alone, :meth:`of`."""

    config: LayerConfig
    state: ParallelState
    rng: RNGStreams
    recompute: RecomputePolicy
    """The policy its layer runs (:meth:`recomputes` asks it)."""
    rotary: Any
    """The model's shared RoPE tables (:class:`~lightning_sp.model.attention.Rotary`), or None
    (learned positions, or a module that rotates nothing)."""
    kwargs: dict[str, Any]
    """The tensor factory arguments of every parameter: ``dtype``, ``device``."""

    @classmethod
    def of(
        cls,
        config: LayerConfig,
        state: ParallelState,
        recompute: RecomputePolicy = NO_RECOMPUTE,
        *,
        dtype: Any = None,
        device: Any = None,
    ) -> BuildContext:
        """A context for one module built alone: ``config``'s dropout streams (chunk 0), no
        RoPE tables, the state's device unless ``device`` is given."""
        rng = RNGStreams(config.seed, state)
        device = state.device if device is None else device
        return cls(config, state, rng, recompute, None, {"dtype": dtype, "device": device})

    def for_layer(self, recompute: RecomputePolicy) -> BuildContext:
        """This context for a layer that runs ``recompute``."""
        return dataclasses.replace(self, recompute=recompute)

    @property
    def sequence_parallel(self) -> bool:
        """Whether the residual stream is sharded along the sequence (the config's)."""
        return self.config.sequence_parallel

    def recomputes(self, module: str) -> bool:
        """Whether the recompute module ``module`` (``core_attn``, ``mlp_act`` ...) acts in
        this layer, under the config's attention backend."""
        return self.recompute.acts(module, self.config.attention)
