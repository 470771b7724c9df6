"""Every tensor of a checkpoint under its identity in the unsharded, unsplit model: the global
parameter name and the offsets of this rank's shard inside the full tensor (the
:class:`~lightning_sp.parallel.init.ShardSpec` that the layout-independent init already uses),
for the weights and for the optimizer state beside them. A mixture-of-experts expert weight
``[E/e, ...]`` is the chunk at its first expert's offset of the full ``[E, ...]``; under expert
tensor parallelism a rank's slice of ``f_e`` is one chunk (``down``'s columns) or one per block
(``gate_up``'s gate rows and up rows: two entries ``<key>@<offsets>``), so a checkpoint loads
under any expert-parallel and expert-tensor-parallel size.

The distributed optimizer holds, per parameter, a flat range of its shard
(:class:`~lightning_sp.optim.distributed.Segment`); that range is saved as the few
rectangular chunks it covers (:func:`flat_range_boxes`: a partial first row, whole rows, a
partial last row), under the same keys the replicated optimizer saves whole tensors, so no
rank ever gathers the full state and either optimizer loads the other's checkpoints.

A layer's persistent buffers (:func:`buffer_shards`: state a training run carries across
steps, e.g. an MoE router's ``expert_bias``) are saved whole under ``model.<global name>``,
as a replicated parameter is: every rank holding the layer holds the same values.

A LoRA run from ``init_from`` saves ``with_base=False``: its trainable parameters (the
adapters) and their optimizer state only, not the frozen base, which a resume reads again
from ``init_from`` (its fingerprint checked: :mod:`lightning_sp.training.adapters`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lightning_sp.model.gpt import GPT
from lightning_sp.optim.distributed import DistributedAdamW, Segment
from lightning_sp.parallel.init import ExpertSlice


@dataclass(frozen=True)
class Shard:
    """A local tensor (a view of a parameter or optimizer state) and where it sits in the
    full tensor: ``offsets`` inside ``global_shape``. ``None`` offsets: the whole tensor."""

    local: Tensor
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...] | None = None
    key: str | None = None
    """The checkpoint key this is a chunk of, where the entry's own name differs (one of
    several chunks of a tensor on this rank: ``<key>@<offsets>``)."""
    within: tuple[int, ...] | None = None
    """Where ``local`` starts inside its parameter (one of several chunks of it); ``None``:
    at the parameter's origin."""


def checkpoint_key(entry: str, shards: dict[str, Shard]) -> str:
    """The checkpoint key of a state-dict ``entry`` (itself, unless it is one of several
    chunks of a tensor on this rank)."""
    shard = shards.get(entry)
    return shard.key if shard is not None and shard.key is not None else entry


def gpt_chunks(module: nn.Module) -> list[GPT]:
    """The GPT shards (one, or the pipeline stage's chunks) inside ``module``."""
    return [m for m in module.modules() if isinstance(m, GPT)]


def parameter_shards(module: nn.Module) -> Iterator[tuple[str, Tensor, Shard | None]]:
    """``(global name, parameter, its saved slice)`` for every parameter of ``module``'s GPT
    shards; the slice is ``None`` where this rank holds nothing of the full tensor (a shard of
    padding rows only). A parameter saved as several chunks (an expert-tensor-parallel slice
    of ``[gate; up]``) comes once per chunk."""
    for chunk in gpt_chunks(module):
        t = chunk.state.tensor_parallel_size
        for name, param in chunk.named_parameters():
            gname = chunk.global_name(name)
            spec = param.shard  # type: ignore[attr-defined]
            shape = tuple(param.shape)
            expert_start = getattr(param, "expert_start", None)
            if expert_start is not None:  # E/e experts of E: rows from expert_start of dim 0
                yield from _expert_chunks(gname, param, chunk.state.expert_parallel_size)
                continue
            if spec.dim is None:
                yield gname, param, Shard(param.detach(), shape)
                continue
            full = list(shape)
            full[spec.dim] = spec.full_size(shape[spec.dim], t)
            if getattr(param, "padded_vocab", False):  # padding rows depend on t: true rows only
                full[0] = chunk.config.vocab_size
            length = min(shape[spec.dim], full[spec.dim] - spec.start)
            if length <= 0:
                yield gname, param, None
                continue
            offsets = [0] * len(shape)
            offsets[spec.dim] = spec.start
            local = param.detach().narrow(spec.dim, 0, length)
            yield gname, param, Shard(local, tuple(full), tuple(offsets))


def _expert_chunks(
    gname: str, param: Tensor, expert_parallel_size: int
) -> Iterator[tuple[str, Tensor, Shard]]:
    """A stacked expert weight's chunks: its ``E/e`` experts from ``expert_start``, and along
    its :class:`~lightning_sp.parallel.init.ExpertSlice` dim each block of its ``f_e`` slice."""
    shape = tuple(param.shape)
    sliced: ExpertSlice = getattr(param, "expert_slice", ExpertSlice(1))
    full = list(shape)
    full[0] *= expert_parallel_size
    full[sliced.dim] *= sliced.size
    for local_start, full_start, length in sliced.blocks(shape[sliced.dim]):
        offsets, within = [0] * len(shape), [0] * len(shape)
        offsets[0] = param.expert_start  # type: ignore[attr-defined]
        offsets[sliced.dim], within[sliced.dim] = full_start, local_start
        local = param.detach().narrow(sliced.dim, local_start, length)
        yield gname, param, Shard(local, tuple(full), tuple(offsets), within=tuple(within))


def buffer_shards(module: nn.Module) -> Iterator[tuple[str, Shard]]:
    """``(global name, the whole buffer)`` for every persistent buffer (one in ``state_dict``)
    of ``module``'s GPT shards: replicated on every rank holding its layer, so any layout
    saves and loads it whole."""
    for chunk in gpt_chunks(module):
        persistent = chunk.state_dict(keep_vars=True)
        for name, buffer in chunk.named_buffers():
            if name in persistent:
                yield chunk.global_name(name), Shard(buffer.detach(), tuple(buffer.shape))


def buffer_entries(module: nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    """``(model.<global name>, shape)`` of the persistent buffers of ``module``'s GPT shards."""
    return [(f"model.{gname}", shard.global_shape) for gname, shard in buffer_shards(module)]


def _like(shard: Shard, tensor: Tensor) -> Shard:
    """The same slice of ``tensor`` (an optimizer state of the parameter's shape)."""
    local = tensor.detach()
    within = shard.within or (0,) * local.dim()
    for dim, size in enumerate(shard.local.shape):
        local = local.narrow(dim, within[dim], size)
    return Shard(local, shard.global_shape, shard.offsets)


def _entry(key: str, shard: Shard, several: bool) -> tuple[str, Shard]:
    """The state-dict entry of a chunk: ``key`` itself, or ``<key>@<offsets>`` (and the key
    recorded on the chunk) when the tensor is ``several`` chunks on this rank."""
    if not several:
        return key, shard
    at = ",".join(map(str, shard.offsets or ()))
    return f"{key}@{at}", dataclasses.replace(shard, key=key)


def _optimizer_pairs(optimizer: torch.optim.Optimizer) -> list[tuple[Tensor, Tensor]]:
    """``(optimizer parameter, model parameter)``: the same tensor, or an fp32 master and its
    model parameter (:class:`~lightning_sp.optim.adamw.MasterWeightAdamW`)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    models = getattr(optimizer, "model_params", params)
    return list(zip(params, models, strict=True))


ADAM_FIELDS = ("exp_avg", "exp_avg_sq")


Install = tuple[torch.optim.Optimizer, Tensor, str, Tensor, str]
"""``(optimizer, its parameter, state field, the state tensor, checkpoint key)``."""


def state_entries(
    module: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    *,
    for_load: bool,
    with_base: bool = True,
) -> tuple[dict[str, Tensor], dict[str, Shard], list[Install]]:
    """The tensors of a checkpoint as DCP sees them (weights, persistent buffers, optimizer
    state): ``{entry: local tensor}`` and ``{entry: Shard}`` for the sharded ones. For a save,
    the tied embedding's pipeline copy is left out, and without ``with_base`` every frozen
    parameter (``requires_grad`` off: a LoRA run's base); for a load, every parameter is a
    target, and Adam states that do not exist yet are allocated (returned as installs, for
    :func:`install_states` after the load)."""
    tensors: dict[str, Tensor] = {}
    shards: dict[str, Shard] = {}
    by_param: dict[int, tuple[str, list[Shard]]] = {}
    for gname, param, shard in parameter_shards(module):
        if shard is None or (not for_load and getattr(param, "pipeline_copy", False)):
            continue
        if not for_load and not with_base and not param.requires_grad:
            continue
        by_param.setdefault(id(param), (gname, []))[1].append(shard)
    for gname, chunks in by_param.values():
        for shard in chunks:
            _add(tensors, shards, *_entry(f"model.{gname}", shard, len(chunks) > 1))
    for gname, shard in buffer_shards(module):
        _add(tensors, shards, f"model.{gname}", shard)  # a checkpoint without one: zero
    installs: list[Install] = []
    for optimizer in optimizers:
        if isinstance(optimizer, DistributedAdamW):
            for segment in optimizer.segments():
                if id(segment.param) in by_param:
                    gname, chunks = by_param[id(segment.param)]
                    _add_segment(tensors, shards, installs, optimizer, gname, chunks, segment,
                                 for_load=for_load)  # fmt: skip
            continue
        for opt_param, model_param in _optimizer_pairs(optimizer):
            if id(model_param) not in by_param:
                continue
            gname, chunks = by_param[id(model_param)]
            state = optimizer.state.get(opt_param, {})
            several = len(chunks) > 1
            if opt_param is not model_param:
                for shard in chunks:
                    like = _like(shard, opt_param)
                    _add(tensors, shards, *_entry(f"optim.{gname}.master", like, several))
            for name in (*ADAM_FIELDS, "step"):
                key, value = f"optim.{gname}.{name}", state.get(name)
                if value is None and for_load:
                    value = _allocate(name, opt_param, optimizer)
                    installs.append((optimizer, opt_param, name, value, key))
                if value is None:
                    continue
                if name == "step":
                    tensors[key] = value
                    continue
                for shard in chunks:
                    _add(tensors, shards, *_entry(key, _like(shard, value), several))
    return tensors, shards, installs


def _allocate(name: str, like: Tensor, optimizer: torch.optim.Optimizer) -> Tensor:
    """A state field to load into: a moment shaped as ``like``, or Adam's ``step`` where
    torch's AdamW keeps it (a scalar on the parameter's device for the fused and capturable
    kernels, else on the CPU)."""
    if name != "step":
        return torch.zeros_like(like)
    on_device = optimizer.defaults.get("fused") or optimizer.defaults.get("capturable")
    device = like.device if on_device else torch.device("cpu")
    return torch.zeros((), dtype=torch.float32, device=device)


def _add_segment(
    tensors: dict[str, Tensor],
    shards: dict[str, Shard],
    installs: list[Install],
    optimizer: torch.optim.Optimizer,
    gname: str,
    chunks: list[Shard],
    segment: Segment,
    *,
    for_load: bool,
) -> None:
    """The chunks of one distributed-optimizer segment: its master (low-precision parameters
    only: a full-precision weight is its own master) and Adam moments, cut at the saved
    regions of the parameter (``chunks``: true vocabulary rows only; each block of an
    expert-tensor-parallel slice)."""
    state = dict(segment.state)  # the live tensors (a load writes into them)
    if for_load:
        for name in (*ADAM_FIELDS, "step"):
            if name not in state:
                state[name] = _allocate(name, segment.master, optimizer)
                key = f"optim.{gname}.{name}"
                installs.append((optimizer, segment.master, name, state[name], key))
    if "step" in state:
        tensors[f"optim.{gname}.step"] = state["step"]
    fields = {name: state[name] for name in ADAM_FIELDS if name in state}
    if segment.param.dtype != segment.master.dtype:
        fields["master"] = segment.master
    local_shape = tuple(segment.param.shape)
    strides = _strides(local_shape)
    for offsets, sizes in flat_range_boxes(local_shape, segment.start, segment.end):
        first = sum(o * s for o, s in zip(offsets, strides, strict=True))
        for shard in chunks:  # the box's part inside each saved region
            within = shard.within or (0,) * len(local_shape)
            lo = [max(o, w) for o, w in zip(offsets, within, strict=True)]
            hi = [
                min(o + s, w + n)
                for o, s, w, n in zip(offsets, sizes, within, shard.local.shape, strict=True)
            ]
            if any(h <= low for low, h in zip(lo, hi, strict=True)):
                continue
            base = shard.offsets or (0,) * len(local_shape)
            at = tuple(b + low - w for b, low, w in zip(base, lo, within, strict=True))
            for name, value in fields.items():
                piece = value[first - segment.start : first - segment.start + math.prod(sizes)]
                piece = piece.view(sizes)
                for dim, (low, h, o) in enumerate(zip(lo, hi, offsets, strict=True)):
                    piece = piece.narrow(dim, low - o, h - low)
                key = f"optim.{gname}.{name}"
                entry = f"{key}@{','.join(map(str, at))}"
                _add(tensors, shards, entry, Shard(piece, shard.global_shape, at, key))


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))


def flat_range_boxes(
    shape: tuple[int, ...], start: int, end: int
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The flat range ``[start, end)`` of a row-major tensor of ``shape`` as rectangular boxes
    ``(offsets, sizes)``, in order: each box is a contiguous piece of the range, and together
    they are the range (at most two per dimension: a partial leading and trailing piece around
    whole sub-blocks)."""
    if start >= end:
        return []
    if len(shape) <= 1:
        return [((start,), (end - start,))] if shape else [((), ())]
    inner = math.prod(shape[1:])
    zeros = (0,) * (len(shape) - 1)
    (r0, c0), (r1, c1) = divmod(start, inner), divmod(end, inner)
    if r0 == r1:  # inside one row
        return [((r0, *o), (1, *s)) for o, s in flat_range_boxes(shape[1:], c0, c1)]
    boxes = []
    if c0:
        boxes += [((r0, *o), (1, *s)) for o, s in flat_range_boxes(shape[1:], c0, inner)]
        r0 += 1
    if r1 > r0:
        boxes.append(((r0, *zeros), (r1 - r0, *shape[1:])))
    if c1:
        boxes += [((r1, *o), (1, *s)) for o, s in flat_range_boxes(shape[1:], 0, c1)]
    return boxes


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


def global_shapes(module: nn.Module, with_base: bool = True) -> dict[str, tuple[int, ...]]:
    """``{model.<global name>: full shape}`` of the parameters in ``module`` (without
    ``with_base``: of its trainable ones, what a LoRA run's checkpoint must hold)."""
    return {
        f"model.{gname}": shard.global_shape
        for gname, param, shard in parameter_shards(module)
        if shard is not None and (with_base or param.requires_grad)
    }
