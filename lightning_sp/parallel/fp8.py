"""FP8 GEMMs in the tensor-parallel linears, with ``torchao.float8``'s recipes.

Each of a linear's three GEMMs (forward ``x Wᵀ``, input gradient ``∇y W``, weight gradient
``∇yᵀ x``) casts its two operands to float8 with dynamic scales as ``torchao``'s
``Float8Linear`` does for the same recipe (``tensorwise``: one scale per tensor; ``rowwise``:
one per row or column, rounded down to a power of 2, e4m3 throughout), through torchao's own
cast (``hp_tensor_and_scale_to_float8``) and matmul (``torch._scaled_mm``, or its emulation
with ``emulate``). What tensor parallelism adds is where a scale's amax spans the TP group:
a scale is *agreed* (its amax all-reduced with MAX over the group) exactly where the unsharded
layer's amax would cover the other ranks' shards:

* column parallel (``W`` ``[n/t, k]``, ``x`` whole after the sequence all-gather): the
  tensorwise scales of ``W`` and ``∇y`` (a global amax over the shards), the rowwise scales of
  ``∇y`` per token and of ``W`` per input feature in the input-gradient GEMM (rows that run
  over ``n``);
* row parallel (``W`` ``[n, k/t]``, ``x`` ``[m, k/t]``): the tensorwise scales of ``x`` and
  ``W``, the rowwise scales of ``x`` per token and of ``W`` per output feature in the forward
  GEMM (rows that run over ``k``).

Every other scale is local and equal on the ranks that hold the same tensor. With agreed
scales each rank's float8 operands are the slices of the unsharded layer's, so the layers
equal ``Float8Linear`` on the whole weight up to the order of the fp32 sums
(``tests/test_fp8.py``). The master weights, their gradients and the optimizer are untouched:
only the GEMMs' operands are float8. Which layers use it is the caller's choice; the
anchors (torchtitan, Megatron-Core) keep the embeddings, the LM head and the router in high
precision.

``torchao`` is an optional dependency (``pip install 'lightning-sp[fp8]'``); this module
imports it only when a recipe is built.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_sp.errors import ConfigError
from lightning_sp.parallel.comm import Group, conjugate_op, g, group_size

RECIPES = ("tensorwise", "rowwise")
"""``torchao.float8``'s recipe names this module implements."""

KEEPS_FLOAT8_INPUT = {"tensorwise": True, "rowwise": False}
"""Per recipe, whether a linear keeps its input for backward as the forward's float8 cast
(:func:`keeps_float8_input`, which the recipe's built casts answer; this table is what the
byte formulas read without importing torchao)."""

MIN_CAPABILITY = (8, 9)
"""CUDA compute capability of the first FP8 tensor cores (Ada, Hopper)."""


@dataclasses.dataclass
class FP8Config:
    """FP8 GEMMs in the tensor-parallel linears (a run setting: the weights stay as they are).

    Checked once, before any step (:meth:`validate`, :func:`check_fp8`)."""

    recipe: str | None = None
    """``None`` (off), ``tensorwise`` or ``rowwise`` (``torchao.float8``'s recipes)."""
    emulate: bool = False
    """Compute the float8 GEMMs in fp32 on the dequantised operands (the same numerics, no
    FP8 hardware needed): on a CPU it must be true."""

    def validate(self) -> None:
        """The fields' values, one line (:class:`ConfigError`)."""
        if self.recipe is not None and self.recipe not in RECIPES:
            raise ConfigError(
                f"fp8.recipe={self.recipe!r} is not a recipe; valid: {', '.join(RECIPES)} "
                "(or null: off)"
            )
        if not isinstance(self.emulate, bool):
            raise ConfigError(f"fp8.emulate={self.emulate!r} is invalid; it must be true or false")


def check_fp8(config: FP8Config, device: torch.device) -> None:
    """Raise :class:`ConfigError` (one line) where ``config`` cannot run on ``device``:
    ``torchao`` missing, a CPU without emulation, a GPU without FP8 GEMMs."""
    config.validate()
    if config.recipe is None:
        return
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError(
            f"fp8.recipe={config.recipe!r} needs torchao, which is not installed "
            "(pip install 'lightning-sp[fp8]') or set fp8.recipe=null"
        )
    if config.emulate:
        return
    if device.type == "cpu":
        raise ConfigError(
            f"fp8.recipe={config.recipe!r} on CPU: a CPU has no FP8 GEMMs; set fp8.emulate=true "
            "(the numerics, not the speed) or fp8.recipe=null"
        )
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < MIN_CAPABILITY:
            name = torch.cuda.get_device_name(device)
            raise ConfigError(
                f"fp8.recipe={config.recipe!r} needs FP8 GEMMs (compute capability >= 8.9: "
                f"Ada, Hopper and later); {name} has {capability[0]}.{capability[1]}; set "
                "fp8.recipe=null or fp8.emulate=true"
            )


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A built recipe: torchao's ``Float8LinearConfig`` and its ``LinearMMConfig``."""

    linear: Any
    mm: Any

    @classmethod
    def build(cls, config: FP8Config) -> Recipe:
        from torchao.float8 import Float8LinearConfig
        from torchao.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig

        config.validate()
        if config.recipe is None:
            raise ConfigError("fp8.recipe is null: there is no recipe to build")
        linear = dataclasses.replace(
            Float8LinearConfig.from_recipe_name(config.recipe), emulate=config.emulate
        )
        gemms = (linear.gemm_config_output, linear.gemm_config_grad_input,
                 linear.gemm_config_grad_weight)  # fmt: skip
        scaled = [
            ScaledMMConfig(config.emulate, c.use_fast_accum, False, linear.pad_inner_dim)
            for c in gemms
        ]
        mm = LinearMMConfig(*scaled)
        return cls(linear, mm)


def _cast(
    x: Tensor, cast: Any, recipe: Recipe, role: Any, dim: int, sharded: int | None, group: Group
) -> Tensor:
    """``x`` (2-D) as torchao's float8 tensor for ``role``: an amax per tensor, or per slice
    along ``dim`` (axiswise), all-reduced with MAX over ``group`` where it spans the shards
    (``x`` split along dim ``sharded``; ``None``: whole on every rank)."""
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_training_tensor import hp_tensor_and_scale_to_float8
    from torchao.float8.float8_utils import amax_to_scale, tensor_to_amax

    axiswise = cast.scaling_granularity is ScalingGranularity.AXISWISE
    axis = dim if axiswise else None  # torchao's: 0 or -1
    amax = tensor_to_amax(x, scaling_granularity=cast.scaling_granularity, axiswise_dim=axis)
    spans = sharded is not None and (not axiswise or dim % x.dim() == sharded % x.dim())
    if spans and group_size(group) > 1:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    scale = amax_to_scale(amax, cast.target_dtype, recipe.linear.round_scales_to_power_of_2)
    return hp_tensor_and_scale_to_float8(x, scale, cast.target_dtype, recipe.mm, role, axis)


LAYOUTS = {"column": (None, 1, 1), "row": (1, 0, None)}
"""Which dim of ``x [m, k]``, ``Wᵀ [k, n]`` and ``∇y [m, n]`` a TP rank holds a slice of."""


def keeps_float8_input(recipe: Recipe) -> bool:
    """Whether a linear may keep its input for backward as the forward's float8 cast: where the
    recipe's cast of ``x`` for the weight-gradient GEMM is the forward's (``tensorwise``: one
    e4m3 scale per tensor in both), that cast is what torchao's own backward would make again,
    so keeping it (1 byte an element and a 4-byte scale) changes no number. ``rowwise`` scales
    ``x`` per token forward and per feature for the weight gradient: it keeps ``x`` as given."""
    from torchao.float8.config import ScalingGranularity

    c = recipe.linear
    forward, backward = c.cast_config_input, c.cast_config_input_for_grad_weight
    return forward == backward and forward.scaling_granularity is ScalingGranularity.TENSORWISE


def cast_input(x2: Tensor, recipe: Recipe, group: Group, sharded: int | None) -> Any:
    """``x`` ``[m, k]`` cast for the forward GEMM (``sharded``: the dim a TP rank holds a slice
    of, whose amax is agreed; ``None``: whole on every rank)."""
    from torchao.float8.float8_training_tensor import GemmInputRole

    config = recipe.linear.cast_config_input
    return _cast(x2, config, recipe, GemmInputRole.INPUT, -1, sharded, group)


def float8_input(data: Tensor, scale: Tensor, dtype: torch.dtype, recipe: Recipe) -> Any:
    """A kept float8 input (its ``data`` and ``scale``, as :func:`cast_input` made them) as
    torchao's tensor again, for the weight-gradient GEMM."""
    from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole

    return Float8TrainingTensor(data, scale, dtype, recipe.mm, GemmInputRole.INPUT, None)


def forward_gemm(a: Any, weight: Tensor, recipe: Recipe, group: Group, layout: str) -> Tensor:
    """``a Wᵀ``: ``a`` the cast input ``[m, k]``, ``weight`` ``[n, k]`` (this rank's slice as
    ``layout`` holds it) -> ``[m, n]``."""
    from torchao.float8.float8_training_tensor import GemmInputRole

    config, w_dim = recipe.linear.cast_config_weight, LAYOUTS[layout][1]
    w = _cast(weight.t(), config, recipe, GemmInputRole.WEIGHT, 0, w_dim, group)
    return torch.mm(a, w)


def input_grad_gemm(
    g2: Tensor, weight: Tensor, recipe: Recipe, group: Group, layout: str
) -> Tensor:
    """``∇y W``: ``g2`` ``[m, n]``, ``weight`` ``[n, k]`` -> ``[m, k]`` (a partial sum over
    the TP group for the column layout)."""
    from torchao.float8.float8_training_tensor import GemmInputRole

    c, (_, w_dim, g_dim) = recipe.linear, LAYOUTS[layout]
    out, wgt = GemmInputRole.GRAD_OUTPUT, GemmInputRole.WEIGHT
    g_in = _cast(g2, c.cast_config_grad_output, recipe, out, -1, g_dim, group)
    w_in = _cast(weight.t(), c.cast_config_weight_for_grad_input, recipe, wgt, -1, w_dim, group)
    return torch.mm(g_in, w_in.t())


def weight_grad_gemm(
    g2: Tensor, x2: Tensor | None, kept: Any, recipe: Recipe, group: Group, layout: str
) -> Tensor:
    """``∇yᵀ x``: ``g2`` ``[m, n]`` and the input, ``x2`` ``[m, k]`` in high precision (cast
    here for the weight gradient) or ``kept``, its forward float8 cast
    (:func:`keeps_float8_input`) -> ``[n, k]``."""
    from torchao.float8.float8_training_tensor import GemmInputRole

    c, (x_dim, _, g_dim) = recipe.linear, LAYOUTS[layout]
    out, inp = GemmInputRole.GRAD_OUTPUT, GemmInputRole.INPUT
    g_w = _cast(g2, c.cast_config_grad_output_for_grad_weight, recipe, out, 0, g_dim, group)
    if kept is None:
        assert x2 is not None
        kept = _cast(x2, c.cast_config_input_for_grad_weight, recipe, inp, 0, x_dim, group)
    return torch.mm(g_w.t(), kept)


class _FP8Matmul(torch.autograd.Function):
    """``x Wᵀ`` with the three GEMMs in float8 (see the module docstring); saves ``x`` and
    ``W`` in high precision, as ``Float8Linear`` does, and casts again in backward."""

    @staticmethod
    def forward(
        ctx: Any, x: Tensor, weight: Tensor, recipe: Recipe, group: Group, layout: str
    ) -> Tensor:
        ctx.recipe, ctx.group, ctx.layout = recipe, group, layout
        ctx.save_for_backward(x, weight)
        x2 = x.reshape(-1, x.shape[-1])  # [m, k]
        a = cast_input(x2, recipe, group, LAYOUTS[layout][0])
        out = forward_gemm(a, weight, recipe, group, layout)
        return out.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None, None, None]:
        x, weight = ctx.saved_tensors
        recipe, group, layout = ctx.recipe, ctx.group, ctx.layout
        g2 = grad.reshape(-1, grad.shape[-1])  # [m, n]
        x2 = x.reshape(-1, x.shape[-1])  # [m, k]
        grad_x = input_grad_gemm(g2, weight, recipe, group, layout).reshape(*x.shape)
        grad_w = weight_grad_gemm(g2, x2, None, recipe, group, layout)
        return grad_x, grad_w.to(weight.dtype), None, None, None


def _identity(x: Tensor, group: Group) -> Tensor:
    return x.view_as(x)


def _all_reduce(x: Tensor, group: Group) -> Tensor:
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


_F = conjugate_op("F", _identity, _all_reduce)  # the paper's f: identity, all-reduce backward


def fp8_column_parallel_linear(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    recipe: Recipe,
    group: Group,
    sequence_parallel: bool,
) -> Tensor:
    """The column-parallel linear in float8: ``x`` ``[s/t, b, k]`` (sequence parallel: g
    gathers it) or ``[s, b, k]`` (f), ``weight`` ``[n/t, k]`` -> ``[s, b, n/t]``. The gathered
    input is saved (not the shard, as the high-precision column linear does)."""
    full = g(x, group) if sequence_parallel else _F.apply(x, group) if group_size(group) > 1 else x
    out = _FP8Matmul.apply(full, weight, recipe, group, "column")
    return out + bias.to(out.dtype) if bias is not None else out


def fp8_row_parallel_matmul(x: Tensor, weight: Tensor, recipe: Recipe, group: Group) -> Tensor:
    """The row-parallel linear's partial product in float8: ``x`` ``[s, b, k/t]``, ``weight``
    ``[n, k/t]`` -> ``[s, b, n]`` (summed over the group by the caller: f̄ or ḡ)."""
    return _FP8Matmul.apply(x, weight, recipe, group, "row")
