"""Every tensor of a checkpoint under its identity in the unsharded, unsplit model: the global
parameter name and the offsets of this rank's shard inside the full tensor (the
:class:`~lightning_sp.parallel.init.ShardSpec` that the layout-independent init already uses),
for the weights and for the optimizer state beside them."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lightning_sp.model.gpt import GPT


@dataclass(frozen=True)
class Shard:
    """A local tensor (a view of a parameter or optimizer state) and where it sits in the
    full tensor: ``offsets`` inside ``global_shape``. ``None`` offsets: the whole tensor."""

    local: Tensor
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...] | None = None


def gpt_chunks(module: nn.Module) -> list[GPT]:
    """The GPT shards (one, or the pipeline stage's chunks) inside ``module``."""
    return [m for m in module.modules() if isinstance(m, GPT)]


def parameter_shards(module: nn.Module) -> Iterator[tuple[str, Tensor, Shard | None]]:
    """``(global name, parameter, its saved slice)`` for every parameter of ``module``'s GPT
    shards; the slice is ``None`` where this rank holds nothing of the full tensor (a shard of
    padding rows only)."""
    for chunk in gpt_chunks(module):
        t = chunk.state.tensor_parallel_size
        for name, param in chunk.named_parameters():
            gname = chunk.global_name(name)
            spec = param.shard  # type: ignore[attr-defined]
            shape = tuple(param.shape)
            if spec.dim is None:
                yield gname, param, Shard(param.detach(), shape)
                continue
            full = list(shape)
            full[spec.dim] *= t
            if gname == "word_embeddings.weight":  # padding rows depend on t: true rows only
                full[0] = chunk.config.vocab_size
            length = min(shape[spec.dim], full[spec.dim] - spec.start)
            if length <= 0:
                yield gname, param, None
                continue
            offsets = [0] * len(shape)
            offsets[spec.dim] = spec.start
            local = param.detach().narrow(spec.dim, 0, length)
            yield gname, param, Shard(local, tuple(full), tuple(offsets))


def _like(shard: Shard, tensor: Tensor) -> Shard:
    """The same slice of ``tensor`` (an optimizer state of the parameter's shape)."""
    local = tensor.detach()
    for dim, size in enumerate(shard.local.shape):
        local = local.narrow(dim, 0, size)
    return Shard(local, shard.global_shape, shard.offsets)


def _optimizer_pairs(optimizer: torch.optim.Optimizer) -> list[tuple[Tensor, Tensor]]:
    """``(optimizer parameter, model parameter)``: the same tensor, or an fp32 master and its
    model parameter (:class:`~lightning_sp.training.optim.MasterWeightAdamW`)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    models = getattr(optimizer, "model_params", params)
    return list(zip(params, models, strict=True))


ADAM_FIELDS = ("exp_avg", "exp_avg_sq")


Install = tuple[torch.optim.Optimizer, Tensor, str, Tensor, str]
"""``(optimizer, its parameter, state field, the state tensor, checkpoint key)``."""


def state_entries(
    module: nn.Module, optimizers: list[torch.optim.Optimizer], *, for_load: bool
) -> tuple[dict[str, Tensor], dict[str, Shard], list[Install]]:
    """The tensors of a checkpoint as DCP sees them: ``{key: local tensor}`` and
    ``{key: Shard}`` for the sharded ones. For a save, the tied embedding's pipeline copy is
    left out; for a load, every parameter is a target, and Adam states that do not exist yet
    are allocated (returned as installs, for :func:`install_states` after the load)."""
    tensors: dict[str, Tensor] = {}
    shards: dict[str, Shard] = {}
    by_param: dict[int, tuple[str, Shard]] = {}
    for gname, param, shard in parameter_shards(module):
        if shard is None or (not for_load and getattr(param, "pipeline_copy", False)):
            continue
        by_param[id(param)] = (gname, shard)
        _add(tensors, shards, f"model.{gname}", shard)
    installs: list[Install] = []
    for optimizer in optimizers:
        for opt_param, model_param in _optimizer_pairs(optimizer):
            if id(model_param) not in by_param:
                continue
            gname, shard = by_param[id(model_param)]
            state = optimizer.state.get(opt_param, {})
            if opt_param is not model_param:
                _add(tensors, shards, f"optim.{gname}.master", _like(shard, opt_param))
            for name in (*ADAM_FIELDS, "step"):
                key, value = f"optim.{gname}.{name}", state.get(name)
                if value is None and for_load:
                    value = (
                        torch.zeros((), dtype=torch.float32)
                        if name == "step"
                        else torch.zeros_like(opt_param)
                    )
                    installs.append((optimizer, opt_param, name, value, key))
                if value is None:
                    continue
                if name == "step":
                    tensors[key] = value
                else:
                    _add(tensors, shards, key, _like(shard, value))
    return tensors, shards, installs


def install_states(installs: list[Install], loaded: set[str]) -> None:
    """Give Adam the states allocated for a load, for parameters whose every field was in the
    checkpoint (a checkpoint saved before the first step has none)."""
    complete: dict[int, bool] = {}
    for _, param, _, _, key in installs:
        complete[id(param)] = complete.get(id(param), True) and key in loaded
    for optimizer, param, name, value, _ in installs:
        if complete[id(param)]:
            optimizer.state[param][name] = value


def _add(tensors: dict[str, Tensor], shards: dict[str, Shard], key: str, shard: Shard) -> None:
    tensors[key], shards[key] = shard.local, shard


def global_shapes(module: nn.Module) -> dict[str, tuple[int, ...]]:
    """``{model.<global name>: full shape}`` of the parameters in ``module``."""
    return {
        f"model.{gname}": shard.global_shape
        for gname, _, shard in parameter_shards(module)
        if shard is not None
    }
