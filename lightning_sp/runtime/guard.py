"""The non-finite guard: a NaN or Inf loss or gradient never reaches the weights unnoticed.

After forward, backward and the gradient reductions of a step, every rank tells every other
whether its loss, its gradient norm and the state moved after the previous optimizer step (the
MoE routers' expert biases: :class:`~lightning_sp.model.hooks.AfterOptimizerStep`) are finite
(one all-gather of three flags per rank, and of a stop signal it may have received:
:mod:`lightning_sp.runtime.shutdown`). If any is not, the policy decides, identically on every
rank:

* ``stop``: raise :class:`NonFiniteError`, one line naming the step, the ranks and the
  quantity. The optimizer has not stepped and no checkpoint of that state is written.
* ``skip``: drop the step's update (Megatron's behaviour for overflowed steps), count it, and go
  on; more than ``max_skipped_steps`` skips in a row stop the run as ``stop`` does.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_sp.parallel.grads import grad_of

POLICIES = ("stop", "skip")


class NonFiniteError(RuntimeError):
    """Training produced a non-finite loss or gradient norm (one line: step, ranks, quantity)."""


def _loss_of(result: Any) -> Tensor | None:
    if isinstance(result, Tensor):
        return result
    if isinstance(result, dict):
        return _loss_of(result.get("loss"))
    return None


def _grad_norm_nonfinite(module: nn.Module, grads: list[Tensor] | None) -> Tensor | None:
    """``True`` (a device tensor, not read here) where the norm of ``module``'s gradients (or
    of ``grads``, the storage that holds them all) is not finite; ``None`` without
    gradients."""
    if grads is None:
        grads = [g for p in module.parameters() if (g := grad_of(p)) is not None]
    if not grads:
        return None
    norms = torch._foreach_norm(grads)
    return ~torch.isfinite(torch.stack([n.float() for n in norms]).norm())


def _nonfinite_code(
    loss: Tensor | None, module: nn.Module, grads: list[Tensor] | None, state: list[Tensor]
) -> int:
    """``1·(loss not finite) + 2·(gradient norm not finite) + 4·(some tensor of state not
    finite)``, read from the device once (the step's one host-device synchronisation)."""
    flags: list[Tensor] = []
    if loss is not None:
        flags.append((~torch.isfinite(loss.detach()).all()).to(torch.int32))
    grad = _grad_norm_nonfinite(module, grads)
    if grad is not None:
        flags.append(grad.to(torch.int32) * 2)
    if state:
        bad = torch.stack([~torch.isfinite(t).all() for t in state]).any()
        flags.append(bad.to(torch.int32) * 4)
    if not flags:
        return 0
    return int(torch.stack([f.to(flags[0].device) for f in flags]).sum())


class NonFiniteGuard:
    """Checks each step (see the module docstring); ``skipped`` counts the skips in a row."""

    def __init__(self, policy: str = "stop", max_skipped_steps: int = 10) -> None:
        self.policy = policy
        self.max_skipped_steps = max_skipped_steps
        self.skipped = 0
        self.total_skipped = 0
        self.stop_signal = 0

    def check(
        self,
        result: Any,
        module: nn.Module,
        optimizer: Any,
        step: int,
        stop_signal: int = 0,
        grads: list[Tensor] | None = None,
        state: list[Tensor] | None = None,
    ) -> bool:
        """True if the step may update the weights; False to skip it (its gradients are
        zeroed); raises :class:`NonFiniteError` to stop. ``stop_signal``: a signal this rank
        received (0: none), exchanged in the same all-gather; afterwards ``self.stop_signal``
        holds the largest any rank reported, the same on every rank. ``grads``: tensors that
        hold every gradient of ``module`` (a gradient buffer's flat storage), read instead of
        the parameters one by one. ``state``: tensors moved after the previous optimizer step
        (:func:`~lightning_sp.model.hooks.stepped_state`)."""
        code = _nonfinite_code(_loss_of(result), module, grads, state or [])
        flags = torch.tensor([code & 1, code >> 1 & 1, code >> 2, stop_signal], dtype=torch.int32)
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if world > 1:
            gathered = [torch.zeros_like(flags) for _ in range(world)]
            dist.all_gather(gathered, flags)
            rows = [g.tolist() for g in gathered]  # [rank][(loss, grad, state, signal)]
        else:
            rows = [flags.tolist()]
        self.stop_signal = max(row[3] for row in rows)
        if not any(row[0] or row[1] or row[2] for row in rows):
            self.skipped = 0
            return True
        parts = []
        names = ("loss", "gradient norm", "state moved after the last optimizer step")
        for i, name in enumerate(names):
            ranks = [rank for rank, row in enumerate(rows) if row[i]]
            if ranks:
                parts.append(f"{name} (rank {', '.join(str(r) for r in ranks)})")
        where = f"non-finite {' and '.join(parts)} at step {step}"
        if self.policy == "skip" and self.skipped < self.max_skipped_steps:
            self.skipped += 1
            self.total_skipped += 1
            optimizer.zero_grad()
            return False
        if self.policy == "skip":
            raise NonFiniteError(
                f"{where}, after {self.skipped} skipped steps in a row "
                f"(max_skipped_steps={self.max_skipped_steps}); the run stops"
            )
        raise NonFiniteError(
            f"{where}; the run stops without saving this state (strategy nonfinite='skip' "
            "drops such steps instead)"
        )
