"""The distributed optimizer (ZeRO-1, as Megatron's): AdamW state sharded over data parallelism.

The gradient buffer (:class:`~lightning_sp.parallel.buffer.GradBuffer` with
``distributed=True``) reduce-scatters each bucket over the d·c ranks of dp x cp
(``ParallelState.gradient_group``; d for c = 1), so each ends backward with the gradient
(summed over CP, averaged over DP) of its 1/(d·c) of every bucket. :class:`DistributedAdamW`
keeps fp32 master weights and Adam moments for exactly that range (flat segments of the
parameters it overlaps),
steps them, writes the updated segments into the model's (bf16) parameters and all-gathers
them bucket by bucket, so every replica again holds the whole updated model. Per parameter a
rank keeps 12/(d·c) optimizer bytes (fp32 master, exp_avg, exp_avg_sq) instead of 12.

Checkpoints: each rank saves and loads only its own segments
(:meth:`DistributedAdamW.segments`), as chunks of the same per-parameter tensors the replicated
optimizer saves whole (:mod:`lightning_sp.checkpoint.shards`), so nothing is gathered
and a checkpoint reshards across d and between the two optimizers.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_sp.parallel.buffer import GradBuffer


def run_closure(closure: Any) -> Any:
    """An optimizer ``step``'s closure (forward and backward) with gradients enabled, as
    torch's optimizers run it; ``None`` without one."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class DistributedAdamW(torch.optim.AdamW):
    """AdamW over this data-parallel rank's shard of a sharded :class:`GradBuffer`.

    ``param_groups`` are given with the model parameters (as for ``AdamW``); each group's
    optimizer parameters become the fp32 master segments this rank owns (possibly none).
    """

    def __init__(
        self, param_groups: Iterable[dict[str, Any]], grad_buffer: GradBuffer, **defaults: Any
    ) -> None:
        if not grad_buffer.distributed:
            raise ValueError("DistributedAdamW needs a GradBuffer built with distributed=True")
        self.grad_buffer = grad_buffer
        self.model_params: list[Tensor] = []
        self._segments: list[tuple[Tensor, Tensor, int, int, Tensor]] = []
        owned = grad_buffer.owned()
        groups = []
        for group in param_groups:
            masters = []
            for p in group["params"]:
                self.model_params.append(p)
                if id(p) not in owned:
                    continue
                start, end, grad = owned[id(p)]
                master = p.detach().reshape(-1)[start:end].to(grad.dtype).clone()
                self._segments.append((master, p, start, end, grad))
                masters.append(master)
            groups.append({**group, "params": masters})
        super().__init__(groups, **defaults)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = run_closure(closure)
        for master, _, _, _, grad in self._segments:
            master.grad = grad
        super().step()
        for master, p, start, end, _ in self._segments:
            p.data.view(-1)[start:end].copy_(master)
        self._all_gather_weights()
        return loss

    def _all_gather_weights(self) -> None:
        """Every rank's updated segments into every replica's parameters."""
        pieces = {id(p): p.data.view(-1)[start:end] for _, p, start, end, _ in self._segments}
        dtype = self.model_params[0].dtype if self.model_params else torch.float32
        for p, full in self.grad_buffer.gather(pieces, dtype):
            p.data.copy_(full)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.grad_buffer.zero()
        for master, *_ in self._segments:
            master.grad = None

    # -- checkpoints -------------------------------------------------------------------------

    def segments(self) -> list[Segment]:
        """This rank's share of the optimizer state: one :class:`Segment` per parameter range
        it owns (none on a rank that owns nothing)."""
        return [
            Segment(p, start, end, master, self.state.get(master, {}))
            for master, p, start, end, _ in self._segments
        ]

    def masters_from_weights(self) -> None:
        """After a load: the masters of full-precision parameters, which a checkpoint does not
        hold apart from the weights (a full-precision weight is its own master), from the
        loaded weights."""
        with torch.no_grad():
            for master, p, start, end, _ in self._segments:
                if p.dtype == master.dtype:
                    master.copy_(p.detach().reshape(-1)[start:end])


@dataclass
class Segment:
    """The flat range ``[start, end)`` of ``param`` (its shard on this rank, flattened) that a
    data-parallel rank owns: its fp32 ``master`` and Adam ``state`` there (``exp_avg``,
    ``exp_avg_sq``: flat tensors of ``end - start`` elements; ``step``), live."""

    param: Tensor
    start: int
    end: int
    master: Tensor
    state: dict[str, Tensor]
