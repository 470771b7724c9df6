"""The distributed optimizer (ZeRO-1, as Megatron's): AdamW state sharded over data parallelism.

The gradient buffer (:class:`~lightning_sp.parallel.buffer.GradBuffer` with
``distributed=True``) reduce-scatters each bucket, so data-parallel rank r ends backward with
the mean gradient of its 1/d of every bucket. :class:`DistributedAdamW` keeps fp32 master
weights and Adam moments for exactly that range (flat segments of the parameters it overlaps),
steps them, writes the updated segments into the model's (bf16) parameters and all-gathers
them bucket by bucket, so every replica again holds the whole updated model. Per parameter a
rank keeps 12/d optimizer bytes (fp32 master, exp_avg, exp_avg_sq) instead of 12.

Checkpoints: :meth:`DistributedAdamW.full_view` gathers the state into the per-parameter form
that the replicated optimizer has (the same checkpoint keys), and :meth:`load_full_view`
keeps this rank's segments of a loaded one, so a checkpoint reshards across d and between the
two optimizers.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lightning_sp.parallel.buffer import GradBuffer

ADAM_STATE = ("exp_avg", "exp_avg_sq")


@dataclass
class FullOptimizerView:
    """The optimizer as the checkpoint code reads it: ``param_groups`` of whole fp32 masters,
    ``model_params`` beside them and per-master ``state`` (as
    :class:`~lightning_sp.training.optim.MasterWeightAdamW` has)."""

    param_groups: list[dict[str, Any]]
    model_params: list[Tensor]
    state: defaultdict[Tensor, dict[str, Tensor]] = field(default_factory=lambda: defaultdict(dict))


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
        self.model_groups: list[list[Tensor]] = []
        self._segments: list[tuple[Tensor, Tensor, int, int, Tensor]] = []
        self.steps_taken = 0
        """Updates made (the same on every rank, unlike which segments a rank owns)."""
        owned = grad_buffer.owned()
        groups = []
        for group in param_groups:
            masters = []
            self.model_groups.append(list(group["params"]))
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
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for master, _, _, _, grad in self._segments:
            master.grad = grad
        super().step()
        self.steps_taken += 1
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

    def full_view(self) -> FullOptimizerView:
        """The whole (unsharded) masters and Adam state, gathered over data parallelism."""
        pieces: dict[str, dict[int, Tensor]] = {"master": {}, **{n: {} for n in ADAM_STATE}}
        has_state = self.steps_taken > 0
        for master, p, *_ in self._segments:
            pieces["master"][id(p)] = master
            state = self.state.get(master, {})
            for name in ADAM_STATE:
                if has_state:
                    pieces[name][id(p)] = state[name]
        step = torch.tensor(float(self.steps_taken))
        full = {
            name: dict(self._gather(values))
            for name, values in pieces.items()
            if name == "master" or has_state
        }
        masters = {key: value.clone() for key, value in full["master"].items()}
        view = FullOptimizerView(
            [
                {**group, "params": [masters[id(p)] for p in model_group]}
                for group, model_group in zip(self.param_groups, self.model_groups, strict=True)
            ],
            list(self.model_params),
        )
        if has_state:
            for p in self.model_params:
                view.state[masters[id(p)]] = {
                    **{name: full[name][id(p)] for name in ADAM_STATE},
                    "step": step.clone(),
                }
        return view

    def _gather(self, values: dict[int, Tensor]) -> Iterable[tuple[int, Tensor]]:
        (grad_dtype,) = self.grad_buffer.buffers  # one gradient dtype per model
        for p, full in self.grad_buffer.gather(values, grad_dtype):
            yield id(p), full

    def load_full_view(self, view: FullOptimizerView) -> None:
        """Keep this rank's segments of a loaded :meth:`full_view` (no communication)."""
        masters = [m for group in view.param_groups for m in group["params"]]
        by_param = dict(zip((id(p) for p in view.model_params), masters, strict=True))
        for group, loaded in zip(self.param_groups, view.param_groups, strict=True):
            group.update({k: v for k, v in loaded.items() if k != "params"})
        with torch.no_grad():
            for master, p, start, end, _ in self._segments:
                whole = by_param[id(p)]
                # a full-precision weight is its own master (the replicated optimizer saves
                # none for it): take the loaded weight
                source = p if p.dtype == master.dtype else whole
                master.copy_(source.reshape(-1)[start:end])
                state = view.state.get(whole)
                if state:
                    self.steps_taken = int(state["step"].item())
                    self.state[master] = {
                        "step": state["step"].clone(),
                        **{n: state[n].reshape(-1)[start:end].clone() for n in ADAM_STATE},
                    }
            for p, whole in zip(view.model_params, masters, strict=True):
                if p.dtype != whole.dtype:
                    p.copy_(whole)
