"""Contiguous gradient buffers and a bucketed data-parallel reduction overlapped with backward.

Every trainable parameter's gradient lives in ``param.main_grad``, a view into one flat buffer
per gradient dtype (fp32 for bf16/fp16 parameters, else the parameter's own dtype). The
parameters are laid out in *reverse* registration order, which is roughly the order backward
produces their gradients (last layer first), and the buffer is cut, at parameter boundaries,
into buckets of about ``bucket_numel`` elements::

    buffer[fp32] = | bucket 0: output layer, layer L-1 ... | bucket 1: ... | ... embedding |

A post-accumulate-grad hook adds each fresh gradient into its ``main_grad`` and frees
``param.grad``. On the backward that completes the step's gradients (``sync`` on, and each
parameter seen ``backwards_per_step`` times: the micro-batches of one ``training_step``), the
hook counts the parameter ready; when a bucket's last parameter is ready, the bucket's
all-reduce over the data-parallel group is launched asynchronously (``async_op=True``) while
backward goes on with earlier layers. :meth:`GradBuffer.finish` launches whatever has not been
launched (deferred buckets, parameters that got no gradient), waits for every bucket and
divides by the data-parallel size. The reduction is in place: no copy of the gradients is made.

Mixture-of-experts expert weights (marked ``expert``) sit in buckets of their own, reduced
over the expert-data group (the ranks holding the same experts) and divided by d like the rest
(:func:`lightning_sp.parallel.grads.reduce_expert_grads`'s convention); sharded (the
distributed optimizer) they are split over that group's d·c/e ranks.

Deferred parameters (the tied embedding's two copies under pipeline parallelism, whose sum
over the first and last stage must come first) sit in buckets of their own that only
:meth:`finish` launches. The sequence-parallel sums over the TP group stay a post-backward step
(:func:`lightning_sp.parallel.grads.finalize_grads`): they touch only the LayerNorm and bias
gradients, and being linear they commute with the data-parallel mean.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_sp.errors import ConfigError, positive_int
from lightning_sp.parallel.state import ParallelState

DEFAULT_BUCKET_NUMEL = 40_000_000
"""Elements per bucket by default (160 MB of fp32 gradients, Megatron's default size)."""


@dataclass(frozen=True)
class GradBufferConfig:
    """How a run's gradients are bucketed and reduced: the one record of it, built by the
    strategy from its arguments (``bucket_size``, ``overlap_grad_reduce``,
    ``distributed_optimizer``), checked here once, and handed whole to the optimizer that
    builds the :class:`GradBuffer`."""

    bucket_numel: int = DEFAULT_BUCKET_NUMEL
    """Elements per bucket (the strategy's ``bucket_size``)."""

    overlap: bool = True
    """Launch each bucket's reduction during backward (``overlap_grad_reduce``)."""

    distributed: bool = False
    """Reduce-scatter instead of all-reduce, for the distributed optimizer
    (``distributed_optimizer``)."""

    def __post_init__(self) -> None:
        positive_int("bucket_size", self.bucket_numel)
        for name, value in (("overlap_grad_reduce", self.overlap),
                            ("distributed_optimizer", self.distributed)):  # fmt: skip
            if not isinstance(value, bool):
                raise ConfigError(f"{name}={value!r} must be true or false")


def grad_dtype(param: Tensor) -> torch.dtype:
    """The dtype gradients of ``param`` accumulate in: fp32 for bf16/fp16, else its own."""
    return torch.float32 if param.dtype in (torch.bfloat16, torch.float16) else param.dtype


@dataclass(eq=False)
class Bucket:
    """A contiguous range of one buffer: the parameters whose ``main_grad`` it holds, at
    ``offsets`` inside it. Sharded (``distributed``), its length is a multiple of the
    data-parallel size d and data-parallel rank r owns ``data[r*len/d : (r+1)*len/d]``."""

    data: Tensor  # [numel], a view of the buffer (padded to a multiple of d when sharded)
    params: list[Tensor]
    offsets: list[int]
    deferred: bool = False
    ready: int = 0
    handle: Any = None
    launched_in_backward: bool = field(default=False)
    expert: bool = False
    """Holds mixture-of-experts expert weights: reduced over the expert-data group."""


class GradBuffer:
    """Flat gradient buffers over ``params`` with a bucketed, overlapped data-parallel mean.

    Args:
        params: The parameters (those without ``requires_grad`` are skipped).
        state: This rank's layout; the reduction runs over ``state.dp_group`` (distributed:
            over ``state.gradient_group``, the d·c ranks, summing over CP as well).
        bucket_numel: Elements per bucket (a bucket closes once it holds at least this many).
        deferred: Parameters reduced only by :meth:`finish` (in buckets of their own).
        overlap: Launch each bucket's collective during backward; ``False`` reduces every
            bucket in :meth:`finish` (the same result, no overlap).
        backwards_per_step: Backward passes per synchronising step (micro-batches that one
            ``training_step`` runs): the last of them makes a parameter ready.
        distributed: Reduce-scatter over the d·c ranks of ``state.gradient_group``
            instead of all-reduce over d (the distributed optimizer): after :meth:`finish`
            each rank holds, on its own 1/(d·c) shard of every bucket (:meth:`owned`), the
            gradient summed over CP and averaged over DP (the convention of
            :func:`~lightning_sp.parallel.grads.sum_context_parallel_grads`), and zeros
            elsewhere.
    """

    def __init__(
        self,
        params: Iterable[Tensor],
        state: ParallelState,
        bucket_numel: int = DEFAULT_BUCKET_NUMEL,
        deferred: Iterable[Tensor] = (),
        overlap: bool = True,
        backwards_per_step: int = 1,
        distributed: bool = False,
    ) -> None:
        self.state = state
        self.distributed = distributed
        self.overlap = overlap
        self.backwards_per_step = backwards_per_step
        self.sync = True
        """Whether this backward completes the step (off while Lightning accumulates)."""
        self.params = [p for p in params if p.requires_grad]
        # experts reduce over their expert-data group, in buckets of their own; sharded over
        # the d·c ranks they are ordinary parameters only when every rank holds them (e = 1)
        separate = not distributed or state.expert_parallel_size > 1
        deferred_ids = {id(p) for p in deferred}
        by_dtype: dict[torch.dtype, list[Tensor]] = {}
        for p in reversed(self.params):
            by_dtype.setdefault(grad_dtype(p), []).append(p)
        self.buffers: dict[torch.dtype, Tensor] = {}
        self.buckets: list[Bucket] = []
        self._bucket_of: dict[int, Bucket] = {}
        self._counts: dict[int, int] = {id(p): 0 for p in self.params}
        for dtype, group in by_dtype.items():
            experts = [p for p in group if separate and _expert(p)]
            dense = [p for p in group if not (separate and _expert(p))]
            plan = _plan(dense, bucket_numel, deferred_ids)
            plan += [(m, False, True) for m, *_ in _plan(experts, bucket_numel, set())]
            sizes = []
            for members, _, is_expert in plan:
                d = self._shards(is_expert)[0]
                sizes.append(-(-sum(p.numel() for p in members) // d) * d)
            flat = torch.zeros(sum(sizes), dtype=dtype, device=group[0].device)
            self.buffers[dtype] = flat
            start = 0
            for (members, is_deferred, is_expert), size in zip(plan, sizes, strict=True):
                data = flat[start : start + size]
                offsets, offset = [], 0
                for p in members:
                    p.main_grad = data[offset : offset + p.numel()].view_as(p)  # type: ignore[attr-defined]
                    offsets.append(offset)
                    offset += p.numel()
                bucket = Bucket(data, members, offsets, is_deferred, expert=is_expert)
                self.buckets.append(bucket)
                for p in members:
                    self._bucket_of[id(p)] = bucket
                start += size
        # the hooks hold the buffer weakly: a parameter's hooks live in C++, out of the
        # garbage collector's sight, and a strong one would keep the buffer (and its process
        # groups) alive for good
        on_grad = weakref.WeakMethod(self._on_grad)

        def hook(param: Tensor) -> None:
            method = on_grad()
            if method is not None:
                method(param)

        self._hooks = [p.register_post_accumulate_grad_hook(hook) for p in self.params]

    @property
    def numel(self) -> int:
        """Elements over all buffers."""
        return sum(b.numel() for b in self.buffers.values())

    @property
    def nbytes(self) -> int:
        """Bytes of all buffers (the gradients' real size)."""
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

    def _on_grad(self, param: Tensor) -> None:
        param.main_grad.add_(param.grad)  # type: ignore[attr-defined]
        param.grad = None
        if not self.sync:
            return
        self._counts[id(param)] += 1
        if self._counts[id(param)] != self.backwards_per_step:
            return
        bucket = self._bucket_of[id(param)]
        bucket.ready += 1
        if self.overlap and not bucket.deferred and bucket.ready == len(bucket.params):
            self._launch(bucket)
            bucket.launched_in_backward = True

    def _shards(self, expert: bool) -> tuple[int, int]:
        """``(shards, this rank's index)`` a bucket is split into: 1 unless distributed; the
        d·c ranks of the gradient group, or for an expert bucket the d·c/e of the
        expert-data group (index ``(dp_rank·c + cp_rank) // e``)."""
        state = self.state
        if not self.distributed:
            return 1, 0
        if expert:
            e = state.expert_parallel_size
            return state.expert_data_parallel_size, state.gradient_shard_rank // e
        return state.gradient_shards, state.gradient_shard_rank

    def _group_of(self, bucket: Bucket) -> dist.ProcessGroup | None:
        """The group ``bucket`` reduces (and, sharded, gathers) over."""
        return self.state.expert_data_group if bucket.expert else self.group

    def _shard_range(self, bucket: Bucket) -> tuple[int, int]:
        """``[lo, hi)`` of ``bucket`` that this rank owns (the whole bucket unless sharded)."""
        shards, rank = self._shards(bucket.expert)
        per = bucket.data.numel() // shards
        return rank * per, (rank + 1) * per

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The group the buffer reduces over: d ranks, or d·c when sharded."""
        return self.state.gradient_group if self.distributed else self.state.dp_group

    def _launch(self, bucket: Bucket) -> None:
        group = self._group_of(bucket)
        if group is None or bucket.handle is not None:
            return
        if self.distributed:  # the output is this rank's shard of the bucket itself
            lo, hi = self._shard_range(bucket)
            bucket.handle = dist.reduce_scatter_tensor(
                bucket.data[lo:hi], bucket.data, group=group, async_op=True
            )
        else:
            bucket.handle = dist.all_reduce(bucket.data, group=group, async_op=True)

    def owned(self) -> dict[int, tuple[int, int, Tensor]]:
        """``{id(param): (start, end, grad)}``: the flat range ``[start, end)`` of each
        parameter this rank owns and its gradient there (a view of the buffer)."""
        result = {}
        for bucket in self.buckets:
            lo, hi = self._shard_range(bucket)
            for p, offset in zip(bucket.params, bucket.offsets, strict=True):
                a, b = max(lo, offset), min(hi, offset + p.numel())
                if a < b:
                    result[id(p)] = (a - offset, b - offset, bucket.data[a:b])
        return result

    def gather(
        self, pieces: dict[int, Tensor], dtype: torch.dtype
    ) -> Iterator[tuple[Tensor, Tensor]]:
        """All-gather over the buffer's group (:attr:`group`): ``pieces`` maps
        ``id(param)`` to this rank's owned range of some per-element quantity (see
        :meth:`owned`); yields ``(param, the whole quantity in the parameter's shape)``, one
        bucket (one collective of the bucket's size, a fresh tensor) at a time."""
        for bucket in self.buckets:
            lo, hi = self._shard_range(bucket)
            full = torch.zeros(bucket.data.numel(), dtype=dtype, device=bucket.data.device)
            for p, offset in zip(bucket.params, bucket.offsets, strict=True):
                a, b = max(lo, offset), min(hi, offset + p.numel())
                if a < b:
                    full[a:b] = pieces[id(p)]
            group = self._group_of(bucket)
            if self.distributed and group is not None:
                dist.all_gather_into_tensor(full, full[lo:hi].clone(), group=group)
            for p, offset in zip(bucket.params, bucket.offsets, strict=True):
                yield p, full[offset : offset + p.numel()].view_as(p)

    def finish(self) -> None:
        """Launch the buckets not yet launched, wait for all, divide by the data-parallel
        size. Afterwards every ``main_grad`` is the data-parallel mean (sharded: summed over
        CP too, on this rank's shard, and zero elsewhere)."""
        d = self.state.data_parallel_size
        for bucket in self.buckets:
            self._launch(bucket)
        for bucket in self.buckets:
            if bucket.handle is not None:
                bucket.handle.wait()
                bucket.handle = None
            lo, hi = self._shard_range(bucket)
            if d > 1:
                bucket.data[lo:hi].div_(d)
            bucket.data[:lo].zero_()  # not this rank's shard: partial sums, dropped
            bucket.data[hi:].zero_()
        self.reset_counts()

    def reset_counts(self) -> None:
        """Forget which parameters were seen (the step is over, or was abandoned)."""
        for bucket in self.buckets:
            bucket.ready = 0
            bucket.launched_in_backward = False
        for key in self._counts:
            self._counts[key] = 0

    def zero(self) -> None:
        """Zero every gradient (all buffers) and drop stray ``param.grad``."""
        for flat in self.buffers.values():
            flat.zero_()
        for p in self.params:
            p.grad = None


def _expert(param: Tensor) -> bool:
    return getattr(param, "expert", False)


def _plan(
    params: Sequence[Tensor], bucket_numel: int, deferred: set[int]
) -> list[tuple[list[Tensor], bool, bool]]:
    """Cut ``params`` (in buffer order) into buckets: ``(members, deferred, expert)``
    (``expert`` False here: the caller plans the experts apart)."""
    plan: list[tuple[list[Tensor], bool, bool]] = []
    current: list[Tensor] = []
    size = 0
    for p in params:
        if id(p) in deferred:  # its own bucket: close the open one (buckets are contiguous)
            if current:
                plan.append((current, False, False))
                current, size = [], 0
            plan.append(([p], True, False))
            continue
        current.append(p)
        size += p.numel()
        if size >= bucket_numel:
            plan.append((current, False, False))
            current, size = [], 0
    if current:
        plan.append((current, False, False))
    return plan
