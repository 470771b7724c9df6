"""The checks of a :class:`~lightning_sp.model.config.GPTConfig`: every field in its range
(:func:`check_config`, which the config's construction runs) and, in the one function
:func:`check_model_layout`, the model against a layout (the layout's sizes dividing what they
split), each failure one :class:`ConfigError` line naming the field, the value and what is
valid. The model and its MoE layer are built trusting them; the recompute policies and the
float settings are checked when the config is built."""

from __future__ import annotations

import math
from typing import Any

from lightning_sp.errors import ConfigError, check_divisible, divisors, positive_int
from lightning_sp.model.cores import check_attention
from lightning_sp.model.fp8 import check_fp8_config, check_fp8_layout
from lightning_sp.model.ops import ROPE_TYPES, RopeScaling
from lightning_sp.model.parts.block import FEED_FORWARDS, PLACEMENTS
from lightning_sp.model.qk_norm import QK_NORMS
from lightning_sp.model.spec import ACTIVATIONS, NORMS, POSITIONS
from lightning_sp.parallel.config import ParallelConfig

BIAS_PROJECTIONS = ("qkv", "proj", "fc1", "fc2")
"""The projections ``GPTConfig.bias`` may name."""


def check_model_layout(config: Any, layout: ParallelConfig, *, split_sequence: bool = True) -> None:
    """The one check of a model against a layout, run before launch (the command line's
    :func:`~lightning_sp.cli.checks.check_fit_config`, ``GPTModule`` when the strategy pushes
    the layout) and in the planner's estimate (``config``'s own fields were checked when it
    was built, :func:`check_config`): what its ``t`` tensor-parallel ranks split (hidden size,
    heads, key/value groups, MLP width), the sequence by
    :meth:`ParallelConfig.sequence_divisor` under the model's sequence parallelism
    (``split_sequence``; the planner, which shows a layout whose SP cannot split the sequence
    without it, checks ``2c`` itself) and the mixture-of-experts part against the expert sizes
    (:meth:`~lightning_sp.model.moe.config.MoEConfig.check_layout`). :class:`ConfigError`, one
    line: field, value, what is valid."""
    t = layout.tensor_parallel_size
    check_divisible("hidden_size", config.hidden_size, "tensor_parallel_size", t)
    check_divisible("num_heads", config.num_heads, "tensor_parallel_size", t)
    g = config.groups
    if g % t and t % g:
        raise ConfigError(
            f"num_query_groups={g} and tensor_parallel_size={t}: one must divide the other "
            f"(tensor_parallel_size one of {sorted(set(divisors(g)) | _multiples(g, t))})"
        )
    check_divisible("ffn_hidden_size", config.ffn_size, "tensor_parallel_size", t)
    if split_sequence:
        layout.check_sequence_length(config.seq_length, config.sequence_parallel)
    if config.feed_forward == "moe":
        config.moe.check_layout(layout, config.sequence_parallel)
    else:
        _check_no_experts(config.feed_forward, layout)
    check_fp8_layout(config, layout)


def _check_no_experts(feed_forward: str, layout: ParallelConfig) -> None:
    """A model without experts takes no expert layout: ``expert_parallel_size`` or
    ``expert_tensor_parallel_size`` above 1 would be ignored (issue 40): :class:`ConfigError`,
    one line."""
    for name in ("expert_parallel_size", "expert_tensor_parallel_size"):
        size = getattr(layout, name)
        if size > 1:
            raise ConfigError(
                f"{name}={size} shares out the experts of a mixture-of-experts model, but "
                f"feed_forward={feed_forward!r} has none; set {name}=1 (or feed_forward: moe)"
            )


def check_config(config: Any) -> None:
    """Raise :class:`ConfigError` (one line: field, value, what is valid) on a bad ``config``
    (a :class:`~lightning_sp.model.config.GPTConfig`, whose construction runs it once): its
    fields alone, whatever the layout (:func:`check_model_layout` adds the layout)."""
    for name in ("vocab_size", "seq_length", "hidden_size", "num_layers", "num_heads"):
        positive_int(name, getattr(config, name))
    check_attention(config.attention)
    for name, registry, what in (
        ("activation", ACTIVATIONS, "an activation"),
        ("normalization", NORMS, "a normalization"),
        ("position_embedding", POSITIONS, "a position embedding"),
    ):
        if getattr(config, name) not in registry:
            raise ConfigError(
                f"{name}={getattr(config, name)!r} is not {what}; valid: {', '.join(registry)}"
            )
    if config.feed_forward not in FEED_FORWARDS:
        raise ConfigError(
            f"feed_forward={config.feed_forward!r} is not a feed-forward part; valid: "
            f"{', '.join(FEED_FORWARDS)}"
        )
    if config.feed_forward == "moe":
        if config.moe is None:
            raise ConfigError("feed_forward='moe' needs moe settings (moe.num_experts ...)")
        if config.activation != "swiglu":
            raise ConfigError(
                f"feed_forward='moe' runs SwiGLU experts; activation={config.activation!r} "
                "must be 'swiglu'"
            )
    check_fp8_config(config)
    if not isinstance(config.bias, bool):
        unknown = [p for p in config.bias if p not in BIAS_PROJECTIONS]
        if unknown:
            raise ConfigError(
                f"bias={list(config.bias)!r} names {unknown[0]!r}, not a projection; valid: "
                f"true, false or a list of {', '.join(BIAS_PROJECTIONS)}"
            )
    if config.kv_channels is not None:
        positive_int("kv_channels", config.kv_channels)
    if config.qk_norm is not None and config.qk_norm not in QK_NORMS:
        raise ConfigError(
            f"qk_norm={config.qk_norm!r} is not a query/key norm; valid: null, "
            f"{', '.join(QK_NORMS)}"
        )
    if config.rope_scaling is not None and config.rope_scaling.rope_type not in ROPE_TYPES:
        raise ConfigError(
            f"rope_scaling.rope_type={config.rope_scaling.rope_type!r} is not a RoPE scaling; "
            f"valid: {', '.join(ROPE_TYPES)}"
        )
    if config.norm_placement not in PLACEMENTS:
        raise ConfigError(
            f"norm_placement={config.norm_placement!r} is not a placement; valid: "
            f"{', '.join(PLACEMENTS)}"
        )
    if config.recompute_num_layers is not None and config.recompute_num_layers < 0:
        raise ConfigError(
            f"recompute_num_layers={config.recompute_num_layers} must be >= 0 or null"
        )
    if config.kv_channels is None and config.hidden_size % config.num_heads:
        raise ConfigError(
            f"hidden_size={config.hidden_size} is not divisible by num_heads={config.num_heads}; "
            f"num_heads must be one of {divisors(config.hidden_size)}"
        )
    g = config.groups
    if not isinstance(g, int) or isinstance(g, bool) or g < 1:
        raise ConfigError(
            f"num_query_groups={config.num_query_groups!r} must be a positive integer dividing "
            f"num_heads={config.num_heads} (one of {divisors(config.num_heads)}), or null for "
            "multi-head attention"
        )
    _check_rope(config.rope_scaling)
    if config.num_heads % g:
        raise ConfigError(
            f"num_query_groups={g} does not divide num_heads={config.num_heads}; "
            f"num_query_groups must be one of {divisors(config.num_heads)}"
        )
    if config.position_embedding == "rope" and config.head_dim % 2:
        raise ConfigError(
            f"position_embedding='rope' needs an even head dimension; kv_channels or "
            f"hidden_size/num_heads = {config.head_dim}"
        )


def _check_rope(scaling: RopeScaling | None) -> None:
    """``rope_scaling``'s factors positive, ``high_freq_factor`` above ``low_freq_factor``
    (their difference divides) and its context a positive integer (``rope_theta`` and the
    other floats: the config records' own construction)."""
    if scaling is None:
        return
    for name in ("factor", "low_freq_factor", "high_freq_factor"):
        value = getattr(scaling, name)
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not 0 < value < math.inf
        ):
            raise ConfigError(f"rope_scaling.{name}={value!r} must be a positive number")
    if not scaling.high_freq_factor > scaling.low_freq_factor:
        raise ConfigError(
            f"rope_scaling.high_freq_factor={scaling.high_freq_factor!r} must be greater than "
            f"rope_scaling.low_freq_factor={scaling.low_freq_factor!r} (Llama 3.1: 4 and 1)"
        )
    positive_int(
        "rope_scaling.original_max_position_embeddings", scaling.original_max_position_embeddings
    )


def _multiples(g: int, t: int) -> set[int]:
    """Multiples of ``g`` up to ``t``."""
    return set(range(g, t + 1, g))
