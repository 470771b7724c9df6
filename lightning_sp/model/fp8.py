"""FP8 GEMMs in a GPT's layers: the run setting ``fp8``
(:class:`~lightning_sp.parallel.fp8.FP8Config`), what it applies to and what it refuses.

It applies to every tensor-parallel linear of the layers: the attention's query, key, value
(one float8 GEMM each, the fused QKV's input cast once) and projection, the MLP's input
projections (``fc1``, or ``gate`` and ``up``) and ``fc2``
(:mod:`lightning_sp.parallel.fp8_linears`), and a mixture of experts' routed experts (each
expert's gate, up and down its own float8 linear,
:mod:`lightning_sp.parallel.fp8_grouped`) and shared experts. The embeddings, the LM head, the
norms, the attention core, the router and the combine stay in the run's precision, as the
anchors keep them (torchtitan's ``Float8Linear`` skips ``output``; Megatron-Core's FP8 leaves
the embedding and head to bf16; both keep the router's GEMM in high precision).

Refused, one line each, before any step:

* a mixture of experts at ``tensor_parallel_size > 1`` with ``expert_tensor_parallel_size =
  1``: each TP rank runs the experts on its own sequence shard's tokens, so an expert's
  tensorwise input and gradient scales would be one shard's amax, not its tokens' (t = 2 would
  not compute what t = 1 does); ``expert_tensor_parallel_size = t`` gathers the rows first;
* LoRA adapters: the adapters would read the float8 linears' high-precision input, a
  combination torchao and peft do not define;
* context parallelism: a tensorwise scale would be one CP rank's tokens' amax, not the
  sequence's, so c = 2 would not compute what c = 1 does;
* fewer key/value groups than TP ranks: ranks sharing a group hold partial gradients of its
  key and value outputs, whose float8 scale is not the summed gradient's;
* float64 parameters (float8 GEMMs take bf16, fp16 or fp32 inputs), a CPU without
  ``emulate``, a GPU without FP8 GEMMs, torchao missing
  (:func:`~lightning_sp.parallel.fp8.check_fp8`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from lightning_sp.errors import ConfigError
from lightning_sp.parallel.config import ParallelConfig
from lightning_sp.parallel.fp8 import FP8Config, Recipe, check_fp8
from lightning_sp.parallel.layers import ColumnParallelLinear, RowParallelLinear


def fp8_recipe(config: Any) -> str | None:
    """The recipe a model config's ``fp8`` setting turns on (None: off)."""
    fp8: FP8Config | None = config.fp8
    return fp8.recipe if fp8 is not None else None


def check_fp8_config(config: Any) -> None:
    """The ``fp8`` setting of a :class:`~lightning_sp.model.config.GPTConfig`: its fields,
    and the architecture it may run on (:class:`ConfigError`, one line)."""
    if config.fp8 is None:
        return
    config.fp8.validate()


def check_fp8_layout(config: Any, layout: ParallelConfig) -> None:
    """The ``fp8`` setting against a layout (:class:`ConfigError`, one line)."""
    recipe = fp8_recipe(config)
    if recipe is None:
        return
    c, t = layout.context_parallel_size, layout.tensor_parallel_size
    if c > 1:
        raise ConfigError(
            f"fp8.recipe={recipe!r} with context_parallel_size={c}: the FP8 scales are not "
            "agreed over the context-parallel group (docs/fp8.md); set context_parallel_size=1 "
            "or fp8: null"
        )
    if config.feed_forward == "moe" and t > 1 and layout.expert_tensor_parallel_size == 1:
        raise ConfigError(
            f"fp8.recipe={recipe!r} with feed_forward='moe', tensor_parallel_size={t} and "
            "expert_tensor_parallel_size=1: an expert's FP8 scales would be one sequence "
            f"shard's (docs/fp8.md); set expert_tensor_parallel_size={t} or fp8: null"
        )
    if config.groups < t:
        raise ConfigError(
            f"fp8.recipe={recipe!r} with num_query_groups={config.groups} < "
            f"tensor_parallel_size={t}: replicated key/value shards take partial gradients "
            "whose FP8 scale is not the whole gradient's (docs/fp8.md); use "
            f"tensor_parallel_size <= {config.groups} or fp8: null"
        )


def refuse_with_lora(config: Any) -> None:
    """LoRA adapters on a model whose linears run in float8: :class:`ConfigError`, one line."""
    recipe = fp8_recipe(config)
    if recipe is not None:
        raise ConfigError(
            f"lora with fp8.recipe={recipe!r}: adapters on float8 linears are not supported "
            "(docs/fp8.md); set fp8: null or lora: null"
        )


def _refuse_float64(recipe: str) -> None:
    raise ConfigError(
        f"fp8.recipe={recipe!r} with float64 parameters: float8 GEMMs take bf16, fp16 or "
        "fp32 inputs; set fp8: null or a lower precision"
    )


def check_fp8_launch(config: Any, accelerator: Any, precision: Any, lora: bool) -> None:
    """What a ``fit`` config says of an FP8 run before launch (:class:`ConfigError`, one line):
    LoRA beside it, ``trainer.precision`` 64, a CPU accelerator without ``fp8.emulate``. The
    rest waits for the device (:func:`attach_fp8`)."""
    recipe = fp8_recipe(config)
    if recipe is None:
        return
    if lora:
        refuse_with_lora(config)
    if str(precision).startswith("64"):
        _refuse_float64(recipe)
    if accelerator == "cpu":
        check_fp8(config.fp8, torch.device("cpu"))


def attach_fp8(
    layers: Iterable[nn.Module], config: Any, device: torch.device, dtype: torch.dtype
) -> int:
    """Turn every tensor-parallel linear and every rank's routed experts of ``layers`` to
    float8 GEMMs with ``config.fp8``'s recipe, after checking it can run on ``device`` with
    ``dtype`` parameters; returns how many modules (0 when the setting is off)."""
    recipe = fp8_recipe(config)
    if recipe is None:
        return 0
    if dtype == torch.float64:
        _refuse_float64(recipe)
    check_fp8(config.fp8, device)
    from lightning_sp.model.moe.experts import Experts  # the parts import this module

    built = Recipe.build(config.fp8)
    count = 0
    for layer in layers:
        for module in layer.modules():
            if isinstance(module, ColumnParallelLinear | RowParallelLinear | Experts):
                module.fp8 = built
                count += 1
    return count
